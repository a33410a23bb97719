"""Tests for the quantization primitives: bit packing, rotations, codebooks, k-means, QJL sketches."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.cache.primitives.bitpack import pack_bits, packed_nbytes, packed_words, unpack_bits
from veloxquant_mlx.cache.primitives.codebook import (
    code_boundaries,
    kmeans,
    lloyd_max_codebook,
    lloyd_max_distortion,
    lloyd_max_gaussian,
    nearest_code,
)
from veloxquant_mlx.cache.primitives.rotation import hadamard, random_orthogonal, randomized_hadamard
from veloxquant_mlx.cache.primitives.sketch import (
    QJL_SCALE,
    gaussian_jl,
    qjl_dequantize,
    qjl_inner_product,
    qjl_signs,
)

# ----------------------------------------------------------------------------------------- bitpack


def _reference_pack(row, bits):
    """Slow, obviously-correct packer for one row (the documented layout)."""
    n_words = (len(row) * bits + 31) // 32
    words = [0] * n_words
    for j, c in enumerate(row):
        for t in range(bits):
            p = j * bits + t
            words[p // 32] |= ((int(c) >> t) & 1) << (p % 32)
    return words


@settings(max_examples=150, deadline=None)
@given(
    bits=st.integers(1, 8),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(0, 200),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip_property(bits, lead, n, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, size=(*lead, n)).astype(np.uint8)
    packed = pack_bits(mx.array(codes), bits)
    assert packed.dtype == mx.uint32
    assert packed.shape == (*lead, packed_words(n, bits))
    out = unpack_bits(packed, bits, n)
    assert out.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(out), codes)


@pytest.mark.parametrize("n", [77, 80])
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_matches_documented_layout(bits, n):
    """77 * bits is not a multiple of 32 for any bits (padding, straddling; unpacked with a gather per code); 80 is
    a multiple of 8 (unpacked by ``bits``-byte periods of 8 codes); trailing words beyond the codes are ignored."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(3, n))
    packed = np.array(pack_bits(mx.array(codes.astype(np.uint8)), bits))
    for r in range(3):
        assert packed[r].tolist() == _reference_pack(codes[r], bits)
    np.testing.assert_array_equal(np.array(unpack_bits(mx.array(packed), bits, n)), codes)
    buffer = mx.array(np.concatenate([packed, np.full((3, 2), 0xFFFFFFFF, dtype=np.uint32)], axis=1))  # capacity
    np.testing.assert_array_equal(np.array(unpack_bits(buffer, bits, n)), codes)
    view = buffer[:, : packed.shape[1]]  # a strided view of the buffer's used words
    np.testing.assert_array_equal(np.array(unpack_bits(view, bits, n)), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_all_ones_and_extremes(bits):
    codes = np.full((2, 129), (1 << bits) - 1, dtype=np.uint8)
    codes[1, ::2] = 0
    out = unpack_bits(pack_bits(mx.array(codes), bits), bits, 129)
    np.testing.assert_array_equal(np.array(out), codes)


def test_packed_sizes():
    assert packed_nbytes(128, 2) == 32
    assert packed_nbytes(128, 3) == 48
    assert packed_nbytes(10, 3) == 4  # 30 bits -> one word
    assert packed_nbytes(11, 3) == 8  # 33 bits -> two words
    assert packed_nbytes(0, 5) == 0
    for bits in range(1, 9):
        for n in (1, 31, 32, 33, 128, 1000):
            assert packed_nbytes(n, bits) == 4 * math.ceil(n * bits / 32)
            assert pack_bits(mx.zeros((n,), dtype=mx.uint8), bits).nbytes == packed_nbytes(n, bits)


def test_bitpack_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pack_bits(mx.zeros((4,), dtype=mx.uint8), 0)
    with pytest.raises(ValueError):
        pack_bits(mx.zeros((4,), dtype=mx.uint8), 9)
    with pytest.raises(ValueError):
        unpack_bits(mx.zeros((1,), dtype=mx.int32), 2, 4)
    with pytest.raises(ValueError):
        unpack_bits(mx.zeros((1,), dtype=mx.uint32), 3, 11)  # 33 bits need two words


# ---------------------------------------------------------------------------------------- rotation


@pytest.mark.parametrize("d", [2, 3, 17, 64, 128])
def test_random_orthogonal_is_orthogonal_and_deterministic(d):
    q = random_orthogonal(d, 7)
    assert q.shape == (d, d) and q.dtype == mx.float32
    a = np.array(q, dtype=np.float64)
    np.testing.assert_allclose(a @ a.T, np.eye(d), atol=2e-6)
    np.testing.assert_allclose(a.T @ a, np.eye(d), atol=2e-6)
    np.testing.assert_array_equal(np.array(random_orthogonal(d, 7)), a.astype(np.float32))
    assert not np.allclose(np.array(random_orthogonal(d, 8)), a)


def test_random_orthogonal_is_not_structured():
    # Haar rotation of e_1: the first column is uniform on the sphere; over seeds, its first entry
    # has mean 0 and variance 1/d.
    d = 16
    firsts = np.array([np.array(random_orthogonal(d, s))[0, 0] for s in range(400)])
    assert abs(firsts.mean()) < 4 * math.sqrt(1 / d / 400)
    assert 0.7 / d < firsts.var() < 1.3 / d


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_randomized_hadamard_is_orthogonal(d):
    m = np.array(randomized_hadamard(d, 3), dtype=np.float64)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-6)
    np.testing.assert_allclose(np.abs(m), 1 / math.sqrt(d), rtol=1e-6)
    h = np.array(hadamard(d), dtype=np.float64)
    signs = np.round((m / h)[0])  # H D: each column of H scaled by a sign
    np.testing.assert_allclose(m, h * signs[None, :], atol=1e-7)
    np.testing.assert_array_equal(np.array(randomized_hadamard(d, 3)), m.astype(np.float32))


def test_randomized_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        randomized_hadamard(12, 0)
    with pytest.raises(ValueError):
        random_orthogonal(0, 0)


# ---------------------------------------------------------------------------------------- codebook


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebook_shape_sorted_symmetric(bits):
    c = np.array(lloyd_max_codebook(bits, 128))
    assert c.shape == (1 << bits,) and c.dtype == np.float32
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-6)
    assert np.all(np.abs(c) < 1)


def test_gaussian_codebook_matches_known_lloyd_max_values():
    # Classical Lloyd–Max quantizers for N(0, 1) (Max 1960).
    np.testing.assert_allclose(np.array(lloyd_max_gaussian(1)), [-0.7979, 0.7979], atol=2e-4)
    np.testing.assert_allclose(np.array(lloyd_max_gaussian(2)), [-1.5104, -0.4528, 0.4528, 1.5104], atol=2e-4)
    np.testing.assert_allclose(
        np.array(lloyd_max_gaussian(3))[4:], [0.2451, 0.7560, 1.3440, 2.1520], atol=2e-4
    )
    for bits, mse in [(1, 0.3634), (2, 0.1175), (3, 0.03455), (4, 0.009497)]:
        assert lloyd_max_distortion(bits) == pytest.approx(mse, rel=3e-3)


def test_sphere_codebook_small_d_closed_forms():
    # d = 3: a coordinate of a uniform unit vector is uniform on [-1, 1].
    np.testing.assert_allclose(np.array(lloyd_max_codebook(1, 3)), [-0.5, 0.5], atol=1e-4)
    np.testing.assert_allclose(np.array(lloyd_max_codebook(2, 3)), [-0.75, -0.25, 0.25, 0.75], atol=1e-4)
    # Large d: approaches the Gaussian codebook scaled by 1/sqrt(d).
    d = 4096
    np.testing.assert_allclose(
        np.array(lloyd_max_codebook(3, d)) * math.sqrt(d), np.array(lloyd_max_gaussian(3)), rtol=2e-3
    )


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_sphere_codebook_satisfies_lloyd_conditions_by_monte_carlo(bits):
    d = 32
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((20000, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    coords = x.reshape(-1).astype(np.float32)
    c = lloyd_max_codebook(bits, d)
    codes = np.array(nearest_code(mx.array(coords), c))
    cn = np.array(c)
    means = np.array([coords[codes == i].mean() for i in range(len(cn))])
    np.testing.assert_allclose(means, cn, atol=0.01 / math.sqrt(d) * 2**bits)
    mse = d * np.mean((coords - cn[codes]) ** 2)
    assert mse == pytest.approx(lloyd_max_distortion(bits, d), rel=0.03)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 16, 100, 256])
def test_nearest_code_matches_brute_force(k):
    rng = np.random.default_rng(k)
    cents = np.sort(rng.standard_normal(k)).astype(np.float32)
    x = (rng.standard_normal((37, 29)) * 1.5).astype(np.float32)
    got = np.array(nearest_code(mx.array(x), mx.array(cents)))
    assert got.dtype == np.uint8 and got.shape == x.shape
    best = np.abs(x[..., None] - cents).min(-1)
    np.testing.assert_allclose(np.abs(x - cents[got]), best, atol=1e-6)


def test_code_boundaries_are_midpoints():
    c = lloyd_max_codebook(2, 64)
    b = np.array(code_boundaries(c))
    cn = np.array(c)
    np.testing.assert_allclose(b, (cn[1:] + cn[:-1]) / 2)


def test_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((4, 8)) * 10
    labels_true = rng.integers(0, 4, size=400)
    x = centers[labels_true] + 0.1 * rng.standard_normal((400, 8))
    cent, labels = kmeans(mx.array(x.astype(np.float32)), 4, iters=20, seed=3)
    cent, labels = np.array(cent), np.array(labels)
    assert cent.shape == (4, 8) and labels.shape == (400,)
    # every found centroid sits on a true centre (up to permutation), and labels agree with it
    match = np.argmin(((cent[:, None] - centers[None]) ** 2).sum(-1), axis=1)
    assert sorted(match.tolist()) == [0, 1, 2, 3]
    np.testing.assert_allclose(cent, centers[match], atol=0.1)
    assert np.all(match[labels] == labels_true)
    c2, l2 = kmeans(mx.array(x.astype(np.float32)), 4, iters=20, seed=3)
    np.testing.assert_array_equal(np.array(c2), cent)


def test_kmeans_rejects_bad_k():
    with pytest.raises(ValueError):
        kmeans(mx.zeros((3, 2)), 4)


# ------------------------------------------------------------------------------------------ sketch


def test_gaussian_jl_statistics_and_determinism():
    s = np.array(gaussian_jl(256, 128, 5))
    assert s.shape == (256, 128) and s.dtype == np.float32
    assert abs(s.mean()) < 0.02 and abs(s.var() - 1) < 0.02
    np.testing.assert_array_equal(np.array(gaussian_jl(256, 128, 5)), s)
    assert not np.allclose(np.array(gaussian_jl(256, 128, 6)), s)
    # independent of a rotation drawn from the same seed
    q = np.array(random_orthogonal(128, 5))
    assert not np.allclose(np.abs(s[:128] / np.linalg.norm(s[:128], axis=1, keepdims=True)), np.abs(q))


def test_qjl_signs_are_signs_of_projection():
    rng = np.random.default_rng(0)
    s = gaussian_jl(64, 16, 0)
    k = rng.standard_normal((10, 16)).astype(np.float32)
    bits = np.array(qjl_signs(s, mx.array(k)))
    assert bits.dtype == np.uint8 and bits.shape == (10, 64)
    np.testing.assert_array_equal(bits, (k @ np.array(s).T >= 0).astype(np.uint8))


def test_qjl_estimator_is_unbiased_and_matches_dequantize():
    d, m, seeds = 32, 64, 300
    rng = np.random.default_rng(1)
    k = rng.standard_normal((8, d)).astype(np.float32)
    q = (k + 0.5 * rng.standard_normal((8, d))).astype(np.float32)  # correlated with k
    true = np.sum(q * k, axis=1)
    norms = mx.array(np.linalg.norm(k, axis=1).astype(np.float32))
    errs = []
    for seed in range(seeds):
        s = gaussian_jl(m, d, seed)
        signs = qjl_signs(s, mx.array(k))
        est = np.diagonal(np.array(qjl_inner_product(mx.array(q), signs, norms, s)))
        deq = np.array(qjl_dequantize(signs, norms, s))
        np.testing.assert_allclose(np.sum(deq * q, axis=1), est, rtol=1e-4, atol=1e-4)
        errs.append((est - true) / np.linalg.norm(k, axis=1) / np.linalg.norm(q, axis=1))
    e = np.array(errs)
    per_seed = e.mean(axis=1)
    se = per_seed.std(ddof=1) / math.sqrt(seeds)
    assert abs(per_seed.mean()) < 4 * se
    # variance bound of the QJL paper: Var <= pi / (2m) ||q||^2 ||k||^2
    assert e.var() < math.pi / (2 * m)
    # a single-query call returns (n,)
    one = qjl_inner_product(mx.array(q[0]), signs, norms, s)
    assert one.shape == (8,)
    assert QJL_SCALE == pytest.approx(math.sqrt(math.pi / 2))


# ----------------------------------------------------------------------------------------- entropy coder


def test_entropy_saved_format_is_versioned():
    """Format 2 (constriction ANS, or raw when coding would not pay) round-trips and says which it is; a
    format-1 stream (the numpy rANS coder before issue #15; these bytes are its output) is refused by name."""
    from veloxquant_mlx.cache.primitives import entropy

    rng = np.random.default_rng(0)
    skewed = np.minimum(rng.geometric(0.6, (6, 256)) - 1, 3).astype(np.uint8)  # mostly 0 and 1 of 4 codes
    buf = entropy.encode(skewed, 2, np.arange(6) // 3, 2)
    assert buf[0] == entropy.FORMAT_ANS and len(buf) < 6 * entropy.raw_nbytes(256, 2)
    assert np.array_equal(entropy.decode(buf, 6, 256, 2, np.arange(6) // 3, 2), skewed)
    uniform = rng.integers(0, 4, (6, 256)).astype(np.uint8)
    buf = entropy.encode(uniform, 2, np.arange(6), 6)
    assert buf[0] == entropy.FORMAT_RAW and len(buf) == 1 + 6 * entropy.raw_nbytes(256, 2)
    assert np.array_equal(entropy.decode(buf, 6, 256, 2, np.arange(6), 6), uniform)
    v1 = np.frombuffer(bytes.fromhex("020054955495549554951555155515551555"), np.uint8)
    with pytest.raises(ValueError, match="format 1"):
        entropy.decode(v1, 2, 32, 2, np.zeros(2, int), 1)


@pytest.mark.parametrize("shape", [(96, 64), (1, 96, 64), (1, 1, 96, 64), (2, 3, 96, 64)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_group_quantize_reads_a_transposed_view_as_its_values(shape, bits):
    """``groupquant.quantize`` of a transposed view (KIVI's per-channel keys, the low-rank latents) equals that of
    the same values laid out contiguously, and its error is within one step of each group's range (MLX's levels are
    shifted to hold zero exactly: up to ~0.9 step).
    MLX 0.32.4's CUDA ``mx.quantize`` read a transposed lone matrix (every leading dim 1: one KV head, batch 1)
    as if it were row-major (relative error ~2 instead of ~0.007 at 4 bits, seen on an H200)."""
    from veloxquant_mlx.cache.primitives import groupquant as gq

    x = mx.random.normal(shape, key=mx.random.key(bits)).swapaxes(-1, -2)
    got = gq.dequantize(*gq.quantize(x, bits, 32), bits, 32)
    want = gq.dequantize(*gq.quantize(mx.contiguous(x), bits, 32), bits, 32)
    assert mx.array_equal(got, want)
    xf = np.array(x.astype(mx.float16).astype(mx.float32)).reshape(*x.shape[:-1], -1, 32)
    step = (xf.max(-1) - xf.min(-1)) / (2**bits - 1)
    err = np.abs(np.array(got).reshape(xf.shape) - xf).max(-1)
    assert (err <= step + np.abs(xf).max(-1) * 2e-3).all()  # + the float16 scale/bias rounding


@pytest.mark.parametrize("bits,group,value_group,d,dv", [(4, 32, 32, 64, 64), (2, 64, 32, 96, 96),
                                                        (8, 128, 64, 128, 128), (4, 32, 32, 80, 32)])
def test_quantized_matmul_check_passes_where_mlx_computes_right(bits, group, value_group, d, dv):
    from veloxquant_mlx.cache.primitives import groupquant as gq

    gq.qmm_agrees.cache_clear()
    assert gq.qmm_agrees(bits, group, value_group, d, dv)


def test_quantized_matmul_check_catches_mlx_4250_and_warns_once(monkeypatch):
    """KIVI's decode on Metal reads its codes with ``quantized_matmul(transpose=False)``; MLX's Metal kernel left the
    output columns past the last multiple of 64 unwritten once the contraction had >= 1024 rows (mlx#4250: a head
    dim of 96 lost its last 32 value channels). Simulated here: the check sees it, warns once, and is remembered."""
    from veloxquant_mlx.cache.primitives import groupquant as gq

    real = mx.quantized_matmul

    def unwritten_tail(x, w, *a, **k):
        out = real(x, w, *a, **k)
        if x.shape[-1] < 1024 or out.shape[-1] % 64 == 0:
            return out
        keep = mx.arange(out.shape[-1]) < out.shape[-1] // 64 * 64
        return mx.where(keep, out, 0.0)

    monkeypatch.setattr(mx, "quantized_matmul", unwritten_tail)
    gq.qmm_agrees.cache_clear()
    try:
        assert gq.qmm_agrees(4, 32, 32, 64, 64)  # 64 value channels: every column written
        with pytest.warns(RuntimeWarning, match="disagrees with dequantize.*mlx#4250"):
            assert not gq.qmm_agrees(4, 32, 32, 96, 96)
        assert not gq.qmm_agrees(4, 32, 32, 96, 96)  # remembered: no second check, no second warning
    finally:
        gq.qmm_agrees.cache_clear()


@pytest.mark.parametrize("bits", [1, 3, 5, 7])
@pytest.mark.parametrize("lead", [(), (2,), (0, 3)])
def test_unpack_of_no_codes_is_an_empty_array(bits, lead):
    """Zero codes (an empty cache's rows) unpack to an empty ``(..., 0)`` array: ``extract_codes`` is an
    ``elementwise`` function, which runs an empty call uncompiled (MLX 0.32.4's CUDA backend dies with SIGFPE
    launching a compiled kernel over no elements, seen on an H200)."""
    from veloxquant_mlx.cache.primitives.fused import elementwise

    out = unpack_bits(pack_bits(mx.zeros((*lead, 0), mx.uint8), bits), bits, 0)
    assert out.shape == (*lead, 0) and out.dtype == mx.uint8
    calls = []
    twice = elementwise(lambda x: calls.append(x.shape) or x * 2)
    assert twice(mx.zeros((0, 4))).shape == (0, 4) and calls == [(0, 4)]  # run as plain ops
    assert mx.array_equal(twice(mx.ones((3,))), mx.full((3,), 2.0)) and len(calls) == 2  # traced once
    assert mx.array_equal(twice(mx.ones((5,))), mx.full((5,), 2.0)) and len(calls) == 2  # any length
