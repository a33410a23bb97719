"""Reordered channels and clipped group ranges (SKVQ) on ``groupquant``'s layout: channels sorted by range so
groups hold similar ranges; each group's range shrunk by a searched ``alpha`` and the elements clipped into
it, so ``groupquant.quantize`` of the clipped tensor uses exactly that range (its layout unchanged).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["range_permutation", "permute_channels", "clip_to_alpha", "search_clip"]


def range_permutation(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x [B, H, T, D]`` -> (perm, inv) int32 [H, D]: channels by ascending range over (B, T)."""
    xf = x.astype(mx.float32)
    rng = xf.max(axis=(0, 2)) - xf.min(axis=(0, 2))  # [H, D]
    perm = mx.argsort(rng, axis=-1).astype(mx.int32)
    inv = mx.argsort(perm, axis=-1).astype(mx.int32)
    return perm, inv


def permute_channels(x: mx.array, perm: mx.array) -> mx.array:
    """``x [B, H, T, D]`` with its last axis gathered by ``perm [H, D]`` (per head)."""
    idx = mx.broadcast_to(perm[None, :, None, :], x.shape)
    return mx.take_along_axis(x, idx, axis=-1)


def _bounds(xg: mx.array, alpha: mx.array):
    lo, hi = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    c = (hi + lo) * 0.5
    h = (hi - lo) * 0.5 * alpha
    return c - h, c + h


def clip_to_alpha(x: mx.array, group: int, alpha: mx.array) -> mx.array:
    """``x [B, H, T, D]`` clipped per (token, channel group of ``group``) to its range shrunk by
    ``alpha [H, D/group]`` about the centre. ``alpha`` = 1 leaves ``x`` unchanged."""
    B, H, T, D = x.shape
    xg = x.astype(mx.float32).reshape(B, H, T, D // group, group)
    lo, hi = _bounds(xg, alpha[None, :, None, :, None])
    return mx.clip(xg, lo, hi).reshape(B, H, T, D)


def _fake_quant(xg: mx.array, bits: int, alpha) -> mx.array:
    """Quantize-dequantize groups on the last axis of ``xg`` with the clipped min/max rule (float32)."""
    lo, hi = _bounds(xg, alpha)
    levels = float(2**bits - 1)
    s = (hi - lo) / levels
    s = mx.where(s > 0, s, 1.0)
    return mx.clip(mx.round((xg - lo) / s), 0.0, levels) * s + lo


def search_clip(x: mx.array, bits: int, group: int, candidates) -> mx.array:
    """``alpha [H, D/group]`` (float32): per head and channel group, the candidate minimising
    ``sum((_fake_quant(x) - x)^2)`` over the block ``x [B, H, T, D]`` (already channel-permuted)."""
    B, H, T, D = x.shape
    a = mx.array(list(candidates), dtype=mx.float32)
    xg = x.astype(mx.float32).reshape(1, B, H, T, D // group, group)
    err = ((_fake_quant(xg, bits, a.reshape(-1, 1, 1, 1, 1, 1)) - xg) ** 2).sum(axis=(1, 3, 5))  # [A, H, ng]
    return a[mx.argmin(err, axis=0)]
