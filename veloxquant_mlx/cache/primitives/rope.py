"""Undo and redo a model's rotary position embedding (RoPE) on cached keys.

mlx_lm hands caches RoPE-rotated keys; a quantizer that wants pre-RoPE keys (KVQuant: their channels have
stable ranges) undoes the rotation exactly, RoPE being a rotation by ``position * scale * frequency`` per
channel pair (the inverse negates the scale). ``rope_spec(module)`` reads an attention module's ``rope``
(``mlx.nn.RoPE``, or mlx_lm's variants with a ``_freqs`` table) and checks it numerically against the
module; anything else (YaRN's ``mscale``, custom positions) gives None and the caller keeps post-RoPE keys.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

__all__ = ["rope_spec", "apply_rope", "rope_frequencies", "rotate_rows", "angle_tables"]

_BLOCK = 64  # positions per block of the angle-addition tables in rotate_rows


def rope_spec(module) -> Optional[dict]:
    """``{"dims", "traditional", "base", "scale", "freqs"}`` of ``module`` (a RoPE layer; ``freqs`` a list
    or None), if rotating a random probe with it matches ``module(probe, offset=...)``; else None."""
    if module is None or getattr(module, "mscale", 1.0) != 1.0:
        return None
    dims, traditional = getattr(module, "dims", None), getattr(module, "traditional", None)
    scale = getattr(module, "scale", 1.0)
    base = getattr(module, "base", None)
    freqs = getattr(module, "_freqs", None)
    if not isinstance(dims, int) or not isinstance(traditional, bool) or not isinstance(scale, (int, float)):
        return None
    if freqs is None and not isinstance(base, (int, float)):
        return None
    spec = {"dims": dims, "traditional": traditional, "base": None if freqs is not None else float(base),
            "scale": float(scale), "freqs": None if freqs is None else [float(f) for f in freqs.tolist()]}
    d = dims + (dims % 2)
    probe = mx.random.normal((1, 1, 3, max(d, 2)), key=mx.random.key(7))
    try:
        want = module(probe, offset=11)
        got = apply_rope(probe, spec, 11)
    except Exception:  # noqa: BLE001 -- any mismatch in calling convention means "unknown RoPE"
        return None
    if want.shape != got.shape or not bool(mx.allclose(want, got, atol=1e-5, rtol=1e-4)):
        return None
    return spec


def apply_rope(x: mx.array, spec: dict, offset: int, inverse: bool = False) -> mx.array:
    """RoPE of rows ``x [B, H, n, D]`` at positions ``offset .. offset + n - 1`` (or its inverse).
    ``spec["freqs"]`` may be a list (as stored) or an ``mx.array`` (converted once by the caller)."""
    scale = -spec["scale"] if inverse else spec["scale"]
    freqs = spec.get("freqs")
    if freqs is not None and not isinstance(freqs, mx.array):
        freqs = mx.array(freqs, dtype=mx.float32)
    return mx.fast.rope(x, spec["dims"], traditional=spec["traditional"], base=spec["base"], scale=scale,
                        offset=offset, freqs=freqs)


def rope_frequencies(spec: dict) -> mx.array:
    """Angle per position of every rotary pair ``[dims // 2]`` (float32, computed in float64):
    ``scale * base^(-2i / dims)``, or ``scale / freqs_i`` with a frequency table (as ``mx.fast.rope``)."""
    half = spec["dims"] // 2
    if spec.get("freqs") is not None:
        w = spec["scale"] / np.asarray(spec["freqs"], dtype=np.float64)[:half]
    else:
        w = spec["scale"] * float(spec["base"]) ** (-2.0 * np.arange(half) / spec["dims"])
    return mx.array(w.astype(np.float32))


@functools.partial(mx.compile, shapeless=True)
def _turn(a, b, c, s):
    return a * c - b * s, a * s + b * c


def angle_tables(omega: mx.array, offset, n: int) -> tuple[mx.array, mx.array]:
    """``cos`` and ``sin`` of ``p * omega`` for positions ``p = offset .. offset + n - 1`` by angle addition over
    blocks of 64 positions (``(n / 64 + 64) * P`` trigonometric values): ``[n, P]`` each, or ``[B, 1, n, P]``
    when ``offset`` holds one start per batch row (a batch cache's sequences at their own positions)."""
    nb = -(-n // _BLOCK)
    per_row = not isinstance(offset, int)
    p0 = mx.array(offset, dtype=mx.float32)[:, None] if per_row else offset
    starts = (p0 + _BLOCK * mx.arange(nb, dtype=mx.float32))[..., None] * omega  # [(B,) nb, P]
    steps = mx.arange(_BLOCK, dtype=mx.float32)[:, None] * omega  # [Q, P]
    cos, sin = _turn(mx.cos(starts)[..., None, :], mx.sin(starts)[..., None, :], mx.cos(steps), mx.sin(steps))
    lead, P = ((p0.shape[0], 1) if per_row else ()), omega.shape[0]
    return cos.reshape(*lead, nb * _BLOCK, P)[..., :n, :], sin.reshape(*lead, nb * _BLOCK, P)[..., :n, :]


def rotate_rows(x: mx.array, spec: dict, omega: mx.array, offset, inverse: bool = False) -> mx.array:
    """``apply_rope`` for rows ``x [B, H, n, D]`` at positions ``offset ..`` (an int, or one per batch row)
    without a sine/cosine per element (:func:`angle_tables`; MLX's CPU ``fast.rope`` evaluates one per
    element: ~5x slower for long rows). ``omega`` is :func:`rope_frequencies` of ``spec``."""
    cos, sin = angle_tables(omega, offset, x.shape[2])
    P = omega.shape[0]
    if inverse:
        sin = -sin
    dims = spec["dims"]
    if spec["traditional"]:
        pairs = x[..., :dims].reshape(*x.shape[:3], P, 2)
        u, v = _turn(pairs[..., 0], pairs[..., 1], cos, sin)
        rot = mx.stack([u, v], axis=-1).reshape(*x.shape[:3], dims)
    else:
        u, v = _turn(x[..., :P], x[..., P:dims], cos, sin)
        rot = mx.concatenate([u, v], axis=-1)
    return rot if dims == x.shape[-1] else mx.concatenate([rot, x[..., dims:]], axis=-1)
