"""Gaussian JL sketches and the 1-bit QJL inner-product estimator (QJL, arXiv 2406.03482).

QJL stores, for a key ``k``, only the signs of a Gaussian projection ``S k`` (``S`` is ``m x d`` with
i.i.d. N(0, 1) entries) and the norm ``||k||``. For an unquantized query ``q`` the asymmetric estimator

    <q, k>  ~  sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>

is unbiased: for one row ``s`` of ``S``, ``E[<s, q> sign(<s, k>)] = sqrt(2/pi) <q, k> / ||k||``
(the QJL paper's asymmetric estimator; TurboQuant, arXiv 2504.19874, uses it with ``m = d``), and
its variance is at most ``pi / (2 m) * ||q||^2 ||k||^2``.

Sign convention: ``sign(0) = +1``. Sign bits are ``uint8`` with 1 for +1 and 0 for -1, ready for
:func:`veloxquant_mlx.cache.primitives.bitpack.pack_bits` at 1 bit.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from .rotation import seeded_rng

__all__ = ["gaussian_jl", "qjl_signs", "qjl_inner_product", "qjl_dequantize", "QJL_SCALE"]

QJL_SCALE = math.sqrt(math.pi / 2.0)
_TAG_JL = 0x0A7E_0003


@functools.lru_cache(maxsize=64)
def _jl_np(m: int, d: int, seed: int) -> np.ndarray:
    s = seeded_rng(_TAG_JL, seed).standard_normal((m, d)).astype(np.float32)
    s.setflags(write=False)
    return s


def gaussian_jl(m: int, d: int, seed: int) -> mx.array:
    """``m x d`` float32 JL matrix with i.i.d. N(0, 1) entries, deterministic per ``(m, d, seed)``."""
    for name, v in (("m", m), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: expected an int >= 1")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed={seed!r} is invalid: expected an int")
    return mx.array(_jl_np(int(m), int(d), int(seed)))


def qjl_signs(S: mx.array, k: mx.array) -> mx.array:
    """Sign bits of ``S k`` for ``k`` of shape ``(d,)`` or ``(..., d)``.

    Returns ``uint8`` of shape ``(..., m)``: 1 where ``S k >= 0``, 0 where it is negative.
    """
    proj = k.astype(mx.float32) @ S.T
    return (proj >= 0).astype(mx.uint8)


def _pm(signs: mx.array) -> mx.array:
    """0/1 sign bits (or already +-1 values) -> float32 +-1."""
    if signs.dtype in (mx.uint8, mx.uint16, mx.uint32, mx.bool_):
        return 2.0 * signs.astype(mx.float32) - 1.0
    return mx.where(signs.astype(mx.float32) >= 0, 1.0, -1.0)


def qjl_inner_product(q: mx.array, signs: mx.array, norms: mx.array, S: mx.array) -> mx.array:
    """Unbiased estimates of ``<q, k_i>`` from ``sign(S k_i)`` and ``||k_i||``.

    ``q``: ``(d,)`` or ``(nq, d)``; ``signs``: ``(n, m)`` sign bits (0/1, or +-1 floats); ``norms``:
    ``(n,)``. Returns ``(n,)`` for a single query, ``(nq, n)`` for a block.
    """
    m = S.shape[0]
    sq = q.astype(mx.float32) @ S.T  # (..., m)
    dots = sq @ _pm(signs).T  # (..., n)
    return (QJL_SCALE / m) * dots * norms.astype(mx.float32)


def qjl_dequantize(signs: mx.array, norms: mx.array, S: mx.array) -> mx.array:
    """Vectors ``sqrt(pi/2)/m * ||k|| * S^T sign(S k)`` whose inner products are the estimates above."""
    m = S.shape[0]
    return (QJL_SCALE / m) * (_pm(signs) @ S) * norms.astype(mx.float32)[..., None]
