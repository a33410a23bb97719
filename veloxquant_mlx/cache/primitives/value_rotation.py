"""Waterfill's value rotation (a normalized Hadamard as a fast transform for a power-of-two dimension, else a
seeded Haar-random orthogonal matrix) and the odd-polynomial codebook of its rotated coordinates."""

from __future__ import annotations

import functools

import mlx.core as mx

from .codebook import odd_poly_gaussian
from .fused import elementwise
from .rotation import hadamard, random_orthogonal


def power_of_two(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def rotate_values(y: mx.array, seed: int, inverse: bool = False) -> mx.array:
    """``y M`` (or ``y M^T``) over the last axis: ``mx.hadamard_transform`` for a power-of-two dim (``H`` is
    its own inverse; no stored matrix), else the seeded random rotation's matrix."""
    dv = y.shape[-1]
    if power_of_two(dv):
        return mx.hadamard_transform(y, scale=dv**-0.5)
    m = value_rotation(dv, seed)
    return y @ (m.T if inverse else m)


@functools.lru_cache(maxsize=None)
def value_rotation(dim: int, seed: int) -> mx.array:
    """The values' rotation as a matrix ``[Dv, Dv]`` (``v @ M``), one array per process per key."""
    m = mx.contiguous(hadamard(dim) if power_of_two(dim) else random_orthogonal(dim, seed))
    mx.eval(m)
    return m


@functools.lru_cache(maxsize=8)
def poly_coefficients(bits: int) -> tuple[float, float, float]:
    """``(a, b, c)`` of the values' odd-polynomial codebook (computed once per width: decode steps use it)."""
    return tuple(odd_poly_gaussian(bits)[1])


@elementwise  # elementwise only: one fused kernel for any row count
def odd_poly(codes, top, a, b, c):
    """Decoded values ``u (a + u^2 (b + c u^2))`` of codes centred at ``top / 2``."""
    u = codes.astype(mx.float32) - top / 2
    u2 = u * u
    return u * (a + u2 * (b + c * u2))


@elementwise
def nibble_centroids(b, pa, pb, pc):
    """Codebook values (:func:`odd_poly`) of the low and high 4-bit codes of bytes ``b``: channels 2j and 2j + 1."""
    return odd_poly(b & 15, 15, pa, pb, pc), odd_poly(b >> 4, 15, pa, pb, pc)
