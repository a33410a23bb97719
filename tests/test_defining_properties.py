"""Defining-property guards (issue 16 items 5-8): each test checks the one step its paper is named for,
on data built so that the method *without* that step makes a different decision or a larger error.

* zipcache: the saliency is the normalized attention score (attention received / number of queries
  that could see the token), not the accumulated attention.
* kvzip: a row's importance is the *max* attention it receives from any reconstruction query.
* snapkv: the observation window's votes are pooled (a voted token keeps its neighbourhood), and
  only the window's queries vote (queries before it look elsewhere).
* kivi: values are quantized per token (a token's stored value depends on that token alone).
* turboquant_rvq: the cache rotates before quantizing, so anisotropic keys (outlier channels) meet
  TurboQuant's distortion bound through the cache, not only on the codebook's own distribution.
* kvquant: bound to the layer's RoPE, keys are quantized before RoPE.

tests/test_defining_mutations.py applies each break and expects the guard here to fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from tiny_models import tiny_llama
from veloxquant_mlx.cache import (
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    SnapKVOptions,
    TurboQuantRVQOptions,
    dispatch,
)
from veloxquant_mlx.cache.dispatch import dispatched_sdpa
from veloxquant_mlx.cache.options import KIVIOptions, KVzipOptions
from veloxquant_mlx.cache.primitives.rope import rope_spec

from contract_table import make


def layer_call(cache, q, k, v, scale):
    """What an mlx_lm attention layer does with a cache: mask, update, (dispatched) sdpa."""
    mask = cache.make_mask(q.shape[2])
    K, V = cache.update_and_fetch(k, v)
    return dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask)


def softmax64(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def causal_probs64(q, k, scale) -> np.ndarray:
    """float64 causal attention probabilities [Hq, T, T] of queries q [Hq, T, D] over keys k [Hq, T, D]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = scale * q @ k.swapaxes(-1, -2)
    T = s.shape[-1]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return softmax64(s)


def top_set(x: np.ndarray, n: int, margin: bool = True) -> set:
    """Indices of the n largest entries of x; with ``margin``, checks that the n-th and (n+1)-th are
    well apart (so the decision does not hinge on the last bits of a float sum)."""
    order = np.argsort(-x, kind="stable")
    if margin and n < len(x):
        assert x[order[n - 1]] > 1.2 * x[order[n]] + 1e-12, (x[order[n - 1]], x[order[n]])
    return set(order[:n].tolist())


@pytest.fixture(autouse=True)
def _dispatch():
    dispatch.install()
    yield


# ------------------------------------------------------------------------------------------ zipcache
def _zipcache_case():
    """Six 'salient' tokens late in the prompt (keys along the queries' direction u) and noise keys
    elsewhere. Causal queries before position 40 see no salient token and spread their attention over
    the early tokens, so the early tokens collect the largest *accumulated* attention; per query that
    could see them, the salient tokens receive far more."""
    H, Hq, T, D = 2, 4, 64, 16
    salient = [40, 44, 48, 52, 56, 60]
    rng = np.random.default_rng(5)
    u = np.zeros(D, np.float32)
    u[0] = 1.0
    k = 0.1 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    k[..., 0] = 0.0
    k[:, :, salient, 0] = 5.0 / 4.0  # logit 5 with |q| = 4 * sqrt(D) * (1/sqrt(D))
    q = np.broadcast_to(4.0 * math.sqrt(D) * u, (1, Hq, T, D)).astype(np.float32)
    q = q + 0.1 * rng.standard_normal(q.shape).astype(np.float32)
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    return q, k, v, salient, D**-0.5


def test_zipcache_hi_tokens_are_the_top_normalized_attention_not_the_top_accumulated():
    q, k, v, salient, scale = _zipcache_case()
    H, T = k.shape[1], k.shape[2]
    n_hi = len(salient)
    c = make("zipcache", hi_fraction=n_hi / T, hi_bits=4, lo_bits=2, group_size=32)
    layer_call(c, mx.array(q), mx.array(k), mx.array(v), scale)
    c.update_and_fetch(mx.zeros((1, H, 1, k.shape[3])), mx.zeros((1, H, 1, k.shape[3])))  # compresses the prompt
    assert (c.n_quant, c.n_hi, c.saliency_source) == (T, n_hi, "attention")
    rep = q.shape[1] // H
    kk = np.repeat(k[0], rep, axis=0)  # the KV head of every query head
    p = causal_probs64(q[0], kk, scale).reshape(H, rep, T, T)
    received = p.sum(axis=(1, 2))  # [H, T] accumulated attention
    viewers = rep * (T - np.arange(T))  # queries that could see each token
    flag = np.array(c.is_hi[0, :, :T, 0])
    for h in range(H):
        hi = set(np.nonzero(flag[h])[0].tolist())
        normalized, accumulated = top_set(received[h] / viewers, n_hi), top_set(received[h], n_hi, margin=False)
        assert hi == normalized == set(salient), (h, sorted(hi))
        assert len(accumulated & set(salient)) <= n_hi // 2, sorted(accumulated)  # the data tells them apart


# ------------------------------------------------------------------------------------------ kvzip
def test_kvzip_importance_is_the_max_over_reconstruction_queries():
    """Four 'spike' rows each get most of one reconstruction query's attention; eight 'broad' rows get a
    moderate share of every other reconstruction query's attention (more in total, less at most).
    KVzip keeps the spikes; a sum over the queries would keep broad rows instead."""
    H, T, D, R = 2, 48, 16, 16
    spikes, broad = [9, 19, 29, 39], [6, 12, 16, 23, 26, 33, 36, 43]
    n_sink = 2
    rng = np.random.default_rng(3)
    k = 0.05 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    for j, t in enumerate(spikes):
        k[:, :, t, 1 + j] = 3.0  # direction e_{1+j}
    k[:, :, broad, 5] = 1.0  # direction e_5
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    scale = D**-0.5
    qr = np.zeros((1, H, R, D), np.float32)
    for j in range(len(spikes)):
        qr[:, :, j, 1 + j] = 12.0  # query j finds spike j
    qr[:, :, len(spikes):, 5] = 16.0  # the other queries spread over the broad rows
    kr = 0.05 * rng.standard_normal((1, H, R, D)).astype(np.float32)  # the reconstruction's own rows
    c = KVCacheFactory.create(KVCacheConfig(method="kvzip", dtype=mx.float32,
                                            options=KVzipOptions(budget=n_sink + len(spikes), n_sink=n_sink)))
    ctx_q = rng.standard_normal((1, H, T, D)).astype(np.float32)  # prefill queries: unrelated
    layer_call(c, mx.array(ctx_q), mx.array(k), mx.array(v), scale)
    c.begin_reconstruction(reset=True)
    layer_call(c, mx.array(qr), mx.array(kr), mx.array(v[:, :, :R]), scale)
    c.end_reconstruction()
    c.compress()
    # float64 reference: probabilities of the reconstruction queries over [held rows, own rows (causal)]
    s = scale * qr[0].astype(np.float64) @ np.concatenate([k[0], kr[0]], axis=1).swapaxes(-1, -2)
    own = np.arange(R)
    s[:, :, T:] = np.where(own[None, :] <= own[:, None], s[:, :, T:], -np.inf)
    p = softmax64(s)[:, :, :T]  # [H, R, T]
    body = np.arange(T) >= n_sink
    for h in range(H):
        kept = set(np.array(c.positions[0, h, : c.size()]).tolist())
        by_max = top_set(np.where(body, p[h].max(axis=0), -1.0), len(spikes))
        by_sum = top_set(np.where(body, p[h].sum(axis=0), -1.0), len(spikes), margin=False)
        assert kept == set(range(n_sink)) | by_max == set(range(n_sink)) | set(spikes), (h, sorted(kept))
        assert not by_sum & set(spikes), sorted(by_sum)  # the data tells max from sum apart


# ------------------------------------------------------------------------------------------ snapkv
def snap(budget, obs, n_sink):
    return KVCacheFactory.create(KVCacheConfig(method="snapkv", dtype=mx.float32,
                                               options=SnapKVOptions(budget=budget, obs_window=obs, n_sink=n_sink)))


def test_snapkv_pools_the_window_votes_so_a_voted_token_keeps_its_neighbourhood():
    """The window votes heavily for one token (40) and lightly for six isolated ones. Pooled with a
    kernel of 7 the heavy vote spreads over 37..43, which outrank the light ones; unpooled votes
    would keep the isolated tokens instead of the neighbours."""
    H, T, D, obs, n_sink = 2, 96, 16, 8, 1
    needle, light = 40, [10, 20, 30, 55, 65, 75]
    rng = np.random.default_rng(4)
    k = 0.05 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    k[..., 0] = 0.0
    k[:, :, needle, 0] = 2.0
    k[:, :, light, 0] = 0.9
    q = 0.05 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    q[:, :, :, 0] = 4.0 * math.sqrt(D)
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    c = snap(n_sink + obs + 7, obs, n_sink)
    layer_call(c, mx.array(q), mx.array(k), mx.array(v), D**-0.5)
    votes = causal_probs64(q[0], k[0], D**-0.5)[:, T - obs :].sum(axis=1)  # [H, T]
    pooled = np.stack([np.convolve(np.pad(x, 3), np.ones(7) / 7, "valid") for x in votes])
    body = (np.arange(T) >= n_sink) & (np.arange(T) < T - obs)
    for h in range(H):
        kept = set(np.array(c.positions[0, h, : c.size()]).tolist()) - set(range(n_sink)) - set(range(T - obs, T))
        assert kept == top_set(np.where(body, pooled[h], -1.0), 7) == set(range(needle - 3, needle + 4)), sorted(kept)
        assert top_set(np.where(body, votes[h], -1.0), 7, margin=False) == {needle, *light}  # unpooled would differ


def test_snapkv_only_the_observation_window_votes():
    """Queries before the window look along a (at four 'decoy' keys), the window's queries along u (at
    four 'needle' keys). SnapKV keeps the needles and drops the decoys; all queries voting would
    keep the decoys, which draw ~15x more queries."""
    H, T, D, obs, n_sink = 1, 128, 16, 8, 1
    needles, decoys = [30, 60, 85, 100], [20, 50, 75, 95]
    rng = np.random.default_rng(6)
    k = 0.1 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    k[..., :2] = 0.0
    k[:, :, needles, 0] = 1.5
    k[:, :, decoys, 1] = 1.5
    q = 0.1 * rng.standard_normal((1, H, T, D)).astype(np.float32)
    q[:, :, : T - obs, 1] = 4.0 * math.sqrt(D)
    q[:, :, T - obs :, 0] = 4.0 * math.sqrt(D)
    v = rng.standard_normal((1, H, T, D)).astype(np.float32)
    c = snap(n_sink + obs + 7 * len(needles), obs, n_sink)
    layer_call(c, mx.array(q), mx.array(k), mx.array(v), D**-0.5)
    kept = set(np.array(c.positions[0, 0, : c.size()]).tolist())
    assert set(needles) <= kept and not set(decoys) & kept, sorted(kept)
    votes_all = causal_probs64(q[0], k[0], D**-0.5).sum(axis=1)[0]
    assert min(votes_all[decoys]) > 2 * max(votes_all[needles])  # all queries would prefer the decoys


# ------------------------------------------------------------------------------------------ kivi
KIVI_GROUP = 32


def _kivi(bits=2, G=KIVI_GROUP):
    return KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bits, head_dim=64,
                                               options=KIVIOptions(group_size=G)))


def test_kivi_values_are_quantized_per_token_and_keys_per_channel():
    """A token's stored value depends on that token alone (per-token groups), while its stored key
    depends on the other tokens of its G-token group (per-channel groups). Two caches see the same
    even tokens and different odd tokens (10x larger, with an outlier channel): the even tokens'
    dequantized values are bit-identical, their keys are not; each value is within one
    quantization step of the original, a step set by its own channel group."""
    B, H, T, D, G, bits = 1, 2, 64, 64, KIVI_GROUP, 2
    rng = np.random.default_rng(8)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k2, v2 = k.copy(), v.copy()
    odd = np.arange(1, T, 2)
    k2[:, :, odd] = 10 * rng.standard_normal((B, H, len(odd), D))
    v2[:, :, odd] = 10 * rng.standard_normal((B, H, len(odd), D))
    v2[:, :, odd, 7] += 200.0
    dense, steps = [], []
    for kk, vv in ((k, v), (k2, v2)):
        c = _kivi(bits, G)
        c.update_and_fetch(mx.array(kk), mx.array(vv))
        assert (c.n_quant, c.n_res) == (T, 0)
        dense.append([np.array(a) for a in c._dense()])
        steps.append(np.abs(np.array(c.v_scales[:, :, :T], np.float64)))  # [B, H, T, D / Gv]
    (dk1, dv1), (dk2, dv2) = dense
    even = np.arange(0, T, 2)
    assert np.array_equal(dv1[:, :, even], dv2[:, :, even])
    assert not np.allclose(dk1[:, :, even], dk2[:, :, even], atol=0.1)  # keys do depend on the group
    # each value is within one step of its own token's channel group (Gv = gcd(D, G) channels; MLX's
    # affine codes align one end of the range exactly, the other within a step), and that step follows
    # the token's own range (at most 1.5x its range / (2^b - 1), whatever the other tokens hold)
    gv = math.gcd(D, G)
    v16 = v.astype(np.float16).astype(np.float64).reshape(B, H, T, D // gv, gv)
    err = np.abs(dv1.astype(np.float64).reshape(v16.shape) - v16).max(-1)
    assert np.all(err <= steps[0] * (1 + 1e-2)), float((err / steps[0]).max())
    rng_t = (v16.max(-1) - v16.min(-1)) / (2**bits - 1)
    assert np.all(steps[0] <= 1.5 * rng_t) and np.array_equal(steps[0][:, :, even], steps[1][:, :, even])


# ------------------------------------------------------------------------------------------ turboquant_rvq
TQ_UPPER = math.sqrt(3) * math.pi / 2  # TurboQuant's distortion constant (~2.72)


def _tq_relative_mse(x: np.ndarray):
    """Relative MSE per row (keys, values) of rows x [1, H, T, D] stored by a turboquant_rvq cache
    and read back through its quantized path (rotation, codes, inverse rotation)."""
    c = KVCacheFactory.create(KVCacheConfig(head_dim=x.shape[-1], options=TurboQuantRVQOptions(residual_length=16)))
    c.update_and_fetch(mx.array(x), mx.array(x))
    n = c.n_quant
    assert n >= x.shape[2] - 64 and c.n_sink == 4
    dk, dv = (np.array(a, np.float64) for a in c._quantized_dense(n))
    ref = x[:, :, c.n_sink : c.n_sink + n].astype(np.float64)
    return [float(((d - ref) ** 2).sum(-1).mean() / (ref**2).sum(-1).mean()) for d in (dk, dv)], c


def test_turboquant_rvq_rotation_makes_the_cache_distortion_input_independent():
    """Keys with outlier channels and channel scales spread over two decades (what real keys look
    like) are quantized through the cache as well as isotropic ones: the random rotation turns
    every unit vector into a typical one. Both stay under TurboQuant's bound sqrt(3)*pi/2 * 4^-b at
    b = bits / sub_dim; without the rotation the codebook (fitted to rotated vectors) cannot
    represent a coordinate near 1 and the anisotropic error explodes."""
    H, T, D = 2, 336, 64
    rng = np.random.default_rng(9)
    iso = rng.standard_normal((1, H, T, D)).astype(np.float32)
    scales = 10.0 ** rng.uniform(-1.0, 1.0, D)
    scales[[3, 11]] = 40.0  # two fixed outlier channels
    aniso = (rng.standard_normal((1, H, T, D)) * scales).astype(np.float32)
    (k_iso, v_iso), c = _tq_relative_mse(iso)
    (k_an, v_an), _ = _tq_relative_mse(aniso)
    bk, bv = c.key_bits / c.key_sub_dim, c.value_bits / c.value_sub_dim
    for err, b in ((k_iso, bk), (k_an, bk), (v_iso, bv), (v_an, bv)):
        assert err < TQ_UPPER * 4.0**-b, (err, b)
    assert 0.7 < k_an / k_iso < 1.4 and 0.7 < v_an / v_iso < 1.4, (k_an, k_iso, v_an, v_iso)


# ------------------------------------------------------------------------------------------ kvquant
def test_kvquant_bound_to_the_layer_rope_quantizes_keys_before_it():
    """Keys that are one vector per head (plus small noise) rotated by RoPE: before RoPE each channel's
    range over a group is tiny, after it the fast rotary pairs sweep their circle. Bound to the
    layer's RoPE (as ``for_model`` does) the cache quantizes the pre-RoPE keys and its key error is
    far smaller; attention through the dispatch point still equals attention over its dense rows."""
    H, T, D = 2, 200, 64
    rope = nn.RoPE(D, traditional=False, base=10000.0)
    rng = np.random.default_rng(10)
    pre = 3 * rng.standard_normal((1, H, 1, D)) + 0.01 * rng.standard_normal((1, H, T, D))
    post = rope(mx.array(pre.astype(np.float32)))  # positions 0..T-1
    v = mx.array(rng.standard_normal((1, H, T, D)).astype(np.float32))
    errs, caches = {}, {}
    for name, layer_rope in (("pre", rope), ("post", None)):
        c = caches[name] = make("kvquant", bits=3)
        if layer_rope is not None:
            c.bind_attention(type("Attn", (), {"rope": layer_rope})())
        c.update_and_fetch(post, v)
        n = c.n_quant
        K = np.array(c._dense()[0][:, :, :n], np.float64)
        ref = np.array(post[:, :, :n].astype(mx.float16), np.float64)
        errs[name] = float(((K - ref) ** 2)[:, :, c.n_sink :].mean())
    assert errs["pre"] * 100 < errs["post"], errs
    # the bound cache's attention on the compressed form is attention over its dense (re-rotated) rows
    c = caches["pre"]
    q = mx.array(rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32))
    k1 = rope(mx.array(pre[:, :, :1].astype(np.float32)), offset=T)
    K, V = c.update_and_fetch(k1, v[:, :, :1])
    out = dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=None)
    assert float(mx.abs(out - ref).max()) < 1e-4 * float(mx.abs(ref).max()) + 1e-5


def test_for_model_binds_the_layer_rope_to_kvquant():
    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvquant"))
    spec = rope_spec(model.model.layers[0].self_attn.rope)
    assert spec is not None and all(c.rope == spec for c in caches)
