"""Helpers for group quantizers with reordered channels and clipped ranges (SKVQ-style) on top of
``groupquant``'s group-affine layout.

* ``range_permutation``: per head, the channels sorted by their value range (max - min) over a
  calibration block, so that consecutive groups of channels have similar ranges.
* ``clip_to_alpha``: shrink every group's [min, max] range about its centre by a factor ``alpha``
  (per head and group) and clip the elements into it; ``groupquant.quantize`` of the clipped tensor
  then uses exactly the clipped range (its min/max are the clipped bounds), so the codes keep
  ``groupquant``'s layout (and MLX's, where ``uses_mx_kernels``).
* ``search_clip``: per head and channel group, the ``alpha`` among candidates that minimises the
  squared reconstruction error of a calibration block (all candidates evaluated at once, vectorized).

Everything is vectorized MLX: no loop over tokens, heads or groups (only over nothing: candidates are
a leading axis).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["range_permutation", "permute_channels", "clip_to_alpha", "fake_quant", "search_clip"]


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
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
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


def fake_quant(xg: mx.array, bits: int, alpha) -> mx.array:
    """Quantize-dequantize groups on the last axis of ``xg`` with the clipped min/max rule (float32)."""
    lo, hi = _bounds(xg, alpha)
    levels = float(2**bits - 1)
    s = (hi - lo) / levels
    s = mx.where(s > 0, s, 1.0)
    q = mx.clip(mx.round((xg - lo) / s), 0.0, levels)
    return q * s + lo


def search_clip(x: mx.array, bits: int, group: int, candidates) -> mx.array:
    """``alpha [H, D/group]`` (float32): per head and channel group, the candidate minimising
    ``sum((fake_quant(x) - x)^2)`` over the block ``x [B, H, T, D]`` (already channel-permuted)."""
    B, H, T, D = x.shape
    a = mx.array(list(candidates), dtype=mx.float32)
    xg = x.astype(mx.float32).reshape(1, B, H, T, D // group, group)
    err = ((fake_quant(xg, bits, a.reshape(-1, 1, 1, 1, 1, 1)) - xg) ** 2).sum(axis=(1, 3, 5))  # [A, H, ng]
    return a[mx.argmin(err, axis=0)]
