"""Palu (arXiv 2407.21118): the K/V projection weights are factored (group-head SVD) and the cache holds
the low-rank latents ``h = x A``.

Defining properties, each against an independent float64 computation: the cached latents are the
pre-RoPE keys/values projected by the weight's factor (``x W_gᵀ U_r``, RoPE undone), attention through
the cache equals attention through the factored projection ``x A B`` (RoPE re-applied), the latent's
size follows the rank byte for byte, and the energy threshold picks the documented rank of the
weight's spectrum. Plus: quantized / biased projections, the error without ``for_model``, trim."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, PaluOptions, dispatch
from veloxquant_mlx.cache.methods.crosslayer.palu import PALUKVCache
from veloxquant_mlx.cache.primitives import groupquant as gq

HIDDEN, N_KV, D, HQ = 96, 4, 16, 8
EPS32 = float(np.finfo(np.float32).eps)


def spectrum_weight(rng, out, hidden, decay):
    """[out, hidden] with singular values decay**i in random orthonormal bases."""
    U = np.linalg.qr(rng.standard_normal((out, out)))[0]
    V = np.linalg.qr(rng.standard_normal((hidden, out)))[0]
    return (U * decay ** np.arange(out)) @ V.T


class Attn(nn.Module):
    """The parts of an mlx_lm attention module that Palu reads: k_proj, v_proj, rope, n_kv_heads."""

    def __init__(self, seed=0, bias=False, traditional=False, decay=0.8, n_groups=2):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.n_kv_heads = N_KV
        self.k_proj = nn.Linear(HIDDEN, N_KV * D, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, N_KV * D, bias=bias)
        F = N_KV // n_groups * D
        for lin in (self.k_proj, self.v_proj):  # a decaying spectrum per head group
            w = np.concatenate([spectrum_weight(rng, F, HIDDEN, decay) for _ in range(n_groups)])
            lin.weight = mx.array(w.astype(np.float32))
            if bias:
                lin.bias = mx.array(rng.standard_normal(N_KV * D).astype(np.float32))
        self.rope = nn.RoPE(D, traditional=traditional, base=10000)


def project(attn, x, offset):
    """What an mlx_lm attention layer hands its cache for rows ``x [1, n, HIDDEN]`` at ``offset``."""
    n = x.shape[1]
    k = attn.k_proj(x).reshape(1, n, N_KV, D).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(1, n, N_KV, D).transpose(0, 2, 1, 3)
    return attn.rope(k, offset=offset), v


def np_rope(x, offset, traditional, base=10000.0):
    """float64 RoPE of rows x [..., n, D] at positions offset..offset+n-1."""
    n = x.shape[-2]
    ang = (offset + np.arange(n))[:, None] * base ** (-2.0 * np.arange(D // 2) / D)
    c, s = np.cos(ang), np.sin(ang)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def bound_cache(attn, **opts):
    cache = KVCacheFactory.create(KVCacheConfig(method="palu", head_dim=D, options=PaluOptions(**opts)))
    cache.bind_attention(attn)
    cache.factor()  # the factors now (a cache made by for_model makes them at its first compression)
    return cache


def f64(a):
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def factors(cache, which):
    """The cache's factor U_r per group [Hg, F, r] and offset [Hg, F] (float64 copies of what it holds)."""
    U = f64(getattr(cache, f"{which}_basis"))[0]
    mean = getattr(cache, f"{which}_mean")
    return U, (np.zeros(U.shape[:2]) if mean is None else f64(mean)[0, :, 0])


def grouped(x, hg):
    """[1, H, n, D] -> [Hg, n, s*D] (float64)."""
    _, H, n, _ = x.shape
    return x.reshape(hg, H // hg, n, D).transpose(0, 2, 1, 3).reshape(hg, n, -1)


def ungrouped(x, hg):
    return x.reshape(hg, x.shape[1], N_KV // hg, D).transpose(0, 2, 1, 3).reshape(N_KV, x.shape[1], D)


def np_attention(q, K, V, scale, n_new):
    """float64 GQA attention of q [HQ, N, D] over K/V [N_KV, M, D]; the last n_new rows causal."""
    rep = HQ // N_KV
    Kq, Vq = np.repeat(K, rep, axis=0), np.repeat(V, rep, axis=0)
    s = scale * q @ Kq.transpose(0, 2, 1)
    M = K.shape[1]
    visible = np.arange(M)[None] <= (M - n_new + np.arange(n_new))[:, None]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ Vq, np.abs(s[np.isfinite(s)]).max()


CALLS = [70, 1, 1, 20, 1, 9, 1]  # prefill chunks and decode steps (groups of 32 complete inside)


@pytest.mark.parametrize("variant", ["plain", "traditional+bias", "quantized_weights"])
def test_attention_through_the_cache_equals_the_factored_projection(variant):
    """The cached latents are ``h = x W_gᵀ U_r`` (RoPE undone, bias removed) up to their quantization
    step, and attention through the cache equals float64 attention whose past keys/values are
    ``RoPE(h B + b)`` / ``h_v B_v + b_v`` (B = U_rᵀ, the factored projection ``x A B``) over those
    latents, the float16 residual rows and the call's own rows, to float32 accuracy."""
    attn = Attn(seed=1, bias="bias" in variant, traditional="traditional" in variant)
    if variant == "quantized_weights":
        nn.quantize(attn, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear))
        assert isinstance(attn.k_proj, nn.QuantizedLinear)
    trad = "traditional" in variant
    cache = bound_cache(attn, rank=6, n_head_groups=2, hi_bit=8, lo_bit=8)
    assert cache.rank == cache.value_rank == 6 and cache.hg == 2
    dispatch.install()
    mx.random.seed(4)
    T = sum(CALLS)
    x = mx.random.normal((1, T, HIDDEN))
    Uk, bk = factors(cache, "k")
    Uv, bv = factors(cache, "v")
    # the cache's factors are the top-6 left singular vectors of each group's (dequantized) weight
    wk = f64(attn.k_proj.weight) if variant != "quantized_weights" else f64(mx.dequantize(
        attn.k_proj.weight, attn.k_proj.scales, attn.k_proj.biases, group_size=32, bits=8))
    for g in range(2):
        U_true = np.linalg.svd(wk[g * 32 : (g + 1) * 32], full_matrices=False)[0][:, :6]
        assert np.linalg.svd(U_true.T @ Uk[g], compute_uv=False).min() > 1 - 1e-3  # same span
    # float32 pre-RoPE projections, as the model computes them (bias included)
    k_pre = f64(attn.k_proj(x).reshape(1, T, N_KV, D).transpose(0, 2, 1, 3))
    v_pre = f64(attn.v_proj(x).reshape(1, T, N_KV, D).transpose(0, 2, 1, 3))
    scale, start = D**-0.5, 0
    for n in CALLS:
        q0, r0 = cache.n_quant, cache.n_res
        k, v = project(attn, x[:, start : start + n], start)
        q = mx.random.normal((1, HQ, n, D))
        keys, values = cache.update_and_fetch(k, v)
        out = f64(dispatch.dispatched_sdpa(q, keys, values, cache=cache, scale=scale,
                                           mask="causal" if n > 1 else None))[0]
        Ks, Vs = [], []
        if q0:
            hk = f64(cache._latents_t("k", q0))[0].transpose(0, 2, 1)  # [Hg, q0, r] as stored
            hv = f64(cache._latents_t("v", q0))[0].transpose(0, 2, 1)
            # the stored latents are the factored projection's, (x W_gᵀ + b - b) U_r, RoPE undone
            for h, U, b, pre in ((hk, Uk, bk, k_pre), (hv, Uv, bv, v_pre)):
                rows = grouped(pre[:, :, :q0], 2)
                want = np.einsum("gnf,gfr->gnr", rows - b[:, None], U)
                zg = want.reshape(2, q0 // 32, 32, -1)
                step = (zg.max(axis=2) - zg.min(axis=2)) / 255  # 8 bits over groups of 32 tokens
                # half a step, float16 scale/bias rounding, float16 rounding of the rows before projection
                bound = np.repeat(step / 2 + np.abs(zg).max(axis=2) * 2**-9, 32, axis=1)
                bound = bound + 2**-10 * np.linalg.norm(rows, axis=-1, keepdims=True)
                assert np.all(np.abs(h - want) <= bound), np.abs(h - want).max()
            Ks.append(np_rope(ungrouped(np.einsum("gnr,gfr->gnf", hk, Uk) + bk[:, None], 2), 0, trad))
            Vs.append(ungrouped(np.einsum("gnr,gfr->gnf", hv, Uv) + bv[:, None], 2))
        if r0:  # the float16 residual rows, as the model rotated them
            kr, vr = project(attn, x[:, q0 : q0 + r0], q0)
            Ks.append(f64(kr.astype(mx.float16))[0])
            Vs.append(f64(vr.astype(mx.float16))[0])
        Ks.append(f64(k)[0])
        Vs.append(f64(v)[0])
        K, V = np.concatenate(Ks, axis=1), np.concatenate(Vs, axis=1)
        ref, smax = np_attention(f64(q)[0], K, V, scale, n)
        # float32 accuracy: RoPE angles up to position T and scores of size smax, rounded in float32
        ds = 16 * EPS32 * (T + smax)
        tol = (math.exp(2 * ds) - 1) * np.abs(V).max() + 16 * EPS32 * np.abs(V).max()
        assert np.abs(out - ref).max() <= tol, (n, np.abs(out - ref).max(), tol)
        start += n
    assert cache.n_quant == 96 and cache.n_res == T - 96


def latent_bytes_per_token(bits, G=32):
    """Bytes per token per head group of latent channels with these widths: codes + float16 scale/bias
    per channel per G tokens (8 bits or fewer) or 2 bytes (float16 channel)."""
    return sum(2 if b == 16 else gq.words_per_group(b, G) * 4 / G + 4 / G for b in bits)


@pytest.mark.parametrize("quantize_values", [True, False])
def test_the_cached_latent_size_follows_the_rank_exactly(quantize_values):
    """Bytes held = the factors (F x r float16 per group) + the latent codes of r channels per token
    group + the float16 residual: exactly, for every rank; one more rank adds exactly one channel."""
    attn = Attn(seed=2)
    mx.random.seed(1)
    x = mx.random.normal((1, 160, HIDDEN))
    k, v = project(attn, x, 0)
    got = {}
    for r in (3, 4, 8):
        c = bound_cache(attn, rank=r, n_head_groups=2, hi_bit=4, lo_bit=2, hi_fraction=0.5,
                        quantize_values=quantize_values)
        c.update_and_fetch(k, v)
        assert (c.n_quant, c.n_res) == (160, 0)
        n_hi = math.ceil(r / 2)
        assert c.k_bits == [4] * n_hi + [2] * (r - n_hi)
        assert c.v_bits == (c.k_bits if quantize_values else [16] * r)
        assert c.k_basis.shape == c.v_basis.shape == (1, 2, 2 * D, r)
        factors_b = 2 * (2 * (2 * D) * r * 2)  # k and v: Hg x F x r float16
        latents = 2 * 160 * (latent_bytes_per_token(c.k_bits) + latent_bytes_per_token(c.v_bits))
        residual = c.res_k.nbytes + c.res_v.nbytes  # one float16 group per head, allocated once
        assert residual == 2 * N_KV * 32 * D * 2
        assert c.projection_bytes == factors_b
        assert c.used_nbytes == factors_b + latents + residual
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) >= c.used_nbytes
        got[r] = c.used_nbytes
    # one lo-bit channel more in each of the 2 groups, keys and values: a factor column + its codes
    one_channel = 2 * 2 * (2 * D) * 2 + 2 * 160 * (latent_bytes_per_token([2]) + (
        latent_bytes_per_token([2]) if quantize_values else 2))
    assert got[4] - got[3] == one_channel  # r 3 -> 4 adds a lo-bit channel (ceil(3/2) = ceil(4/2))


def test_energy_threshold_picks_the_documented_rank_of_the_weight_spectrum():
    """Rank = the smallest r whose top singular values hold the threshold of Σσ² in every head group
    (one rank per layer; keys and values each their own), from the weight, not from any data."""
    for decay_k, decay_v in ((0.8, 0.6), (0.6, 0.9)):
        attn = Attn(seed=3)
        rng = np.random.default_rng(5)
        for lin, decays in ((attn.k_proj, (decay_k, decay_k**1.5)), (attn.v_proj, (decay_v, decay_v))):
            w = np.concatenate([spectrum_weight(rng, 2 * D, HIDDEN, d) for d in decays])
            lin.weight = mx.array(w.astype(np.float32))
        for thr in (0.5, 0.9, 0.99):
            c = bound_cache(attn, energy_threshold=thr, n_head_groups=2)
            for which, lin, rank in (("k", attn.k_proj, c.rank), ("v", attn.v_proj, c.value_rank)):
                w = f64(lin.weight)
                want = 0
                for g in range(2):
                    e = np.linalg.svd(w[g * 2 * D : (g + 1) * 2 * D], compute_uv=False) ** 2
                    want = max(want, int(np.searchsorted(np.cumsum(e) / e.sum(), thr - 1e-9) + 1))
                assert rank == want, (which, thr, rank, want)
                assert getattr(c, f"{which}_basis").shape[-1] == want
    # n_head_groups: 4 KV heads, 3 requested -> 2 groups of 2 heads; 1 -> one group of all 4
    assert bound_cache(Attn(), n_head_groups=3).hg == 2
    assert bound_cache(Attn(n_groups=1), n_head_groups=1).k_basis.shape[:3] == (1, 1, 4 * D)


def test_without_the_model_palu_refuses_with_the_fix_in_the_message():
    cache = KVCacheFactory.create(KVCacheConfig(method="palu", head_dim=D))
    k = mx.random.normal((1, N_KV, 40, D))
    with pytest.raises(ValueError, match="KVCacheBuilder.for_model"):
        cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="k_proj and v_proj"):
        cache.bind_attention(nn.Linear(4, 4))


def test_trim_is_exact_in_the_residual_or_refused_and_keeps_the_factors():
    attn = Attn(seed=4)
    mx.random.seed(2)
    x = mx.random.normal((1, 104, HIDDEN))

    def fed(n):
        c = bound_cache(attn, rank=5)
        c.update_and_fetch(*project(attn, x[:, :n], 0))
        return c

    c = fed(104)
    assert c.trim(5) == 5
    ref = fed(99)
    assert (c.offset, c.n_quant, c.n_res) == (ref.offset, ref.n_quant, ref.n_res)
    for a, b in zip(c._dense(), ref._dense()):
        assert bool(mx.array_equal(a, b))
    with pytest.raises(ValueError, match="quantized group"):
        c.trim(20)
    assert c.trim(99) == 99 and c.empty() and c.k_basis is not None  # the weights' factors stay
    c.update_and_fetch(*project(attn, x[:, :40], 0))
    for a, b in zip(c._dense(), fed(40)._dense()):
        assert bool(mx.array_equal(a, b))


def test_short_chat_holds_float16_rows_and_no_factors_until_compressing_pays():
    """Rows stay float16 and no factor is held until the compressed form -- factors plus latent codes --
    is smaller than the float16 rows it replaces (``start_rows``, a multiple of G); from then on the
    cache is, bit for bit, the one that factored first and took the rows in one call."""
    from veloxquant_mlx.cache.contract import short_prompt_bound

    attn = Attn(seed=5)
    mx.random.seed(6)
    x = mx.random.normal((1, 200, HIDDEN))
    k, v = project(attn, x, 0)
    opts = dict(rank=48, n_head_groups=1, hi_bit=8, lo_bit=8)
    lazy = KVCacheFactory.create(KVCacheConfig(method="palu", head_dim=D, options=PaluOptions(**opts)))
    lazy.bind_attention(attn)
    assert lazy.k_basis is None and lazy.rank == 48
    start = lazy.start_rows(N_KV, D, D)
    fixed = 2 * N_KV * D * (48 + 1) * 2  # U_r of keys and values (+ a bias offset row each), float16
    codes = 2 * lazy.layout("k").bytes_per_token()  # one head group, keys and values
    fp16 = 2 * N_KV * 2 * D
    assert start % 32 == 0 and start > 32
    assert fixed + codes * start < fp16 * start and fixed + codes * (start - 32) >= fp16 * (start - 32)
    t = 0
    for n in [40] + [1] * 15 + [30, 20, 1, 94]:
        lazy.update_and_fetch(k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
        if t < start:
            assert lazy.n_quant == 0 and lazy.k_basis is None
            assert lazy.nbytes == lazy.res_k.nbytes + lazy.res_v.nbytes <= short_prompt_bound(t, 1, N_KV, D, D)
    eager = bound_cache(attn, **opts)
    eager.update_and_fetch(k, v)
    assert (lazy.n_quant, lazy.n_res, lazy.res_k.shape) == (eager.n_quant, eager.n_res, eager.res_k.shape)
    for a, b in zip(lazy._dense() + (lazy.k_basis, lazy.v_basis), eager._dense() + (eager.k_basis, eager.v_basis)):
        assert bool(mx.array_equal(a, b))
