"""Tests for the TurboQuant standalone caches (arXiv 2504.19874)."""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.base import _CLASSES
from veloxquant_mlx.cache.errors import QuantizerConfigError
from veloxquant_mlx.cache.methods.quantization.turboquant import TurboQuantMSEKVCache, TurboQuantProdKVCache
from veloxquant_mlx.cache.primitives.codebook import lloyd_max_distortion
from veloxquant_mlx.core.abstractions import KVCache

from contract_table import cosine, exact_attention, held_arrays, standalone_config

D = 128
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}  # TurboQuant paper (Theorem 1)


def cfg(**kw):
    """The TurboQuant row of tests/contract_table.py ``STANDALONE`` (2 bits, a 128-dim sketch) with ``kw``."""
    return standalone_config("turboquant_mse", **kw)


def unit_rows(n, d=D, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


CLASSES = [TurboQuantMSEKVCache, TurboQuantProdKVCache]

# ------------------------------------------------------------------------------------ registration


def test_registered_and_implements_kvcache():
    assert _CLASSES["turboquant_mse"] is TurboQuantMSEKVCache
    assert _CLASSES["turboquant_prod"] is TurboQuantProdKVCache
    for cls in CLASSES:
        assert issubclass(cls, KVCache)
        assert "2504.19874" in importlib.import_module(cls.__module__).__doc__


# -------------------------------------------------------------------------------------- distortion


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_mse_distortion_matches_paper(b):
    x = unit_rows(3000, seed=b)
    cache = TurboQuantMSEKVCache(cfg(bit_width_inlier=b))
    cache.append_key(mx.array(x))
    xh = np.array(cache.reconstruct_keys())
    dist = float(np.mean(np.sum((x - xh) ** 2, axis=1)))
    assert dist <= math.sqrt(3) * math.pi / 2 * 4.0**-b  # paper's upper bound (Theorem 1)
    assert dist == pytest.approx(PAPER_MSE[b], rel=0.2)  # paper's reported values
    assert dist == pytest.approx(lloyd_max_distortion(b, D), rel=0.05)  # our codebook's own figure


def test_mse_distortion_scales_with_norm():
    x = unit_rows(1000, seed=9)
    norms = np.random.default_rng(1).uniform(0.1, 20, size=(1000, 1)).astype(np.float32)
    cache = TurboQuantMSEKVCache(cfg(bit_width_inlier=3))
    cache.append_key(mx.array(x * norms))
    xh = np.array(cache.reconstruct_keys())
    rel = np.sum((x * norms - xh) ** 2, axis=1) / norms[:, 0] ** 2
    assert float(rel.mean()) == pytest.approx(lloyd_max_distortion(3, D), rel=0.08)


def test_outlier_split_distortion_between_uniform_widths():
    x = unit_rows(1500, seed=4)
    dist = {}
    for name, kw in {
        "2": dict(bit_width_inlier=2),
        "3": dict(bit_width_inlier=3),
        "mix": dict(bit_width_inlier=2, bit_width_outlier=3, n_outlier_channels=32),
    }.items():
        c = TurboQuantMSEKVCache(cfg(**kw))
        c.append_key(mx.array(x))
        dist[name] = float(np.mean(np.sum((x - np.array(c.reconstruct_keys())) ** 2, axis=1)))
    assert dist["3"] < dist["mix"] < dist["2"]


def test_outlier_channels_are_the_high_magnitude_ones():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((64, D)).astype(np.float32)
    hot = np.sort(rng.choice(D, size=8, replace=False))
    k[:, hot] *= 20
    c = TurboQuantMSEKVCache(cfg(bit_width_inlier=2, bit_width_outlier=4, n_outlier_channels=8))
    c.append_key(mx.array(k))
    np.testing.assert_array_equal(np.array(c.outlier_channels), hot)
    # those channels are reconstructed better than with a uniform 2-bit cache
    u = TurboQuantMSEKVCache(cfg(bit_width_inlier=2))
    u.append_key(mx.array(k))
    err_split = np.sum((k - np.array(c.reconstruct_keys())) ** 2)
    err_uniform = np.sum((k - np.array(u.reconstruct_keys())) ** 2)
    assert err_split < 0.5 * err_uniform


def test_n_calib_tokens_limits_calibration_rows():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((40, D)).astype(np.float32)
    k[:10, :4] *= 30  # hot only in the first 10 rows
    k[10:, 100:104] *= 100  # much hotter afterwards
    c = TurboQuantMSEKVCache(cfg(n_outlier_channels=4, n_calib_tokens=10))
    c.append_key(mx.array(k))
    np.testing.assert_array_equal(np.array(c.outlier_channels), [0, 1, 2, 3])


# --------------------------------------------------------------------------------- inner products


def _prod_errors(b, m, seeds=80, n=32):
    k = unit_rows(n, seed=11)
    rng = np.random.default_rng(12)
    q = (k + 0.3 * rng.standard_normal((n, D)) / math.sqrt(D)).astype(np.float32)  # q correlated with k
    true = np.sum(q * k, axis=1)
    errs = []
    for s in range(seeds):
        c = TurboQuantProdKVCache(cfg(bit_width_inlier=b, jl_dim=m, seed=1000 + s))
        c.append_key(mx.array(k))
        errs.append(np.diagonal(np.array(c.key_scores(mx.array(q)))) - true)
    return np.array(errs)  # (seeds, n)


@pytest.mark.parametrize("b", [1, 2, 3])
def test_prod_inner_product_unbiased(b):
    e = _prod_errors(b, D)
    per_seed = e.mean(axis=1)  # independent across seeds (fresh rotation and sketch)
    se = per_seed.std(ddof=1) / math.sqrt(len(per_seed))
    assert abs(per_seed.mean()) < 4 * se
    # The MSE quantizer at the same bits is visibly biased on the same pairs (the test can fail).
    k = unit_rows(32, seed=11)
    q = (k + 0.3 * np.random.default_rng(12).standard_normal((32, D)) / math.sqrt(D)).astype(np.float32)
    mse = TurboQuantMSEKVCache(cfg(bit_width_inlier=1))
    mse.append_key(mx.array(k))
    bias = np.mean(np.diagonal(np.array(mse.key_scores(mx.array(q)))) - np.sum(q * k, axis=1))
    assert abs(bias) > 20 * se


def test_prod_variance_falls_with_sketch_size():
    v = {m: float(_prod_errors(2, m, seeds=40).var()) for m in (32, 128, 512)}
    assert v[128] < 0.6 * v[32]
    assert v[512] < 0.6 * v[128]
    # QJL bound: Var <= pi/(2m) ||r||^2 ||q||^2 with ||r||^2 ~ MSE(1 bit) ~ 0.36, ||q|| ~ 1
    for m, var in v.items():
        assert var < math.pi / (2 * m) * 0.37 * 1.1


def test_prod_with_outlier_split_unbiased():
    k = unit_rows(32, seed=21)
    q = (k + 0.3 * np.random.default_rng(22).standard_normal((32, D)) / math.sqrt(D)).astype(np.float32)
    true = np.sum(q * k, axis=1)
    per_seed = []
    for s in range(60):
        c = TurboQuantProdKVCache(cfg(n_outlier_channels=32, seed=s))
        c.append_key(mx.array(k))
        per_seed.append(np.mean(np.diagonal(np.array(c.key_scores(mx.array(q)))) - true))
    per_seed = np.array(per_seed)
    assert abs(per_seed.mean()) < 4 * per_seed.std(ddof=1) / math.sqrt(len(per_seed))


# ------------------------------------------------------------------------------------------ memory


def _theory_bytes_per_token(cls, b, m=D):
    values = D + 2  # int8 codes + fp16 scale
    if cls is TurboQuantMSEKVCache:
        return b * D / 8 + 2 + values
    return (b - 1) * D / 8 + (2 if b > 1 else 0) + m / 8 + 2 + values


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_memory_bytes_is_held_arrays_and_matches_budget(cls, b):
    n = 1024
    c = cls(cfg(bit_width_inlier=b))
    rng = np.random.default_rng(b)
    c.append_key(mx.array(rng.standard_normal((n // 2, D)).astype(np.float32)))
    c.append_value(mx.array(rng.standard_normal((n // 2, D)).astype(np.float32)))
    for i in range(n // 2):  # grows by doubling from the default 256 rows
        c.append_key(mx.array(rng.standard_normal(D).astype(np.float32)))
        c.append_value(mx.array(rng.standard_normal(D).astype(np.float32)))
    assert len(c) == n
    arrays = held_arrays(c)
    assert c.memory_bytes() + c.state_bytes() == sum(a.nbytes for a in arrays)
    per_token = c.memory_bytes() / n
    assert per_token == pytest.approx(_theory_bytes_per_token(cls, b), rel=0.10)


@pytest.mark.parametrize("cls", CLASSES)
def test_preallocated_rows_cost_the_budget(cls):
    """Capacity is allocated up front at the paper's bytes per token (growth by doubling and the held
    arrays: the shared standalone checks in test_standalone_methods.py)."""
    c = cls(cfg(capacity=64))
    c.append_key(mx.zeros((D,)) + 1)
    c.append_value(mx.zeros((D,)) + 1)
    assert c.memory_bytes() == pytest.approx(64 * _theory_bytes_per_token(cls, 2), rel=0.01)


def test_memory_with_outlier_split_spec_config():
    c = TurboQuantMSEKVCache(cfg(n_outlier_channels=32, capacity=100))
    c.append_key(mx.array(np.random.default_rng(0).standard_normal((100, D)).astype(np.float32)))
    c.append_value(mx.array(np.random.default_rng(1).standard_normal((100, D)).astype(np.float32)))
    theory = (32 * 3 + 96 * 2) / 8 + 2 * 2 + D + 2  # two groups, each with an fp16 norm
    assert c.memory_bytes() / 100 == pytest.approx(theory, rel=0.10)


# --------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("key_scale", [1.0, 2.0])
def test_attend_close_to_exact_at_4_bits(cls, key_scale):
    # key_scale 2 gives logits with std 2 (a peaked softmax); there Prod's QJL variance costs more
    # than MSE's bias, so only the mean cosine is held to 0.9 (per-query floor 0.8).
    rng = np.random.default_rng(7)
    n = 300
    k = (rng.standard_normal((n, D)) * key_scale).astype(np.float32)
    v = rng.standard_normal((n, D)).astype(np.float32)
    q = rng.standard_normal((8, D)).astype(np.float32)
    c = cls(cfg(bit_width_inlier=4))
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    out = np.array(c.attend(mx.array(q)))
    ref = exact_attention(q, k, v)
    assert out.shape == (8, D)
    cos = [cosine(out[i], ref[i]) for i in range(8)]
    if key_scale == 1.0:
        assert min(cos) > 0.9
    else:
        assert np.mean(cos) > 0.9 and min(cos) > 0.8
    single = np.array(c.attend(mx.array(q[0])))
    assert single.shape == (D,)
    np.testing.assert_allclose(single, out[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls, floor", [(TurboQuantMSEKVCache, 0.9), (TurboQuantProdKVCache, 0.7)])
def test_spec_example_config(cls, floor):
    # head_dim=128, inlier=2, outlier=3, jl_dim=128, seed=42; keys with 5 hot channels (x8)
    rng = np.random.default_rng(8)
    k = rng.standard_normal((200, D)).astype(np.float32)
    k[:, :5] *= 8
    v = rng.standard_normal((200, D)).astype(np.float32)
    q = rng.standard_normal((4, D)).astype(np.float32)
    ref = exact_attention(q, k, v)
    mean_cos = {}
    for n_out in (None, 32):
        c = cls(cfg(n_outlier_channels=n_out))
        c.append_key(mx.array(k[:150]))  # the first block calibrates the outlier channels
        c.append_key(mx.array(k[150:]))
        c.append_value(mx.array(v))
        out = np.array(c.attend(mx.array(q)))
        assert out.shape == (4, D) and np.all(np.isfinite(out))
        mean_cos[n_out] = np.mean([cosine(out[i], ref[i]) for i in range(4)])
    # the 2/3-bit outlier split (2.25 bits/channel) beats uniform 2 bits on such keys
    assert mean_cos[32] > mean_cos[None]
    assert mean_cos[32] > floor


@pytest.mark.parametrize("cls", CLASSES)
def test_scores_use_rotated_domain_consistently(cls):
    # key_scores (rotated-domain) equals <q, reconstructed key> (original domain)
    rng = np.random.default_rng(2)
    k = rng.standard_normal((50, D)).astype(np.float32)
    q = rng.standard_normal((3, D)).astype(np.float32)
    c = cls(cfg(bit_width_inlier=3, n_outlier_channels=16))
    c.append_key(mx.array(k))
    np.testing.assert_allclose(
        np.array(c.key_scores(mx.array(q))), q @ np.array(c.reconstruct_keys()).T, rtol=1e-3, atol=1e-3
    )


def test_values_int8_roundtrip_error():
    rng = np.random.default_rng(6)
    v = (rng.standard_normal((100, D)) * rng.uniform(0.01, 100, size=(100, 1))).astype(np.float32)
    c = TurboQuantMSEKVCache(cfg())
    c.append_value(mx.array(v))
    vh = np.array(c.reconstruct_values())
    err = np.abs(vh - v).max(axis=1) / np.abs(v).max(axis=1)
    assert np.all(err < 0.5 / 127 + 2e-3)  # half a step (+ fp16 scale rounding)
    c.append_value(mx.zeros((D,)))
    assert np.all(np.array(c.reconstruct_values())[-1] == 0)


def test_attend_on_partial_pairs_is_close_to_exact():
    """Only complete key/value pairs are attended (dtype, empty and partial-pair behaviour of every standalone
    cache: test_standalone_methods.py); over them 4-bit attention is close to exact attention."""
    rng = np.random.default_rng(1)
    c = TurboQuantMSEKVCache(cfg(bit_width_inlier=4))
    q16 = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.float16)
    k = rng.standard_normal((10, D)).astype(np.float32)
    v = rng.standard_normal((10, D)).astype(np.float32)
    c.append_key(mx.array(k))
    c.append_value(mx.array(v[:6]))
    assert len(c) == 6
    ref = exact_attention(np.array(q16, dtype=np.float32)[None], k[:6], v[:6])[0]
    assert cosine(np.array(c.attend(q16), dtype=np.float32), ref) > 0.9


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(  # the fields every standalone cache checks: test_standalone_methods.py
    "field, value",
    [("n_outlier_channels", 1), ("n_outlier_channels", D - 1), ("bit_width_outlier", 9), ("n_calib_tokens", 0)],
)
@pytest.mark.parametrize("cls", CLASSES)
def test_bad_config_raises_quantizer_config_error(cls, field, value):
    kw = {field: value}
    if field in ("n_outlier_channels",):
        kw["bit_width_outlier"] = 3
    if field == "bit_width_outlier":
        kw["n_outlier_channels"] = 8
    with pytest.raises(QuantizerConfigError) as info:
        cls(cfg(**kw))
    assert info.value.field == field


def test_prod_specific_config_errors():
    with pytest.raises(QuantizerConfigError) as info:
        TurboQuantProdKVCache(cfg(jl_dim=0))
    assert info.value.field == "jl_dim"
    # the API reference: bit_width_outlier None -> same as inlier (tests/test_spec_conformance_s27.py)
    assert TurboQuantMSEKVCache(cfg(n_outlier_channels=8, bit_width_outlier=None)).bit_width_outlier == 2
    assert TurboQuantProdKVCache(cfg(jl_dim=None)).jl_dim == D
    # 1-bit prod is pure QJL: no MSE codes are stored
    c = TurboQuantProdKVCache(cfg(bit_width_inlier=1, capacity=8))
    c.append_key(mx.ones((D,)))
    assert c.memory_bytes() == 8 * (D // 8 + 2)
