"""CacheGen (arXiv 2310.07240) and AMC (saliency-tiered precision): KIVI-layout subclasses. Each
method's defining property (CacheGen: bit-exact entropy coding that saves bytes, token deltas,
layer-wise bits; AMC: tier fractions and bytes follow k_high / k_mid) and byte accounting; the shared
contract (dispatch == dense attention, dense path, bytes budget, generate, state, deepcopy, trim, merge,
validation) and the per-method configs (``make``) are in test_quant_contract.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache import KVCacheConfig
from veloxquant_mlx.cache.base import method_info
from veloxquant_mlx.cache.methods.quantization.cachegen import CacheGenKVCache, layer_bits
from veloxquant_mlx.cache.primitives import entropy

from contract_table import caches_for, make, rand, run_chunks
from tiny_models import VOCAB, tiny_llama

METHODS = [m for m in ("cachegen", "amc") if method_info(m).implemented]


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(11)


# ------------------------------------------------------------------------------------- CacheGen
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_entropy_coder_bit_exact_and_smaller_on_gaussian_codes(bits):
    rng = np.random.default_rng(bits)
    S = 1 << bits
    T, n = 48, 400
    g = np.clip(np.round(rng.normal((S - 1) / 2, S / 6, (T, n))), 0, S - 1).astype(np.uint8)
    g[3] = 0  # a constant stream
    g[4] = rng.integers(0, S, n)  # a uniform stream
    for table_of, n_tables in ((np.arange(T), T), (np.arange(T) // 16, 3), (np.zeros(T, int), 1)):
        buf = entropy.encode(g, bits, table_of, n_tables)
        assert buf.dtype == np.uint8
        assert np.array_equal(entropy.decode(buf, T, n, bits, table_of, n_tables), g)
        fixed = T * entropy.raw_nbytes(n, bits)
        assert len(buf) <= fixed + 1 + (n_tables + 7) // 8  # never more than fixed width + header
        if 2 <= bits <= 4:  # (8 bits: a 256-entry table costs about what 7.4-bit entropy saves here)
            assert len(buf) < (0.97 if n_tables == T else 0.95) * fixed, (len(buf), fixed)
    u = rng.integers(0, S, (T, n)).astype(np.uint8)  # incompressible: stored raw, still exact
    buf = entropy.encode(u, bits, np.arange(T) // 16, 3)
    assert np.array_equal(entropy.decode(buf, T, n, bits, np.arange(T) // 16, 3), u)


def test_cachegen_saved_form_is_entropy_coded_exact_and_smaller():
    # Gaussian tokens around per-channel offsets, 1024 tokens: the min/max-scaled delta codes of a group
    # are bell-shaped, not uniform, so a static per-table code distribution saves bytes
    B, H, D, T = 1, 2, 64, 1024
    k = 3 * rand(B, H, 1, D) + rand(B, H, T + 10, D)
    v = rand(B, H, T + 10, D)
    for per_channel in (True, False):
        c = make("cachegen", bits=3, per_channel=per_channel)
        c.update_and_fetch(k, v)
        st = c.state
        assert st["k_stream"].dtype == mx.uint8 and "k_codes" not in st
        # the reported sizes are those of the bytes written
        side_k = sum(a.nbytes for a in c._side("k"))
        nb = st["stream_index"].shape[0]  # coded blocks (12 index bytes each: 8 counted for K, 4 for V)
        assert nb == 1 and c.compressed_key_bytes == st["k_stream"].size + 8 * nb + side_k
        assert c.compressed_value_bytes == st["v_stream"].size + 4 * nb + sum(a.nbytes for a in c._side("v"))
        assert c.fixed_width_key_bytes == B * H * D * (T // 32) * (4 * 3) + side_k
        assert c.fixed_width_key_bytes + c.fixed_width_value_bytes + c.res_k.nbytes * 2 == c.used_nbytes
        assert c.fp16_key_bytes == B * H * T * D * 2  # the T quantized tokens (the 10 newest are float16)
        assert c.compressed_key_bytes < c.fixed_width_key_bytes and c.compressed_value_bytes < c.fixed_width_value_bytes
        assert 0 < c.entropy_savings == pytest.approx(1 - c.compressed_key_bytes / c.fixed_width_key_bytes)
        assert c.assigned_avg_bits == pytest.approx(8 * c.compressed_key_bytes / (B * H * T * D))
        new = CacheGenKVCache.__new__(CacheGenKVCache)
        new.state = st  # decodes the streams
        g = T // 32
        assert bool(mx.array_equal(new.k_codes, c.k_codes[..., : g * 3]))
        assert bool(mx.array_equal(new.v_codes, c.v_codes[:, :, :T]))
        for x, y in zip(new._dense(), c._dense()):
            assert bool(mx.array_equal(x, y))
    # groups added later (decode steps) are coded as a new block; reading state again codes only them
    for _ in range(40):
        c.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
    assert c.fixed_width_key_bytes + c.fixed_width_value_bytes + c.res_k.nbytes * 2 == c.used_nbytes
    st = c.state
    assert st["stream_index"].shape[0] == 2 and c._blocks[1][:2] == (T // 32, T // 32 + 1)
    new = CacheGenKVCache.__new__(CacheGenKVCache)
    new.state = st
    for x, y in zip(new._dense(), c._dense()):
        assert bool(mx.array_equal(x, y))
    c.trim(c.n_res + 64)  # drops the new block and the last group of the first: both re-coded later
    assert c._blocks == [] and c.stored_rows() == c.n_quant == T - 32
    st = c.state
    new = CacheGenKVCache.__new__(CacheGenKVCache)
    new.state = st
    for x, y in zip(new._dense(), c._dense()):
        assert bool(mx.array_equal(x, y))


def test_cachegen_prompt_cache_file_roundtrip_smaller_than_fixed_width(tmp_path):
    model = tiny_llama(head_dim=32, n_layers=2)
    toks = [(i * 7 + (i * i) % 13) % VOCAB for i in range(300)]
    caches = caches_for(model, "cachegen", bits=2)
    run_chunks(model, caches, toks, [290, 1])
    paths = {}
    for coded in (True, False):
        for c in caches:
            c.save_entropy_coded = coded
        paths[coded] = str(tmp_path / f"c{int(coded)}.safetensors")
        mlx_cache.save_prompt_cache(paths[coded], caches)
    for c in caches:
        c.save_entropy_coded = True
    sizes = {k: os.path.getsize(p) for k, p in paths.items()}
    assert sizes[True] < sizes[False], sizes
    loaded = mlx_cache.load_prompt_cache(paths[True])
    nxt = toks[291:296]
    for a, b in zip(run_chunks(model, caches, nxt, [1] * 5), run_chunks(model, loaded, nxt, [1] * 5)):
        assert bool(mx.array_equal(a, b))


def test_cachegen_layer_schedule_and_deltas():
    assert layer_bits(30, 4, 3) == [6] * 10 + [5] * 10 + [4] * 10
    assert layer_bits(4, 7, 3) == [8, 8, 8, 7] and layer_bits(5, 2, 1) == [2] * 5
    model = tiny_llama(n_layers=6)
    caches = caches_for(model, "cachegen", bits=2)
    assert [c.qbits for c in caches] == [4, 4, 3, 3, 2, 2]
    # the widths are constructor arguments: the user's configs stay as given, the state keeps the width
    assert [c.config.cachegen_resolved_bits for c in caches] == [None] * 6
    assert [type(c).from_state(c.state).qbits for c in caches] == [4, 4, 3, 3, 2, 2]
    # token deltas: on token-local data (a smooth walk with a large offset per channel) the deltas
    # against the group's anchor span a much smaller range than the tokens in a per-token value group;
    # per-channel key groups already remove the channel offset (min/max), so keys change little
    k = 20 * rand(1, 2, 1, 64) + mx.cumsum(0.05 * rand(1, 2, 256, 64), axis=2)
    errs = {}
    for delta in (True, False):
        c = make("cachegen", bits=2, use_delta=delta, layer_groups=1)
        c.update_and_fetch(k, k)
        dk, dv = c._dense()
        errs[delta] = (float(mx.mean((dk - k) ** 2)), float(mx.mean((dv - k) ** 2)))
        if delta:  # the anchor row of every group is its 8-bit per-token code (error <= step / 2)
            a = k[:, :, ::32].reshape(1, 2, 8, 2, 32)
            step = (a.max(-1) - a.min(-1)) / 255
            err = mx.abs(dk[:, :, ::32] - k[:, :, ::32]).reshape(1, 2, 8, 2, 32).max(-1)
            assert bool(mx.all(err <= 0.51 * step + 0.02))
    assert errs[True][1] < 0.01 * errs[False][1] and errs[True][0] < 1.5 * errs[False][0], errs


# ------------------------------------------------------------------------------------- AMC
@pytest.mark.parametrize("k_high,k_mid", [(0.2, 0.3), (0.1, 0.2), (0.0, 0.5), (0.5, 0.5), (0.0, 0.0)])
def test_amc_tier_fractions_saliency_and_bytes_follow_mix(k_high, k_mid):
    B, H, D, T = 1, 2, 64, 512
    k = rand(B, H, T, D) * (1 + 2 * mx.random.uniform(shape=(B, H, T, 1)))  # varied key norms
    v = rand(B, H, T, D)
    c = make("amc", k_high=k_high, k_mid=k_mid)
    c.update_and_fetch(k, v)
    G = c.group
    tiers = c.tier_of_tokens().reshape(B, H, T // G, G)
    for i, frac in enumerate((k_high, k_mid, 1 - k_high - k_mid)):  # per group, in every group
        cnt = (tiers == i).sum(-1)
        assert bool(mx.all(cnt == cnt[0, 0, 0])) and abs(int(cnt[0, 0, 0]) / G - frac) <= 1 / G, (i, frac)
    # the tiers follow saliency (key norm): every token in a higher tier has a larger norm
    norm = mx.sqrt((k * k).sum(-1)).reshape(B, H, T // G, G)
    for hi_t, lo_t in ((0, 1), (1, 2), (0, 2)):
        a = mx.where(tiers == hi_t, norm, mx.inf).min(-1)
        b = mx.where(tiers == lo_t, norm, -mx.inf).max(-1)
        assert bool(mx.all(a >= b))
    # bytes follow the tier mix: each tier's arrays hold its rows at its own width
    g = T // G
    expect = B * H * T
    for t, bits in (("hi", 8), ("mid", 4), ("lo", 2)):
        rows = g * c.counts[t]
        arr = getattr(c, f"k_codes_{t}")
        assert (arr is None) == (rows == 0)
        if arr is not None:
            assert arr.shape[2] >= rows and arr.shape[3] == bits * 2  # 64 channels * bits / 32
        expect += 2 * B * H * rows * (bits * 64 // 8 + 2 * 4)
    assert c.used_nbytes == expect + c.res_k.nbytes + c.res_v.nbytes
    avg = (8 * c.counts["hi"] + 4 * c.counts["mid"] + 2 * c.counts["lo"]) / G
    assert c.assigned_avg_bits == avg and abs(avg - (8 * k_high + 4 * k_mid + 2 * (1 - k_high - k_mid))) <= 6 / G
    # precision follows the tiers: relative error is smallest in the 8-bit tier
    dk, _ = c._dense()
    err = (mx.mean((dk - k) ** 2, axis=-1) / mx.mean(k * k, axis=-1)).reshape(B, H, g, G)
    means = [float(mx.sum(mx.where(tiers == i, err, 0))) / max(1, int((tiers == i).sum())) for i in range(3)]
    present = [m for i, m in enumerate(means) if int((tiers == i).sum())]
    assert all(a < b for a, b in zip(present, present[1:])), means


# ------------------------------------------------------------------------------------ real model
# Measured by veloxquant eval --task kld (SmolLM2-135M float32 on the CPU, 512-token essay context +
# 32 scored decode steps): cachegen default (6/5/4 bits by layer third) KL 0.0020; amc default
# (6/10/16 of 32 tokens at 8/4/2 bits) KL 0.085. Here 256 + 16 tokens (faster), with margin.
N_CTX, N_SCORE = 256, 16
KL_LIMIT = {"cachegen": 0.03, "amc": 0.25}


@pytest.fixture(scope="module")
def real():
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.eval.fidelity import reference_logprobs
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=12 * (N_CTX + N_SCORE)), add_special_tokens=False)[: N_CTX + N_SCORE]
    return model, ids, reference_logprobs(model, ids, N_CTX, N_SCORE)


@pytest.mark.real_model
@pytest.mark.parametrize("method", list(METHODS))
def test_real_model_kl(real, method):
    from veloxquant_mlx.eval.fidelity import next_token_fidelity

    model, ids, ref = real
    r = next_token_fidelity(model, ids, N_CTX, N_SCORE, KVCacheConfig(method=method), ref_logp=ref)
    print(f"\n{method}: KL {r.kld:.4f} top1 {r.top1_agree:.2f} kv/fp16 {r.compression:.3f}")
    assert r.kld < KL_LIMIT[method] and r.compression < 0.6
