"""Undo and redo a model's rotary position embedding (RoPE) on cached keys: mlx_lm hands caches rotated keys,
and a quantizer that wants pre-RoPE keys (KVQuant: stable channel ranges) undoes the rotation by ``position *
scale * frequency`` per channel pair exactly. ``rope_spec`` reads ``mlx.nn.RoPE`` or mlx_lm's variants with a
``_freqs`` table, checked numerically; anything else (YaRN's ``mscale``, custom positions) gives None.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from .fused import elementwise

_BLOCK = 64  # positions per block of the angle-addition tables in rotate_rows


def rope_spec(module) -> Optional[dict]:
    """``{"dims", "traditional", "base", "scale", "freqs"}`` of ``module`` (a RoPE layer; ``freqs`` a list
    or None), if rotating a random probe with it matches ``module(probe, offset=...)``; else None."""
    if module is None or getattr(module, "mscale", 1.0) != 1.0:
        return None
    dims, traditional, freqs = getattr(module, "dims", None), getattr(module, "traditional", None), \
        getattr(module, "_freqs", None)
    if not isinstance(dims, int) or not isinstance(traditional, bool):
        return None
    try:  # any mismatch in attributes or calling convention means "unknown RoPE"
        spec = {"dims": dims, "traditional": traditional, "base": None if freqs is not None else float(module.base),
                "scale": float(getattr(module, "scale", 1.0)),
                "freqs": None if freqs is None else [float(f) for f in freqs.tolist()]}
        probe = mx.random.normal((1, 1, 3, max(dims + dims % 2, 2)), key=mx.random.key(7))
        want, got = module(probe, offset=11), apply_rope(probe, spec, 11)
    except Exception:  # noqa: BLE001
        return None
    return spec if want.shape == got.shape and bool(mx.allclose(want, got, atol=1e-5, rtol=1e-4)) else None


def apply_rope(x: mx.array, spec: dict, offset: int, inverse: bool = False) -> mx.array:
    """RoPE of rows ``x [B, H, n, D]`` at positions ``offset ..`` (or its inverse); ``spec["freqs"]`` a list or
    an ``mx.array``."""
    scale = -spec["scale"] if inverse else spec["scale"]
    freqs = spec.get("freqs")
    if freqs is not None and not isinstance(freqs, mx.array):
        freqs = mx.array(freqs, dtype=mx.float32)
    return mx.fast.rope(x, spec["dims"], traditional=spec["traditional"], base=spec["base"], scale=scale,
                        offset=offset, freqs=freqs)


def rope_frequencies(spec: dict) -> mx.array:
    """Angle per position of every rotary pair ``[dims // 2]`` (float32, computed in float64):
    ``scale * base^(-2i / dims)``, or ``scale / freqs_i`` with a frequency table (as ``mx.fast.rope``). One array
    per distinct spec, shared by the layers (a model's layers share their RoPE: no host work per layer)."""
    return frequencies_of(spec_key(spec))[1]


def spec_key(spec: dict) -> tuple:
    """``(dims, scale, base, freqs)`` of ``spec``, hashable (its frequency table as a tuple)."""
    freqs = spec.get("freqs")
    if freqs is not None:
        freqs = tuple(float(f) for f in (freqs.tolist() if isinstance(freqs, mx.array) else freqs))
    return spec["dims"], spec["scale"], spec.get("base"), freqs


@functools.lru_cache(maxsize=64)
def frequencies_of(key: tuple) -> tuple[np.ndarray, mx.array]:
    """:func:`rope_frequencies` of a :func:`spec_key`, as a read-only host array and as an ``mx.array``."""
    dims, scale, base, freqs = key
    if freqs is not None:
        w = scale / np.asarray(freqs, dtype=np.float64)[: dims // 2]
    else:
        w = scale * float(base) ** (-2.0 * np.arange(dims // 2) / dims)
    w = w.astype(np.float32)
    w.setflags(write=False)
    return w, mx.array(w)


@elementwise
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


def rope_halves(spec: dict):
    """The channels of the rotary pairs' first and second members, and the rotated dims."""
    dims = spec["dims"]
    if spec["traditional"]:
        return slice(0, dims, 2), slice(1, dims, 2), dims
    return slice(0, dims // 2), slice(dims // 2, dims), dims


def rotate_parts(x: mx.array, spec: dict, omega: mx.array, offset, inverse: bool = False):
    """:func:`rotate_rows` in parts (no interleaving copy): the rotated pairs' first and second members and the
    unrotated tail."""
    cos, sin = angle_tables(omega, offset, x.shape[2])
    first, second, dims = rope_halves(spec)
    return (*_turn(x[..., first], x[..., second], cos, -sin if inverse else sin), x[..., dims:])


def rotate_rows(x: mx.array, spec: dict, omega: mx.array, offset, inverse: bool = False) -> mx.array:
    """``apply_rope`` for rows ``x [B, H, n, D]`` at positions ``offset ..`` (an int, or one per batch row)
    without a sine/cosine per element (:func:`angle_tables`; MLX's CPU ``fast.rope`` evaluates one per element:
    ~5x slower for long rows). ``omega`` is :func:`rope_frequencies` of ``spec``."""
    u, v, tail = rotate_parts(x, spec, omega, offset, inverse)
    rot = mx.stack([u, v], axis=-1).reshape(*u.shape[:3], -1) if spec["traditional"] else mx.concatenate([u, v], -1)
    return mx.concatenate([rot, tail], axis=-1) if tail.shape[-1] else rot
