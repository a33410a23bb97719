"""Seeded random rotations (d x d orthogonal, float32). NumPy's ``default_rng`` is seeded with ``(stream tag,
seed)``: a matrix depends only on ``(d, seed)``, and primitives sharing a seed draw independently."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from . import check_int

_TAG_ORTHOGONAL, _TAG_HADAMARD = 0x0A7E_0001, 0x0A7E_0002


def seeded_rng(tag: int, seed: int) -> np.random.Generator:
    """A NumPy generator for stream ``tag`` and integer ``seed`` (any sign)."""
    return np.random.default_rng([int(tag), check_int("seed", seed) % (1 << 64)])


def frozen(m: np.ndarray) -> np.ndarray:
    """A read-only float32 copy (safe to hand out of an ``lru_cache``)."""
    m = np.asarray(m, dtype=np.float32)
    m.setflags(write=False)
    return m


@functools.lru_cache(maxsize=64)
def _orthogonal_np(d: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(seeded_rng(_TAG_ORTHOGONAL, seed).standard_normal((d, d)))
    s = np.where(np.diag(r) < 0, -1.0, 1.0)  # diag(R) > 0 makes Q Haar-distributed
    return frozen(q * s[None, :])


def random_orthogonal(d: int, seed: int) -> mx.array:
    """Haar-random ``d x d`` orthogonal matrix: QR of a seeded Gaussian matrix with the sign fix."""
    return mx.array(_orthogonal_np(check_int("d", d, 1), check_int("seed", seed)))


@functools.lru_cache(maxsize=16)
def _hadamard_np(d: int) -> np.ndarray:
    d = check_int("d", d, 1)
    if d & (d - 1):
        raise ValueError(f"d={d!r} is invalid: expected a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def hadamard(d: int) -> mx.array:
    """Normalized Sylvester Hadamard matrix ``H / sqrt(d)`` (``d`` a power of two)."""
    return mx.array(_hadamard_np(d).astype(np.float32))


@functools.lru_cache(maxsize=64)
def _randomized_hadamard_np(d: int, seed: int) -> np.ndarray:
    return frozen(_hadamard_np(d) * seeded_rng(_TAG_HADAMARD, seed).choice(np.array([-1.0, 1.0]), size=d)[None, :])


def randomized_hadamard(d: int, seed: int) -> mx.array:
    """``H D``: normalized Hadamard times a seeded random +-1 diagonal; ``d`` a power of two."""
    return mx.array(_randomized_hadamard_np(d, check_int("seed", seed)))
