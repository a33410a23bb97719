"""Tests for the PolarQuant, QJL and SpectralQuant standalone caches, and the checks every standalone
method shares (TurboQuant too: its rows in tests/contract_table.py ``STANDALONE``)."""

from __future__ import annotations

import functools
import importlib
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, SlidingWindowKVCache
from veloxquant_mlx.cache.artifacts import InMemoryArtifactStore
from veloxquant_mlx.cache.base import _CLASSES, method_info
from veloxquant_mlx.cache.errors import CacheInputError, QuantizerConfigError
from veloxquant_mlx.cache.methods.quantization.polar import PolarQuantKVCache
from veloxquant_mlx.cache.methods.quantization.qjl import QJLKVCache
from veloxquant_mlx.cache.methods.quantization.spectral import SpectralQuantKVCache
from veloxquant_mlx.cache.primitives.polar import (
    angle_codebook,
    angle_density,
    angle_distortion,
    inverse_polar_transform,
    polar_levels,
    polar_transform,
    quantize_angles,
)
from veloxquant_mlx.cache.primitives.rotation import random_orthogonal
from veloxquant_mlx.cache.primitives.sketch import gaussian_jl
from veloxquant_mlx.core.abstractions import KVCache

from contract_table import (DROP_OLDEST_BUGS, STANDALONE, STANDALONE_METHODS, cosine, exact_attention, held_arrays,
                            standalone_config, with_known_bugs)

D = 128
CLASSES = [method_info(m).cls for m in STANDALONE]  # the shared checks below run on every standalone method


def cfg(**kw):
    return standalone_config(None, **kw)


# A low-rank-plus-noise key/value model: the kind of data SpectralQuant is built for.
_RNG = np.random.default_rng(1234)
_BASIS, _ = np.linalg.qr(_RNG.standard_normal((D, D)))
SPECTRUM = 10.0 * np.exp(-np.arange(D) / 3.0) + 0.05
_MEAN = 0.5 * _RNG.standard_normal(D)


@functools.lru_cache(maxsize=None)
def _lowrank(n, seed):
    g = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    out = np.array(mx.array(_MEAN, dtype=mx.float32) + mx.array(g * np.sqrt(SPECTRUM).astype(np.float32))
                   @ mx.array(_BASIS.T, dtype=mx.float32))
    out.setflags(write=False)
    return out


def lowrank_rows(n, seed):
    return _lowrank(n, seed).copy()


def make(cls, **kw):
    """A cache of the method's table settings whose spectral bases (if any) are calibrated up front from 512
    low-rank rows."""
    c = cls(standalone_config(cls.method_name, **kw))
    if STANDALONE[cls.method_name].calibrated:
        c.calibrate(keys=mx.array(lowrank_rows(512, 99)), values=mx.array(lowrank_rows(512, 98)))
    return c


def kv(n, seed, lowrank=False):
    if lowrank:
        return lowrank_rows(n, seed), lowrank_rows(n, seed + 1)
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, D)).astype(np.float32), rng.standard_normal((n, D)).astype(np.float32)


# ---------------------------------------------------------------------------------- registration


def test_every_standalone_method_has_a_row():
    assert sorted(STANDALONE) == sorted(STANDALONE_METHODS)


def test_registered_and_documented():
    for name, cls, paper in (
        ("polar", PolarQuantKVCache, "2502.02617"),
        ("qjl", QJLKVCache, "2406.03482"),
        ("spectral", SpectralQuantKVCache, "SpectralQuant"),
    ):
        assert _CLASSES[name] is cls and issubclass(cls, KVCache)
        doc = importlib.import_module(cls.__module__).__doc__
        assert paper in doc and "Deviations" in doc


# ------------------------------------------------------------------------------------ primitives


def test_polar_transform_roundtrip_and_ranges():
    x = np.random.default_rng(0).standard_normal((500, D)).astype(np.float32)
    radii, angles = polar_transform(mx.array(x), 4)
    assert radii.shape == (500, D // 16) and [a.shape[1] for a in angles] == [64, 32, 16, 8]
    np.testing.assert_allclose(np.array(inverse_polar_transform(radii, angles)), x, atol=2e-5)
    np.testing.assert_allclose(np.array(radii), np.linalg.norm(x.reshape(500, 8, 16), axis=2), rtol=1e-5)
    a1 = np.array(angles[0])
    assert a1.min() >= 0 and a1.max() < 2 * math.pi
    for a in angles[1:]:
        assert np.array(a).min() >= 0 and np.array(a).max() <= math.pi / 2
    assert [polar_levels(d) for d in (2, 6, 8, 96, 128, 7)] == [1, 1, 3, 4, 4, 0]


@pytest.mark.parametrize("level", [2, 3, 4])
def test_angle_laws_and_codebooks_match_data(level):
    # Angles of Gaussian vectors follow the paper's densities, and the Lloyd–Max codebooks' stated
    # distortion is what they achieve on such angles.
    x = np.random.default_rng(level).standard_normal((4000, D)).astype(np.float32)
    psi = np.array(polar_transform(mx.array(x), 4)[1][level - 1]).ravel()
    grid = np.linspace(0, math.pi / 2, 20001)
    dens = angle_density(level, grid)
    mean = np.trapezoid(grid * dens, grid)
    var = np.trapezoid((grid - mean) ** 2 * dens, grid)
    assert psi.mean() == pytest.approx(math.pi / 4, abs=0.01)
    assert psi.var() == pytest.approx(var, rel=0.05)
    for bits in (1, 2, 3):
        cb = angle_codebook(level, bits)
        err = np.mean((psi - np.array(cb)[np.array(quantize_angles(mx.array(psi), level, bits))]) ** 2)
        assert err == pytest.approx(angle_distortion(level, bits), rel=0.1)


def test_level1_angles_quantized_on_the_circle():
    psi = mx.array(np.array([0.0, 0.1, 2 * math.pi - 1e-4, 3.2], dtype=np.float32))
    codes = np.array(quantize_angles(psi, 1, 3))
    np.testing.assert_array_equal(codes, [0, 0, 7, 4])
    assert angle_distortion(1, 4) == pytest.approx((2 * math.pi / 16) ** 2 / 12)


# -------------------------------------------------------------------------------------- PolarQuant


def test_polar_bit_allocation_is_the_papers():
    c = PolarQuantKVCache(cfg(bit_width_inlier=4))
    assert c.levels == 4 and c.level_bits == [4, 2, 2, 2] and c.n_radii == 8
    assert c.key_bits_per_token / D == 3.875  # the paper's bits per coordinate
    assert PolarQuantKVCache(cfg(bit_width_inlier=2)).level_bits == [2, 1, 1, 1]
    assert PolarQuantKVCache(cfg(head_dim=8)).level_bits == [4, 2, 2]
    assert PolarQuantKVCache(cfg(head_dim=6)).level_bits == [4]


@pytest.mark.parametrize("b", [2, 3, 4, 6])
def test_polar_angle_codes_are_packed(b):
    n = 512
    c = PolarQuantKVCache(cfg(bit_width_inlier=b, capacity=n))
    k, v = kv(n, b)
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    key_bytes = c._keys.nbytes() / n
    theory = c.key_bits_per_token / 8  # packed codes + fp16 radii, no padding
    assert key_bytes == pytest.approx(theory, rel=0.10)
    one_byte_per_angle = (D - c.n_radii) + 2 * c.n_radii  # the reference system's layout
    assert key_bytes < 0.75 * one_byte_per_angle
    assert c.memory_bytes() / n == pytest.approx(theory + D + 2, rel=0.10)  # + int8 values, fp16 scale
    for lv, codes in enumerate(c.angle_codes()):
        codes = np.array(codes)
        assert codes.shape == (n, D >> (lv + 1)) and codes.max() < 2 ** c.level_bits[lv]


def test_polar_reconstruction_error_falls_with_bits_as_predicted():
    x = np.random.default_rng(3).standard_normal((1500, D)).astype(np.float32)
    x *= np.random.default_rng(4).uniform(0.1, 30, size=(1500, 1)).astype(np.float32)
    errs = []
    for b in range(1, 7):
        c = PolarQuantKVCache(cfg(bit_width_inlier=b))
        c.append_key(mx.array(x))
        rel = np.sum((x - np.array(c.reconstruct_keys())) ** 2, axis=1) / np.sum(x * x, axis=1)
        # Each level adds about ||k||^2 E[(psi - Q(psi))^2] (a small-angle approximation: not at 1 bit)
        predicted = sum(angle_distortion(lv + 1, bits) for lv, bits in enumerate(c.level_bits))
        if b > 1:
            assert rel.mean() == pytest.approx(predicted, rel=0.12)
        errs.append(rel.mean())
    assert all(a > 2 * b for a, b in zip(errs, errs[1:]))
    assert errs[3] < 0.035  # b = 4 (the paper's 3.875 bits/coordinate)


@pytest.mark.parametrize("key_scale", [1.0, 2.0])
def test_polar_attention_close_to_exact_at_4_bits(key_scale):
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((300, D)) * key_scale).astype(np.float32)
    v = rng.standard_normal((300, D)).astype(np.float32)
    q = rng.standard_normal((8, D)).astype(np.float32)
    c = PolarQuantKVCache(cfg(bit_width_inlier=4))
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    out = np.array(c.attend(mx.array(q)))
    ref = exact_attention(q, k, v)
    cos = [cosine(out[i], ref[i]) for i in range(8)]
    if key_scale == 1.0:
        assert min(cos) > 0.95
    else:  # logits with std 2: a peaked softmax magnifies score errors
        assert np.mean(cos) > 0.93 and min(cos) > 0.88
    np.testing.assert_allclose(
        np.array(c.key_scores(mx.array(q))), q @ np.array(c.reconstruct_keys()).T, rtol=1e-3, atol=1e-3
    )


# -------------------------------------------------------------------------------------------- QJL


def _qjl_errors(m, seeds, n=32):
    rng = np.random.default_rng(11)
    k = rng.standard_normal((n, D)).astype(np.float32)
    q = (0.5 * k + rng.standard_normal((n, D))).astype(np.float32)  # correlated pairs
    true = np.sum(q * k, axis=1)
    errs = []
    for s in range(seeds):
        c = QJLKVCache(cfg(jl_dim=m, seed=1000 + s))
        c.append_key(mx.array(k))
        errs.append(np.diagonal(np.array(c.key_scores(mx.array(q)))) - true)
    theory = (math.pi / 2 * np.sum(q * q, 1) * np.sum(k * k, 1) - true**2) / m
    return np.array(errs), theory  # (seeds, n), (n,)


def test_qjl_unbiased():
    e, _ = _qjl_errors(D, seeds=60)
    per_seed = e.mean(axis=1)  # independent across seeds (fresh sketch)
    se = per_seed.std(ddof=1) / math.sqrt(len(per_seed))
    assert abs(per_seed.mean()) < 4 * se
    assert se > 0


def test_qjl_variance_falls_as_one_over_m():
    var = {}
    for m in (64, 128, 256, 512):
        e, theory = _qjl_errors(m, seeds=40)
        var[m] = float(e.var(axis=0, ddof=1).mean())
        assert var[m] == pytest.approx(float(theory.mean()), rel=0.15)  # exact variance formula
    for m in (64, 128, 256):
        assert 1.6 < var[m] / var[2 * m] < 2.5


def test_qjl_score_correlation_grows_with_m():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2000, D)).astype(np.float32)
    q = rng.standard_normal((4, D)).astype(np.float32)
    exact = (q @ k.T).ravel()
    corr = {}
    for m in (D, 4 * D):
        c = QJLKVCache(cfg(jl_dim=m))
        c.append_key(mx.array(k))
        corr[m] = np.corrcoef(np.array(c.key_scores(mx.array(q))).ravel(), exact)[0, 1]
    # first-order prediction sqrt(1 / (1 + pi/2 * d/m)): 0.62 at m = d, 0.85 at m = 4d
    assert corr[D] == pytest.approx(0.62, abs=0.05)
    assert corr[4 * D] == pytest.approx(0.85, abs=0.04)
    assert QJLKVCache(cfg(jl_dim=None)).jl_dim == D


@pytest.mark.parametrize("m, b", [(128, 8), (256, 2), (512, 4), (96, 3)])
def test_qjl_signs_at_one_bit(m, b):
    n = 256
    c = QJLKVCache(cfg(jl_dim=m, bit_width_inlier=b, capacity=n))
    k, v = kv(n, 1)
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    theory = m / 8 + 2 + (b * D / 8 + 4)  # signs + fp16 norm + packed values + fp16 scale and min
    assert c.memory_bytes() / n == pytest.approx(theory, rel=0.10)
    assert c._keys.nbytes() / n == pytest.approx(m / 8 + 2, rel=0.10)
    expect = (k @ np.array(gaussian_jl(m, D, 42)).T) >= 0  # the stored bits are the signs of S k
    np.testing.assert_array_equal(np.array(c._signs(n)) > 0, expect)


def test_qjl_values_within_half_a_step():
    rng = np.random.default_rng(6)
    v = (rng.standard_normal((100, D)) * rng.uniform(0.01, 100, size=(100, 1))).astype(np.float32)
    for b in (2, 4, 8):
        c = QJLKVCache(cfg(bit_width_inlier=b))
        c.append_value(mx.array(v))
        vh = np.array(c.reconstruct_values())
        step = (v.max(1) - v.min(1)) / (2**b - 1)
        assert np.all(np.abs(vh - v).max(axis=1) <= 0.5 * step * 1.01 + 2e-3 * np.abs(v).max(axis=1))
    c.append_value(mx.full((D,), 3.0))
    np.testing.assert_allclose(np.array(c.reconstruct_values())[-1], 3.0)


def test_qjl_attention_improves_with_m():
    rng = np.random.default_rng(80)
    k, v = kv(300, 8)
    q = rng.standard_normal((8, D)).astype(np.float32)
    ref = exact_attention(q, k, v)
    mean_cos = {}
    for m in (D, 8 * D):
        c = QJLKVCache(cfg(jl_dim=m, bit_width_inlier=8))
        c.append_key(mx.array(k))
        c.append_value(mx.array(v))
        out = np.array(c.attend(mx.array(q)))
        mean_cos[m] = np.mean([cosine(out[i], ref[i]) for i in range(8)])
    assert mean_cos[8 * D] > mean_cos[D] + 0.1 and mean_cos[8 * D] > 0.85


# ---------------------------------------------------------------------------------- SpectralQuant


def test_spectral_reconstruction_error_falls_with_d_eff():
    x = lowrank_rows(1000, 5)
    errs = []
    for r in (1, 2, 4, 8, 16, 32, 128):
        c = make(SpectralQuantKVCache, spectral_key_d_eff=r, spectral_apply_qjl=False)
        c.append_key(mx.array(x))
        errs.append(np.sum((x - np.array(c.reconstruct_keys())) ** 2) / np.sum((x - _MEAN) ** 2))
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 0.02  # d_eff = head_dim: only the 4-bit quantization error is left


def test_spectral_energy_captured_matches_spectrum():
    c = make(SpectralQuantKVCache, spectral_key_d_eff=8)
    lam = np.array(c.eigenvalues("key"))
    np.testing.assert_allclose(lam[:8], SPECTRUM[:8], rtol=0.2)  # 512 calibration rows
    assert c.participation_ratio("key") == pytest.approx(SPECTRUM.sum() ** 2 / (SPECTRUM**2).sum(), rel=0.1)
    held_out = lowrank_rows(2000, 6)
    centred = held_out - np.array(c.mean("key"))
    for r in (1, 4, 8):
        basis = np.array(c.basis("key"))[:, :r]
        captured = np.sum((centred @ basis) ** 2) / np.sum(centred**2)
        assert captured == pytest.approx(SPECTRUM[:r].sum() / SPECTRUM.sum(), abs=0.03)
    assert c.captured_energy("key") == pytest.approx(SPECTRUM[:8].sum() / SPECTRUM.sum(), abs=0.03)


def test_spectral_qjl_residual_removes_score_bias():
    k = lowrank_rows(64, 7)
    q = (k + 0.5 * np.random.default_rng(8).standard_normal(k.shape)).astype(np.float32)
    true = np.sum(q * k, axis=1)
    bias = {}
    for qjl in (False, True):
        per_seed = []
        for s in range(30):
            c = SpectralQuantKVCache(cfg(bit_width_inlier=2, spectral_apply_qjl=qjl, seed=s))
            c.calibrate(keys=mx.array(lowrank_rows(512, 99)))
            c.append_key(mx.array(k))
            per_seed.append(np.mean(np.diagonal(np.array(c.key_scores(mx.array(q)))) - true))
        bias[qjl] = np.array(per_seed)
    se = bias[True].std(ddof=1) / math.sqrt(30)
    assert abs(bias[True].mean()) < 4 * se
    assert abs(bias[False].mean()) > 20 * se  # truncation misses <q, residual> > 0


def test_spectral_memory_per_token():
    n = 256
    c = make(SpectralQuantKVCache, bit_width_inlier=2, capacity=n)
    k, v = kv(n, 3, lowrank=True)
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    info = (4 * 2 / 8 + 2 + D / 8 + 2) + (50 * 2 / 8 + 2)  # 4 coeffs, rho, signs, ||e||; 50 coeffs, rho
    padded = (4 + 2 + 16 + 2) + (16 + 2)  # codes padded to whole 32-bit words
    assert c.memory_bytes() / n == padded and padded / info < 1.2
    assert c.memory_bytes() / n < 512 / 10  # > 10x smaller than fp16 K+V


def test_spectral_attention_close_to_exact_on_low_rank_data():
    k, v = kv(300, 9, lowrank=True)
    q = 2 * (lowrank_rows(8, 77) - _MEAN)  # queries in the key subspace: logits with std ~2.3
    ref = exact_attention(q, k, v)
    mean_cos = {}
    for name, kw in {"full": dict(spectral_key_d_eff=D, spectral_val_d_eff=D), "default": {}}.items():
        c = make(SpectralQuantKVCache, **kw)  # default: 4 key / 50 value directions, QJL, 4 bits
        c.append_key(mx.array(k))
        c.append_value(mx.array(v))
        out = np.array(c.attend(mx.array(q)))
        mean_cos[name] = np.mean([cosine(out[i], ref[i]) for i in range(8)])
    assert mean_cos["full"] > 0.995 and mean_cos["default"] > 0.97


def test_spectral_calibrates_from_first_rows_and_store():
    store = InMemoryArtifactStore()
    name = "org/model v1"
    k, v = kv(300, 11, lowrank=True)
    a = SpectralQuantKVCache(cfg(store=store, spectral_model_name=name))
    for i in range(D - 1):  # single vectors are held exactly until head_dim rows have arrived
        a.append_key(mx.array(k[i]))
        a.append_value(mx.array(v[i]))
    assert not a.calibrated("key") and a.memory_bytes() == 2 * (D - 1) * D * 4
    q = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    np.testing.assert_allclose(
        np.array(a.attend(mx.array(q))), exact_attention(q[None], k[: D - 1], v[: D - 1])[0], rtol=1e-4, atol=1e-5
    )
    a.append_key(mx.array(k[D - 1 :]))  # the 128th row triggers calibration (on all held rows)
    a.append_value(mx.array(v[D - 1 :]))
    assert a.calibrated("key") and a.calibrated("value") and len(a) == 300
    assert a.memory_bytes() < 300 * 100
    assert any(key.startswith("org_2f_model_20_v1.spectral.key.d128") for key in store._items)
    # A second cache for the same model loads the bases and encodes identically.
    b = SpectralQuantKVCache(cfg(store=store, spectral_model_name=name))
    assert b.calibrated("key") and b.calibrated("value")
    b.append_key(mx.array(k))
    b.append_value(mx.array(v))
    np.testing.assert_array_equal(np.array(a.reconstruct_keys()), np.array(b.reconstruct_keys()))
    np.testing.assert_array_equal(np.array(a.reconstruct_values()), np.array(b.reconstruct_values()))
    assert not SpectralQuantKVCache(cfg(store=store, spectral_model_name="other")).calibrated("key")
    # n_calib_tokens: calibration on the first 16 rows
    c = SpectralQuantKVCache(cfg(n_calib_tokens=16))
    c.append_key(mx.array(k[:10]))
    assert not c.calibrated("key")
    c.append_key(mx.array(k[10:40]))
    assert c.calibrated("key") and c.n_keys == 40
    with pytest.raises(CacheInputError):
        c.calibrate(keys=mx.array(k))  # already holds encoded keys


def test_spectral_d_eff_clipped_to_head_dim():
    c = SpectralQuantKVCache(cfg(head_dim=16, spectral_key_d_eff=40, spectral_val_d_eff=50))
    assert c.key_d_eff == 16 and c.val_d_eff == 16


# ------------------------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("cls", CLASSES)
def test_single_vectors_equal_block(cls):
    k, v = kv(20, 4, lowrank=True)
    a, b = make(cls, bit_width_inlier=3), make(cls, bit_width_inlier=3)
    a.append_key(mx.array(k))
    a.append_value(mx.array(v))
    for i in range(20):
        b.append_key(mx.array(k[i]))
        b.append_value(mx.array(v[i]))
    assert len(a) == len(b) == 20
    np.testing.assert_array_equal(np.array(a.reconstruct_keys()), np.array(b.reconstruct_keys()))
    np.testing.assert_array_equal(np.array(a.reconstruct_values()), np.array(b.reconstruct_values()))
    q = mx.array(k[:3])
    np.testing.assert_allclose(np.array(a.attend(q[0])), np.array(a.attend(q))[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", CLASSES)
def test_memory_bytes_is_held_arrays_and_grows_by_doubling(cls):
    from veloxquant_mlx.cache.standalone_util import INITIAL_ROWS as R

    c = make(cls)
    assert c.memory_bytes() == 0
    k, v = kv(R + 1, 2, lowrank=True)
    c.append_key(mx.array(k[:1]))
    c.append_value(mx.array(v[:1]))
    one = c.memory_bytes()
    c.append_key(mx.array(k[1:R]))
    c.append_value(mx.array(v[1:R]))
    assert c.memory_bytes() == one
    c.append_key(mx.array(k[R : R + 1]))
    c.append_value(mx.array(v[R : R + 1]))
    assert c.memory_bytes() == 2 * one
    assert sum(a.nbytes for a in held_arrays(c)) == c.memory_bytes() + c.state_bytes()


@pytest.mark.parametrize("cls", CLASSES)
def test_capacity_is_the_most_tokens_stored(cls):
    """``capacity`` is the spec's "maximum tokens to store": the rows held grow to it and no further (100 rows,
    not the doubling's 128), and an append past it raises naming it, storing nothing of that append."""
    c = make(cls, capacity=100)
    k, v = kv(101, 3, lowrank=True)
    c.append_key(mx.array(k[:1]))
    c.append_value(mx.array(v[:1]))
    one = c.memory_bytes()  # 100 rows' worth at once: min(capacity, INITIAL_ROWS)
    c.append_key(mx.array(k[1:100]))
    c.append_value(mx.array(v[1:100]))
    assert len(c) == 100 and c.memory_bytes() == one
    keys = np.array(c.reconstruct_keys())
    for append, rows in ((c.append_key, k), (c.append_value, v)):
        with pytest.raises(ValueError, match="capacity=100 tokens: 100 stored, 1 more refused"):
            append(mx.array(rows[100:101]))
    with pytest.raises(ValueError, match="capacity=100"):
        c.append_key(mx.array(k[95:101]))  # a block that would cross it: none of it is stored
    assert len(c) == 100 and c.memory_bytes() == one
    np.testing.assert_array_equal(np.array(c.reconstruct_keys()), keys)


@pytest.mark.parametrize("cls", with_known_bugs(CLASSES, DROP_OLDEST_BUGS, lambda c: c.method_name))
def test_drop_oldest_and_sliding_window(cls):
    k, v = kv(40, 5, lowrank=True)
    q = mx.array(np.random.default_rng(1).standard_normal((2, D)).astype(np.float32))
    a, ref = make(cls), make(cls)
    a.append_key(mx.array(k))
    a.append_value(mx.array(v))
    a.drop_oldest(25)
    ref.append_key(mx.array(k[25:]))
    ref.append_value(mx.array(v[25:]))
    assert len(a) == 15
    np.testing.assert_allclose(np.array(a.attend(q)), np.array(ref.attend(q)), rtol=1e-5, atol=1e-5)
    with pytest.raises(CacheInputError):
        a.drop_oldest(-1)
    # The factory's sliding window keeps the compressed last window.
    method = cls.method_name
    win = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, bit_width_inlier=4, sliding_window=8,
                                              n_calib_tokens=8))
    assert isinstance(win, SlidingWindowKVCache)
    mx.random.seed(3)
    K, V = mx.random.normal((30, 64)), mx.random.normal((30, 64))
    win.append_key(K[:10])
    win.append_value(V[:10])
    for i in range(10, 30):
        win.append_key(K[i])
        win.append_value(V[i])
    assert len(win) == 8
    one = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, bit_width_inlier=4, n_calib_tokens=8))
    one.append_key(K[:10])  # same calibration rows as the windowed cache (spectral)
    one.append_value(V[:10])
    one.drop_oldest(10)
    one.append_key(K[-8:])
    one.append_value(V[-8:])
    qq = mx.random.normal((64,))
    assert mx.allclose(win.attend(qq), one.attend(qq), atol=1e-5)


@pytest.mark.parametrize("cls", CLASSES)
def test_reset_keeps_quantizer_state(cls):
    k, v = kv(30, 6, lowrank=True)
    c = make(cls)
    state = [np.array(a) for a in held_arrays(c)]
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    first = np.array(c.reconstruct_keys())
    c.reset()
    assert len(c) == 0 and c.n_keys == 0 and c.n_values == 0 and c.memory_bytes() == 0
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(state, held_arrays(c)))
    c.append_key(mx.array(k))
    c.append_value(mx.array(v))
    np.testing.assert_array_equal(np.array(c.reconstruct_keys()), first)
    if STANDALONE[cls.method_name].rotation:
        np.testing.assert_array_equal(np.array(c.rotation), np.array(random_orthogonal(D, 42)))


@pytest.mark.parametrize("cls", CLASSES)
def test_attend_dtype_empty_and_partial_pairs(cls):
    rng = np.random.default_rng(1)
    c = make(cls)
    q16 = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.float16)
    assert np.all(np.array(c.attend(q16)) == 0)
    k, v = kv(10, 2, lowrank=True)
    c.append_key(mx.array(k))
    c.append_value(mx.array(v[:6]))
    assert len(c) == 6 and c.attend(q16).dtype == mx.float16
    out = np.array(c.attend(q16), dtype=np.float32)
    assert out.shape == (D,) and np.all(np.isfinite(out))
    assert make(cls, dtype=mx.float32).attend(q16).dtype == mx.float32


@pytest.mark.parametrize("cls", CLASSES)
def test_seed_determinism(cls):
    k, _ = kv(10, 3, lowrank=True)
    a, b, other = (make(cls, seed=s) for s in (5, 5, 6))
    for c in (a, b, other):
        c.append_key(mx.array(k))
    np.testing.assert_array_equal(np.array(a.reconstruct_keys()), np.array(b.reconstruct_keys()))
    assert not np.allclose(np.array(a.reconstruct_keys()), np.array(other.reconstruct_keys()))


@pytest.mark.parametrize("cls", CLASSES)
def test_bad_inputs_raise_cache_input_error(cls):
    c = make(cls)
    bad = [
        mx.zeros((D + 1,)),
        mx.zeros((3, D - 1)),
        mx.zeros((2, 3, D)),
        mx.zeros((D,), dtype=mx.int32),
        mx.array(np.full(D, np.nan, dtype=np.float32)),
        mx.array(np.concatenate([[np.inf], np.zeros(D - 1)]).astype(np.float32)),
        [0.0] * D,
        np.zeros(D, dtype=np.int64),
    ]
    for x in bad:
        for fn in (c.append_key, c.append_value, c.attend):
            with pytest.raises(CacheInputError):
                fn(x)
    with pytest.raises(CacheInputError):
        c.append_key(mx.full((D,), 1e4))  # norm 1.1e5 does not fit a float16 norm
    assert c.n_keys == 0 and c.n_values == 0
    c.append_key(np.zeros((2, D), dtype=np.float32))  # NumPy floats are accepted
    assert c.n_keys == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("head_dim", 1),
        ("head_dim", 64.0),
        ("bit_width_inlier", 0),
        ("bit_width_inlier", 9),
        ("bit_width_inlier", True),
        ("capacity", 0),
        ("seed", "x"),
        ("seed", None),
        ("dtype", mx.int32),
        ("jl_dim", 0),
    ],
)
@pytest.mark.parametrize("cls", CLASSES)
def test_bad_config_raises_quantizer_config_error(cls, field, value):
    if field == "jl_dim" and not STANDALONE[cls.method_name].reads_jl_dim:
        return  # polar and turboquant_mse do not read jl_dim
    with pytest.raises(QuantizerConfigError) as info:
        cls(standalone_config(cls.method_name, **{field: value}))
    assert info.value.field == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("spectral_key_d_eff", 0),
        ("spectral_val_d_eff", 2.5),
        ("spectral_apply_qjl", 1),
        ("spectral_model_name", ""),
        ("spectral_model_name", None),
        ("n_calib_tokens", 0),
    ],
)
def test_spectral_bad_config(field, value):
    with pytest.raises(QuantizerConfigError) as info:
        SpectralQuantKVCache(cfg(**{field: value}))
    assert info.value.field == field


def test_polar_needs_even_head_dim():
    with pytest.raises(QuantizerConfigError) as info:
        PolarQuantKVCache(cfg(head_dim=7))
    assert info.value.field == "head_dim"
