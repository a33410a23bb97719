"""``attention.observed_attention``: the methods that read every query's attention probabilities (H2O, TOVA, CaM,
KVzip, Keyformer, NestedKV and the voters) get them in tiles of query rows instead of the call's whole [N, M] at once.
Tiles must change nothing: the output, the observed state and the rows kept equal one pass's; and the tiles' peak is
a fraction of one pass's."""

import mlx.core as mx
import numpy as np
import pytest

from contract_table import layer_call
from peak_memory import peak_of
from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, attention, dispatch
from veloxquant_mlx.cache.attention import attention_with_weights, observed_attention
from veloxquant_mlx.cache.primitives import blocks

B, HQ, H, D = 1, 4, 2, 16
TINY_TILES, ONE_TILE = 4096, 1 << 40  # block entries: tiles of a few query rows / the whole call


def _inputs(n, m, seed=3):
    return tuple(mx.random.normal(s, key=mx.random.key(seed * 10 + i))
                 for i, s in enumerate([(B, HQ, n, D), (B, H, m, D), (B, H, m, D)]))


def _masks(n, m):
    rows = mx.arange(m - n, m)[:, None] >= mx.arange(m)[None]
    holes = rows & (mx.arange(m)[None] % 7 != 3)  # causal with holes: an array mask cut per tile
    return {"none": None, "causal": "causal", "array": holes, "additive": mx.where(holes, 0.0, -mx.inf)}


@pytest.mark.parametrize("mask_kind", ["none", "causal", "array", "additive"])
@pytest.mark.parametrize("first_observed", [0, 150, 199])
def test_tiles_hand_observe_every_observed_row_once_in_order(mask_kind, first_observed, monkeypatch):
    """200 queries over 260 keys (60 before the call): the tiles' weights, put together, are one pass's rows from
    ``first_observed`` on, handed in order with their first row and the call's size; the output is one pass's."""
    n, m = 200, 260
    q, k, v = _inputs(n, m)
    mask = _masks(n, m)[mask_kind]
    want_out, want_w = attention_with_weights(q, k, v, scale=D**-0.5, mask=mask)
    got = []
    monkeypatch.setattr(attention, "block_entries", lambda: TINY_TILES)
    out = observed_attention(q, k, v, scale=D**-0.5, mask=mask, first_observed=first_observed,
                             observe=lambda w, first, total: got.append((first, total, w)), held=lambda: [])
    mx.eval(out, [w for *_, w in got])
    assert len(got) > 1 or n - first_observed == 1  # tiles, unless one row is observed
    assert [f for f, _, _ in got] == sorted(f for f, _, _ in got) and got[0][0] == first_observed
    assert all(t == n for _, t, _ in got)
    w = mx.concatenate([w for *_, w in got], axis=3)
    assert w.shape == (B, H, HQ // H, n - first_observed, m)
    # the same float32 softmax per row, over a prefix of the keys (masked keys are exact zeros either way)
    assert np.allclose(np.array(w), np.array(want_w[..., first_observed:, :]), rtol=1e-5, atol=1e-6)
    scale_v = float(mx.abs(v).max())
    assert np.allclose(np.array(out), np.array(want_out), rtol=1e-4, atol=1e-5 * scale_v)


METHODS = ["h2o", "tova", "pyramidkv", "chunkkv", "cam", "keyformer", "kvzip", "nestedkv"]


def _long_call(method, entries, monkeypatch):
    """One 700-row call (budget 512: it evicts) on a fresh cache of ``method`` with ``entries`` block entries."""
    dispatch.install()
    monkeypatch.setattr(attention, "block_entries", lambda: entries)
    c = KVCacheFactory.create(KVCacheConfig(method=method, dtype=mx.float32))
    c.gumbel_noise = False  # Keyformer's noise is keyed by its tiles
    q, k, v = _inputs(700, 700, seed=5)
    out = layer_call(c, q * 3, k, v)  # sharper attention: the scores separate the rows
    mx.eval(out)
    return c, out


@pytest.mark.parametrize("method", METHODS)
def test_a_long_call_in_tiles_keeps_what_one_pass_keeps(method, monkeypatch):
    one, out_one = _long_call(method, ONE_TILE, monkeypatch)
    tiled, out_tiled = _long_call(method, TINY_TILES, monkeypatch)
    assert one.uses_attention_weights
    assert np.allclose(np.array(out_tiled), np.array(out_one), rtol=1e-4, atol=1e-5 * 4)
    n = one.size()
    assert tiled.size() == n
    if method != "kvzip":  # KVzip evicts only when told to compress
        assert n < 700
    assert np.array_equal(np.array(tiled.positions[:, :, :n]), np.array(one.positions[:, :, :n]))
    for name in one.row_fields:
        a, b = np.array(getattr(tiled, name)[:, :, :n]), np.array(getattr(one, name)[:, :, :n])
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max()))), name


def _peak(fn):
    return peak_of(fn)[1]


def test_tiles_peak_at_a_fraction_of_one_pass(monkeypatch):
    """1024 queries over 1024 keys, 8 query heads: one pass holds at least the [8, 1024, 1024] float32
    probabilities (32 MB); the tiles (each observed into a running sum) hold a few tiles' (1 MB each)."""
    n, heads = 1024, 8
    q, kk, v = (mx.random.normal(s, key=mx.random.key(90 + i)) for i, s in
                enumerate([(1, heads, n, D), (1, 2, n, D), (1, 2, n, D)]))
    mx.eval(q, kk, v)
    acc = [mx.zeros((1, 2, n))]

    def observe(w, first, total):
        acc[0] = acc[0] + w.sum(axis=(2, 3))

    def one_pass():
        out, w = attention_with_weights(q, kk, v, scale=D**-0.5, mask="causal")
        return out, w.sum(axis=(2, 3))

    whole = _peak(one_pass)
    monkeypatch.setattr(attention, "block_entries", lambda: 1 << 18)
    tiled = _peak(lambda: [observed_attention(q, kk, v, scale=D**-0.5, mask="causal", observe=observe,
                                              held=lambda: acc), acc[0]])
    assert whole >= heads * n * n * 4  # one [8, 1024, 1024] float32 array at least
    assert tiled <= whole / 3, (tiled, whole)  # ~0.2 here
    assert np.allclose(np.array(acc[0]), np.array(one_pass()[1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "array", "additive"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("gpu_rules", [True, False])
def test_one_query_row_attends_as_the_fused_attention_and_weighs_in_float32(mask_kind, dtype, gpu_rules, monkeypatch):
    """A decode step's row: under a GPU's rules the output is MLX's fused attention itself (what the plain cache
    computes); either way the probabilities are float32 and those of a float64 softmax over the same (rounded)
    inputs, and the output their product with the values."""
    monkeypatch.setattr(blocks, "on_cpu", lambda: not gpu_rules)
    m = 37
    q, k, v = (x.astype(dtype) for x in _inputs(1, m, seed=7))
    mask = _masks(1, m)[mask_kind]
    out, w = attention_with_weights(q, k, v, scale=D**-0.5, mask=mask)
    assert w.dtype == mx.float32 and w.shape == (B, H, HQ // H, 1, m) and out.dtype == dtype
    fused_mask = mask if isinstance(mask, mx.array) and mask.dtype == mx.bool_ else None
    if mask_kind != "additive" and gpu_rules:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=fused_mask)
        assert np.array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))
    q64, k64, v64 = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (q, k, v))
    logits = np.einsum("bhrd,bhmd->bhrm", q64.reshape(B, H, HQ // H, D), k64) * D**-0.5
    if isinstance(mask, mx.array):
        logits = np.where(np.array(mask[0] if mask.dtype == mx.bool_ else mask[0] == 0), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(np.array(w[:, :, :, 0]), p, atol=1e-6)
    want_out = np.einsum("bhrm,bhmd->bhrd", p, v64).reshape(B, HQ, 1, D)
    tol = 1e-5 if dtype == mx.float32 else 2e-2  # bfloat16 output: 8 bits of mantissa
    assert np.allclose(np.array(out.astype(mx.float32)), want_out, atol=tol * float(np.abs(v64).max()))
