"""Recursive polar transform and angle codebooks (PolarQuant, arXiv 2502.02617). A vector in R^d (``2**L`` dividing
``d``) becomes, level by level, radii and angles: level 1 pairs ``(x[2j], x[2j+1])`` into radii and ``atan2`` angles
in ``[0, 2*pi)``, level ``l >= 2`` pairs the previous radii the same way (angles in ``[0, pi/2]``). For a
rotation-invariant vector the angles are independent (Lemma 2): uniform at level 1, density ``c_l sin(2
psi)^(2^(l-1) - 1)`` on ``[0, pi/2]`` at level ``l``; ``angle_codebook`` is the MSE-optimal quantizer for it.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from . import check_int
from .codebook import density_grid, lloyd, nearest_code
from .rotation import frozen

TWO_PI = 2.0 * math.pi


def polar_levels(d: int, max_levels: int = 4) -> int:
    """The largest ``L <= max_levels`` with ``2**L`` dividing ``d`` (0 for odd ``d``)."""
    d = check_int("d", d, 1)
    return min(max_levels, (d & -d).bit_length() - 1)


def polar_transform(x: mx.array, levels: int) -> tuple[mx.array, list]:
    """``x (..., d)`` -> ``(radii (..., d / 2**levels), [psi_1 (..., d/2), ..., psi_L])``, float32."""
    levels = check_int("levels", levels, 1)
    if x.shape[-1] % (1 << levels):
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by 2**levels = {1 << levels}")
    r, angles = x.astype(mx.float32), []
    for level in range(1, levels + 1):
        pairs = r.reshape(*x.shape[:-1], -1, 2)
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
    for psi in reversed(angles):
        psi = psi.astype(mx.float32)
        r = mx.stack([r * mx.cos(psi), r * mx.sin(psi)], axis=-1).reshape(*radii.shape[:-1], -1)
    return r


def angle_density(level: int, psi) -> np.ndarray:
    """Density of a level-``level`` angle of a rotation-invariant vector (NumPy, float64)."""
    level = check_int("level", level, 1)
    psi = np.asarray(psi, dtype=np.float64)
    if level == 1:
        return np.where((psi >= 0) & (psi < TWO_PI), 1.0 / TWO_PI, 0.0)
    m = 1 << (level - 1)  # c_l = Gamma(m) / (2^(m - 2) Gamma(m/2)^2), in log space
    logc = math.lgamma(m) - (m - 2) * math.log(2.0) - 2.0 * math.lgamma(m / 2)
    inside = (psi >= 0) & (psi <= math.pi / 2)
    s = np.clip(np.sin(2.0 * np.where(inside, psi, 0.0)), 0.0, None)
    with np.errstate(divide="ignore"):
        return np.where(inside, np.exp(logc + (m - 1) * np.log(s)), 0.0)


@functools.lru_cache(maxsize=128)
def _codebook_np(level: int, bits: int):
    k = 1 << bits
    if level == 1:
        width = TWO_PI / k
        return frozen((np.arange(k) + 0.5) * width), width * width / 12.0
    n = (1 << (level - 1)) - 1
    return lloyd(*density_grid(0.0, math.pi / 2, lambda x: n * np.log(np.sin(2.0 * x)), 1 << 16), k,
                 center=math.pi / 4, max_iter=1000)


def angle_codebook(level: int, bits: int) -> mx.array:
    """``2**bits`` sorted float32 centroids of the MSE-optimal quantizer for level-``level`` angles."""
    return mx.array(_codebook_np(check_int("level", level, 1), check_int("bits", bits, 1, 8))[0])


def angle_distortion(level: int, bits: int) -> float:
    """``E[(psi - Q(psi))^2]`` of :func:`angle_codebook` on its density (level 1: along the circle)."""
    return _codebook_np(check_int("level", level, 1), check_int("bits", bits, 1, 8))[1]


def quantize_angles(psi: mx.array, level: int, bits: int, centroids: mx.array | None = None) -> mx.array:
    """``uint8`` codes of the nearest centroids of ``angle_codebook(level, bits)`` (or ``centroids``); level 1
    on the circle (``2*pi`` wraps to code 0's cell)."""
    level, bits = check_int("level", level, 1), check_int("bits", bits, 1, 8)
    if level == 1:
        codes = mx.floor(psi.astype(mx.float32) / (TWO_PI / (1 << bits))).astype(mx.int32)
        return mx.remainder(codes, 1 << bits).astype(mx.uint8)
    return nearest_code(psi, angle_codebook(level, bits) if centroids is None else centroids)
