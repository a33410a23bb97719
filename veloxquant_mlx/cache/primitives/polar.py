"""Recursive polar transform and angle codebooks (PolarQuant, arXiv 2502.02617).

Polar transform
---------------
A vector ``x`` in R^d (``d`` divisible by ``2**L``) is rewritten, level by level, as radii and angles:

* level 1: the ``d/2`` coordinate pairs ``(x[2j], x[2j+1])`` become radii ``r1[j] = ||pair||`` and
  angles ``psi1[j] = atan2(x[2j+1], x[2j])`` taken in ``[0, 2*pi)``;
* level ``l >= 2``: the radii of level ``l-1`` are paired the same way, ``r_l[j] = ||(r[2j], r[2j+1])||``
  and ``psi_l[j] = atan2(r[2j+1], r[2j])``, which lies in ``[0, pi/2]`` because radii are >= 0.

After ``L`` levels, ``x`` is ``d / 2**L`` radii (the norms of its consecutive blocks of ``2**L``
coordinates) and ``d/2 + d/4 + ... + d/2**L`` angles. The inverse walks back down:
``(r cos psi, r sin psi)`` splits every radius into its two children.

Angle distributions
-------------------
If ``x`` has a rotation-invariant distribution (a Gaussian vector, or a fixed vector after a random
rotation), every angle is independent of the radii and of the other angles, and (PolarQuant, Lemma 2)

* level 1: uniform on ``[0, 2*pi)``;
* level ``l >= 2``: density ``f_l(psi) = c_l * sin(2 psi)^(2^(l-1) - 1)`` on ``[0, pi/2]``, symmetric
  about ``pi/4`` and increasingly concentrated there as ``l`` grows.

Codebooks
---------
``angle_codebook(level, bits)`` is the MSE-optimal ``2**bits``-level scalar quantizer for that density:
for level 1 the uniform circular quantizer (cell width ``2*pi / 2**bits``, centroids at the cell
midpoints; any rotation of it is equally optimal), for ``l >= 2`` Lloyd–Max computed numerically
(NumPy, a fine grid of the exact density, ``lru_cache``d per ``(level, bits)``). Level-1 codes are
``floor(psi / width) mod 2**bits`` (nearest centroid on the circle); higher levels use the
branch-free binary search of :func:`~veloxquant_mlx.cache.primitives.codebook.nearest_code`.

Everything on arrays is vectorized MLX; Python loops run only over the (at most ``log2 d``) levels.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from .codebook import nearest_code

__all__ = [
    "polar_levels",
    "polar_transform",
    "inverse_polar_transform",
    "angle_density",
    "angle_codebook",
    "angle_distortion",
    "quantize_angles",
    "dequantize_angles",
]

TWO_PI = 2.0 * math.pi
_GRID = 1 << 16


def _check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or level < 1:
        raise ValueError(f"level={level!r} is invalid: expected an int >= 1")
    return int(level)


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is invalid: expected an int in 1..8")
    return int(bits)


def polar_levels(d: int, max_levels: int = 4) -> int:
    """Number of recursion levels for dimension ``d``: the largest ``L <= max_levels`` with
    ``2**L`` dividing ``d`` (0 for odd ``d``)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d={d!r} is invalid: expected an int >= 1")
    levels = 0
    while levels < max_levels and d % (1 << (levels + 1)) == 0:
        levels += 1
    return levels


def polar_transform(x: mx.array, levels: int) -> tuple[mx.array, list]:
    """``x`` ``(..., d)`` -> ``(radii (..., d / 2**levels), [psi_1 (..., d/2), ..., psi_L])``.

    Level-1 angles are in ``[0, 2*pi)``, higher levels in ``[0, pi/2]``; float32 throughout.
    """
    levels = _check_level(levels)
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


# ------------------------------------------------------------------------------------- densities


def _exponent(level: int) -> int:
    return (1 << (level - 1)) - 1


def angle_density(level: int, psi) -> np.ndarray:
    """Density of a level-``level`` angle of a rotation-invariant vector (NumPy, float64)."""
    level = _check_level(level)
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


def _lloyd_sin_power(n: int, k: int, max_iter: int = 1000, tol: float = 1e-9):
    """Lloyd–Max centroids and MSE for the density ``∝ sin(2 psi)^n`` on ``[0, pi/2]``."""
    edges = np.linspace(0.0, math.pi / 2, _GRID + 1)
    x = 0.5 * (edges[:-1] + edges[1:])
    with np.errstate(divide="ignore"):
        logw = n * np.log(np.sin(2.0 * x))
    w = np.exp(logw - logw.max())
    w /= w.sum()
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwx = np.concatenate([[0.0], np.cumsum(w * x)])
    cwxx = np.concatenate([[0.0], np.cumsum(w * x * x)])

    def cells(c):
        b = np.concatenate([[0.0], 0.5 * (c[:-1] + c[1:]), [math.pi / 2]])
        return tuple(np.diff(np.interp(b, edges, cum)) for cum in (cw, cwx, cwxx))

    # Start at the high-resolution optimum (point density ∝ f^(1/3)), then polish with Lloyd (the
    # iteration cap only matters for 64+ levels, where it changes the distortion by < 1e-4 relative).
    c3 = np.concatenate([[0.0], np.cumsum(np.cbrt(w))])
    c3 /= c3[-1]
    c = np.interp((np.arange(k) + 0.5) / k, c3, edges)
    for _ in range(max_iter):
        m0, m1, _ = cells(c)
        new = np.where(m0 > 0, m1 / np.maximum(m0, 1e-300), c)
        new = 0.5 * (new + (math.pi / 2 - new[::-1]))  # the density is symmetric about pi/4
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    m0, m1, m2 = cells(c)
    return c, float(np.sum(m2 - 2 * c * m1 + c * c * m0))


@functools.lru_cache(maxsize=128)
def _codebook_np(level: int, bits: int):
    k = 1 << bits
    if level == 1:
        width = TWO_PI / k
        c = (np.arange(k) + 0.5) * width
        mse = width * width / 12.0
    else:
        c, mse = _lloyd_sin_power(_exponent(level), k)
    c = np.asarray(c, dtype=np.float32)
    c.setflags(write=False)
    return c, mse


def angle_codebook(level: int, bits: int) -> mx.array:
    """``2**bits`` sorted float32 centroids of the MSE-optimal quantizer for level-``level`` angles."""
    return mx.array(_codebook_np(_check_level(level), _check_bits(bits))[0])


def angle_distortion(level: int, bits: int) -> float:
    """Expected squared angle error ``E[(psi - Q(psi))^2]`` of :func:`angle_codebook` on its density
    (for level 1, measured along the circle)."""
    return _codebook_np(_check_level(level), _check_bits(bits))[1]


def quantize_angles(psi: mx.array, level: int, bits: int, centroids: mx.array | None = None) -> mx.array:
    """``uint8`` codes of the nearest centroids of ``angle_codebook(level, bits)`` (or ``centroids``).

    Level 1 is quantized on the circle (``2*pi`` wraps to code 0's cell).
    """
    level, bits = _check_level(level), _check_bits(bits)
    k = 1 << bits
    if level == 1:
        width = TWO_PI / k
        codes = mx.floor(psi.astype(mx.float32) / width).astype(mx.int32)
        return mx.remainder(codes, k).astype(mx.uint8)
    if centroids is None:
        centroids = angle_codebook(level, bits)
    return nearest_code(psi, centroids)


def dequantize_angles(codes: mx.array, centroids: mx.array) -> mx.array:
    """Centroid values (float32) of ``codes``."""
    return mx.take(centroids, codes.astype(mx.int32))
