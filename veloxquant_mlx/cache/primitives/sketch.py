"""Gaussian JL sketches and the 1-bit QJL inner-product estimator (QJL, arXiv 2406.03482): a key ``k`` is stored
as the signs of ``S k`` (``S`` ``m x d``, i.i.d. N(0, 1); ``sign(0) = +1``, bit 1) and ``||k||``; for a query ``q``,
``<q, k> ~ sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>`` is unbiased with variance at most ``pi / (2 m) ||q||^2
||k||^2`` (TurboQuant, arXiv 2504.19874, uses ``m = d``).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from . import check_int
from .bitpack import pack_bits
from .rotation import frozen, seeded_rng

QJL_SCALE = math.sqrt(math.pi / 2.0)
_TAG_JL = 0x0A7E_0003


@functools.lru_cache(maxsize=64)
def _jl_np(m: int, d: int, seed: int):
    return frozen(seeded_rng(_TAG_JL, seed).standard_normal((m, d)))


def gaussian_jl(m: int, d: int, seed: int) -> mx.array:
    """``m x d`` float32 JL matrix with i.i.d. N(0, 1) entries, deterministic per ``(m, d, seed)``."""
    return mx.array(_jl_np(check_int("m", m, 1), check_int("d", d, 1), check_int("seed", seed)))


def qjl_signs(S: mx.array, k: mx.array) -> mx.array:
    """Sign bits ``uint8 (..., m)`` of ``S k`` for ``k (..., d)``: 1 where ``S k >= 0``."""
    return (k.astype(mx.float32) @ S.T >= 0).astype(mx.uint8)


def qjl_pack(S: mx.array, k: mx.array) -> mx.array:
    """The sign bits of ``S k`` packed into ``uint32`` words ``(..., ceil(m / 32))`` (how the caches store them)."""
    return pack_bits(qjl_signs(S, k), 1)


def _pm(signs: mx.array) -> mx.array:
    """0/1 sign bits -> float32 +-1."""
    return 2.0 * signs.astype(mx.float32) - 1.0


def qjl_inner_product(q: mx.array, signs: mx.array, norms: mx.array, S: mx.array) -> mx.array:
    """Estimates of ``<q, k_i>`` from 0/1 sign bits ``(n, m)`` and norms ``(n,)``, for ``q`` ``(d,)`` or ``(nq, d)``."""
    return (QJL_SCALE / S.shape[0]) * ((q.astype(mx.float32) @ S.T) @ _pm(signs).T) * norms.astype(mx.float32)


def qjl_dequantize(signs: mx.array, norms: mx.array, S: mx.array) -> mx.array:
    """Vectors ``sqrt(pi/2)/m * ||k|| * S^T sign(S k)`` whose inner products are the estimates above."""
    return (QJL_SCALE / S.shape[0]) * (_pm(signs) @ S) * norms.astype(mx.float32)[..., None]
