"""Recursive polar transform and angle codebooks (PolarQuant, arXiv 2502.02617).

A vector ``x`` in R^d (``2**L`` dividing ``d``) becomes, level by level, radii and angles: level 1 pairs
``(x[2j], x[2j+1])`` into radii ``||pair||`` and angles ``atan2`` in ``[0, 2*pi)``; level ``l >= 2`` pairs
the previous radii the same way (angles in ``[0, pi/2]``, radii being >= 0). After ``L`` levels: ``d / 2**L``
radii (norms of blocks of ``2**L`` coordinates) and ``d/2 + ... + d/2**L`` angles; the inverse splits each
radius into ``(r cos psi, r sin psi)``.

For a rotation-invariant ``x`` the angles are independent (PolarQuant, Lemma 2): uniform at level 1,
density ``c_l * sin(2 psi)^(2^(l-1) - 1)`` on ``[0, pi/2]`` at level ``l >= 2`` (symmetric about ``pi/4``).
``angle_codebook(level, bits)`` is the MSE-optimal quantizer for that density: the uniform circular one
at level 1 (codes ``floor(psi / width) mod 2**bits``), Lloyd–Max on a grid of the exact density above
(searched with :func:`~.codebook.nearest_code`). Python loops run only over the levels.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from . import check_int
from .codebook import _frozen, density_grid, lloyd, nearest_code

__all__ = ["polar_levels", "polar_transform", "inverse_polar_transform", "angle_density", "angle_codebook",
           "angle_distortion", "quantize_angles"]

TWO_PI = 2.0 * math.pi
_GRID = 1 << 16


def polar_levels(d: int, max_levels: int = 4) -> int:
    """The largest ``L <= max_levels`` with ``2**L`` dividing ``d`` (0 for odd ``d``)."""
    d = check_int("d", d, 1)
    levels = 0
    while levels < max_levels and d % (1 << (levels + 1)) == 0:
        levels += 1
    return levels


def polar_transform(x: mx.array, levels: int) -> tuple[mx.array, list]:
    """``x (..., d)`` -> ``(radii (..., d / 2**levels), [psi_1 (..., d/2), ..., psi_L])``, float32."""
    levels = check_int("levels", levels, 1)
    d = x.shape[-1]
    if d % (1 << levels):
        raise ValueError(f"last dimension {d} is not divisible by 2**levels = {1 << levels}")
    lead = x.shape[:-1]
    r = x.astype(mx.float32)
    angles = []
    for level in range(1, levels + 1):
        pairs = r.reshape(*lead, -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        psi = mx.arctan2(b, a)
        if level == 1:
            psi = mx.where(psi < 0, psi + TWO_PI, psi)
            psi = mx.where(psi >= TWO_PI, psi - TWO_PI, psi)  # -0 / rounding at the seam
        angles.append(psi)
        r = mx.sqrt(a * a + b * b)
    return r, angles


def inverse_polar_transform(radii: mx.array, angles: list) -> mx.array:
    """Inverse of :func:`polar_transform` (angles ordered level 1 first)."""
    r = radii.astype(mx.float32)
    lead = r.shape[:-1]
    for psi in reversed(angles):
        psi = psi.astype(mx.float32)
        r = mx.stack([r * mx.cos(psi), r * mx.sin(psi)], axis=-1).reshape(*lead, -1)
    return r


def _exponent(level: int) -> int:
    return (1 << (level - 1)) - 1


def angle_density(level: int, psi) -> np.ndarray:
    """Density of a level-``level`` angle of a rotation-invariant vector (NumPy, float64)."""
    level = check_int("level", level, 1)
    psi = np.asarray(psi, dtype=np.float64)
    if level == 1:
        return np.where((psi >= 0) & (psi < TWO_PI), 1.0 / TWO_PI, 0.0)
    n = _exponent(level)
    # c_l = Gamma(2^(l-1)) / (2^(2^(l-1) - 2) Gamma(2^(l-2))^2), computed in log space.
    m = 1 << (level - 1)
    logc = math.lgamma(m) - (m - 2) * math.log(2.0) - 2.0 * math.lgamma(m / 2)
    inside = (psi >= 0) & (psi <= math.pi / 2)
    s = np.clip(np.sin(2.0 * np.where(inside, psi, 0.0)), 0.0, None)
    with np.errstate(divide="ignore"):
        return np.where(inside, np.exp(logc + n * np.log(s)), 0.0)


@functools.lru_cache(maxsize=128)
def _codebook_np(level: int, bits: int):
    k, n = 1 << bits, _exponent(level)
    if level == 1:
        width = TWO_PI / k
        return _frozen((np.arange(k) + 0.5) * width, width * width / 12.0)
    grid = density_grid(0.0, math.pi / 2, lambda x: n * np.log(np.sin(2.0 * x)), _GRID)
    return _frozen(*lloyd(*grid, k, center=math.pi / 4, max_iter=1000))


def angle_codebook(level: int, bits: int) -> mx.array:
    """``2**bits`` sorted float32 centroids of the MSE-optimal quantizer for level-``level`` angles."""
    return mx.array(_codebook_np(check_int("level", level, 1), check_int("bits", bits, 1, 8))[0])


def angle_distortion(level: int, bits: int) -> float:
    """Expected squared angle error ``E[(psi - Q(psi))^2]`` of :func:`angle_codebook` on its density
    (for level 1, measured along the circle)."""
    return _codebook_np(check_int("level", level, 1), check_int("bits", bits, 1, 8))[1]


def quantize_angles(psi: mx.array, level: int, bits: int, centroids: mx.array | None = None) -> mx.array:
    """``uint8`` codes of the nearest centroids of ``angle_codebook(level, bits)`` (or ``centroids``); level 1
    on the circle (``2*pi`` wraps to code 0's cell)."""
    level, bits = check_int("level", level, 1), check_int("bits", bits, 1, 8)
    k = 1 << bits
    if level == 1:
        width = TWO_PI / k
        codes = mx.floor(psi.astype(mx.float32) / width).astype(mx.int32)
        return mx.remainder(codes, k).astype(mx.uint8)
    if centroids is None:
        centroids = angle_codebook(level, bits)
    return nearest_code(psi, centroids)
