"""Preallocated buffers grown in steps: amortised O(1) appends along the token (or last) axis."""

from __future__ import annotations

import functools

import mlx.core as mx

MIN_GROW = 16


@functools.cache
def dtype_name(dtype) -> str:
    """``"float16"`` for ``mx.float16``: the name a cache keeps of the rows' dtype (asked every call)."""
    return str(dtype).rsplit(".", 1)[-1]


def grow_rows(buf, rows: int, new: mx.array) -> mx.array:
    """Write ``new`` at row ``rows`` of ``buf`` (axis 2), growing it by max(16, rows/8) spare rows."""
    n = new.shape[2]
    if buf is None or rows + n > buf.shape[2]:
        shape = list(new.shape)
        shape[2] = rows + n + max(MIN_GROW, (rows + n) // 8) - (0 if buf is None else rows)
        pad = mx.zeros(shape, dtype=new.dtype)
        buf = pad if buf is None else mx.concatenate([buf[:, :, :rows], pad], axis=2)
    buf[:, :, rows : rows + n] = new
    return buf


def take_rows(buf: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` [B, H, k] of each (batch row, head) of ``buf`` [B, H, cap, D]: [B, H, k, D], one gather of whole
    rows from the flattened buffer (MLX's ``take_along_axis`` over an index broadcast along D was 1.3-3x slower on
    the CPU: A2ATS's retrieved rows at 4k)."""
    B, H, cap, D = buf.shape
    flat = (mx.arange(B * H, dtype=mx.int32)[:, None] * cap + idx.reshape(B * H, -1).astype(mx.int32)).reshape(-1)
    return mx.take(buf.reshape(B * H * cap, D), flat, axis=0).reshape(B, H, -1, D)


def reserve_rows(buf, rows: int, new: mx.array, block: int):
    """Room for ``new`` at row ``rows`` (axis 2) with at most 1/32 + ``block`` spare rows (then ``grow_rows``
    writes in place): for rows arriving in blocks of ``block`` or more, less slack than ``grow_rows``."""
    need = rows + new.shape[2]
    if buf is not None and need <= buf.shape[2]:
        return buf
    shape = list(new.shape)
    shape[2] = need + max(block, need // 32)
    out = mx.zeros(shape, dtype=new.dtype)
    if buf is not None and rows:
        out[:, :, :rows] = buf[:, :, :rows]
    return out


def grow_columns(buf, used: int, new: mx.array, capacity: int) -> mx.array:
    """Write ``new`` at column ``used`` of ``buf``'s last axis, reallocating to ``capacity`` columns
    (keeping the first ``used``) when it does not fit."""
    n = new.shape[-1]
    if buf is None or used + n > buf.shape[-1]:
        capacity = max(capacity, used + n)
        pad = mx.zeros((*new.shape[:-1], capacity - used), dtype=new.dtype)
        buf = pad if buf is None else mx.concatenate([buf[..., :used], pad], axis=-1)
    buf[..., used : used + n] = new
    return buf


def fp16_row_bytes(keys, values, tokens: int) -> int:
    """Bytes of ``tokens`` float16 key and value rows shaped like ``keys``/``values [B, H, rows, D]`` (0 when
    None): mlx_lm's plain cache without spare rows, the reference of ``compression_ratio``."""
    if keys is None:
        return 0
    B, H, _, D = keys.shape
    return B * H * tokens * (D + values.shape[-1]) * 2
