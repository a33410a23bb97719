"""Reordered channels and clipped group ranges (SKVQ) on ``groupquant``'s layout: channels sorted by range so
groups hold similar ranges; each group's range shrunk by a searched ``alpha`` and the elements clipped into it,
so ``groupquant.quantize`` of the clipped tensor uses exactly that range."""

from __future__ import annotations

import mlx.core as mx


def range_permutation(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x [B, H, T, D]`` -> (perm, inv) int32 [H, D]: channels by ascending range over (B, T)."""
    xf = x.astype(mx.float32)
    perm = mx.argsort(xf.max(axis=(0, 2)) - xf.min(axis=(0, 2)), axis=-1).astype(mx.int32)
    return perm, mx.argsort(perm, axis=-1).astype(mx.int32)


def permute_channels(x: mx.array, perm: mx.array) -> mx.array:
    """``x [B, H, T, D]`` with its last axis gathered by ``perm [H, D]`` (per head)."""
    return mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)


def _bounds(xg: mx.array, alpha: mx.array):
    lo, hi = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    c, h = (hi + lo) * 0.5, (hi - lo) * 0.5 * alpha
    return c - h, c + h


def clip_to_alpha(x: mx.array, group: int, alpha: mx.array) -> mx.array:
    """``x [B, H, T, D]`` clipped per (token, channel group) to its range shrunk by ``alpha [H, D/group]``
    about the centre (``alpha`` = 1: unchanged)."""
    B, H, T, D = x.shape
    xg = x.astype(mx.float32).reshape(B, H, T, D // group, group)
    return mx.clip(xg, *_bounds(xg, alpha[None, :, None, :, None])).reshape(B, H, T, D)


def search_clip(x: mx.array, bits: int, group: int, candidates) -> mx.array:
    """``alpha [H, D/group]`` (float32): per head and channel group, the candidate minimising the squared
    error of the clipped min/max quantize-dequantize (float32) over the block ``x [B, H, T, D]``."""
    B, H, T, D = x.shape
    a = mx.array(list(candidates), dtype=mx.float32)
    xg = x.astype(mx.float32).reshape(1, B, H, T, D // group, group)
    lo, hi = _bounds(xg, a.reshape(-1, 1, 1, 1, 1, 1))
    levels = float(2**bits - 1)
    s = (hi - lo) / levels
    s = mx.where(s > 0, s, 1.0)
    fake = mx.clip(mx.round((xg - lo) / s), 0.0, levels) * s + lo
    return a[mx.argmin(((fake - xg) ** 2).sum(axis=(1, 3, 5)), axis=0)]  # err [A, H, ng]
