"""Seeded random rotations (d x d orthogonal matrices) as float32 MLX arrays.

Random draws use NumPy's ``default_rng`` seeded with ``(stream tag, seed)``, so a matrix depends
only on ``(d, seed)`` (not on MLX's global RNG state), and primitives that share a seed (a rotation
and a JL sketch built from the same config seed) still draw independent randomness.
The factorisation is done in float64 and the result rounded to float32.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

__all__ = ["random_orthogonal", "randomized_hadamard", "hadamard", "seeded_rng"]

_TAG_ORTHOGONAL = 0x0A7E_0001
_TAG_HADAMARD = 0x0A7E_0002


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed={seed!r} is invalid: expected an int")
    return int(seed)


def seeded_rng(tag: int, seed: int) -> np.random.Generator:
    """A NumPy generator for stream ``tag`` and integer ``seed`` (any sign)."""
    return np.random.default_rng([int(tag), _check_seed(seed) % (1 << 64)])


def _check_dim(d) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d={d!r} is invalid: expected an int >= 1")
    return int(d)


@functools.lru_cache(maxsize=64)
def _orthogonal_np(d: int, seed: int) -> np.ndarray:
    g = seeded_rng(_TAG_ORTHOGONAL, seed).standard_normal((d, d))
    q, r = np.linalg.qr(g)
    # Sign fix: make diag(R) positive so Q is Haar-distributed (and the factorisation unique).
    s = np.sign(np.diag(r))
    s[s == 0] = 1.0
    q = q * s[None, :]
    q = q.astype(np.float32)
    q.setflags(write=False)
    return q


def random_orthogonal(d: int, seed: int) -> mx.array:
    """Haar-random ``d x d`` orthogonal matrix: QR of a seeded Gaussian matrix with the sign fix."""
    return mx.array(_orthogonal_np(_check_dim(d), _check_seed(seed)))


@functools.lru_cache(maxsize=16)
def _hadamard_np(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(d: int) -> mx.array:
    """Normalized Sylvester Hadamard matrix ``H / sqrt(d)`` (``d`` a power of two)."""
    d = _check_dim(d)
    if d & (d - 1):
        raise ValueError(f"d={d!r} is invalid: expected a power of two")
    return mx.array((_hadamard_np(d) / np.sqrt(d)).astype(np.float32))


@functools.lru_cache(maxsize=64)
def _randomized_hadamard_np(d: int, seed: int) -> np.ndarray:
    signs = seeded_rng(_TAG_HADAMARD, seed).choice(np.array([-1.0, 1.0]), size=d)
    m = ((_hadamard_np(d) / np.sqrt(d)) * signs[None, :]).astype(np.float32)
    m.setflags(write=False)
    return m


def randomized_hadamard(d: int, seed: int) -> mx.array:
    """``H D``: normalized Hadamard times a seeded random +-1 diagonal; ``d`` a power of two."""
    d = _check_dim(d)
    if d & (d - 1):
        raise ValueError(f"d={d!r} is invalid: expected a power of two")
    return mx.array(_randomized_hadamard_np(d, _check_seed(seed)))
