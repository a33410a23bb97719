"""Dense bit packing of small integer codes into ``uint32`` words along the last axis: each row of ``n`` codes is one
little-endian bit stream (code ``j`` at stream bits ``[j*bits, (j+1)*bits)``, stream bit ``p`` = bit ``p % 32`` of
word ``p // 32``, codes may straddle words), zero-padded to ``ceil(n * bits / 32)`` words.
"""

from __future__ import annotations

import mlx.core as mx

from . import check_int
from .fused import elementwise


def packed_words(n: int, bits: int) -> int:
    """Number of ``uint32`` words holding one row of ``n`` codes of ``bits`` bits."""
    return (check_int("n", n, 0) * check_int("bits", bits, 1, 8) + 31) // 32


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by one packed row of ``n`` codes of ``bits`` bits (whole 32-bit words)."""
    return 4 * packed_words(n, bits)


def stream_words(stream: mx.array, n_words: int) -> mx.array:
    """A ``uint32`` stream of 0/1 bits ``(..., p)`` as ``n_words`` words ``(..., n_words)``, zero-padded."""
    lead, pad = stream.shape[:-1], n_words * 32 - stream.shape[-1]
    if pad:
        stream = mx.concatenate([stream, mx.zeros((*lead, pad), dtype=mx.uint32)], axis=-1)
    # bits are disjoint, so the sum of the shifted bits is their OR
    stream = mx.left_shift(stream.reshape(*lead, n_words, 32), mx.arange(32, dtype=mx.uint32))
    return mx.sum(stream, axis=-1).astype(mx.uint32)


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """Codes ``(..., n)`` in ``[0, 2**bits)`` -> ``uint32`` words ``(..., ceil(n * bits / 32))``; bits of a
    code above ``bits`` are discarded (masked, not checked)."""
    codes = codes if isinstance(codes, mx.array) else mx.array(codes)
    if codes.ndim == 0:
        raise ValueError("codes must have at least one axis")
    lead, n = codes.shape[:-1], codes.shape[-1]
    n_words = packed_words(n, bits)
    stream = mx.bitwise_and(mx.right_shift(codes.astype(mx.uint32)[..., None], mx.arange(bits, dtype=mx.uint32)), 1)
    return stream_words(stream.reshape(*lead, n * bits), n_words)


@elementwise
def extract_codes(lo: mx.array, hi: mx.array, shift: mx.array, mask: mx.array) -> mx.array:
    """Codes from their first word ``lo`` and the next ``hi`` (one fused kernel); ``(hi << (31 - s)) << 1``
    is ``hi << (32 - s)`` without a shift by 32; bits above a non-straddling code's width are masked off."""
    s = shift.astype(mx.uint32)
    return ((lo >> s) | ((hi << (31 - s)) << 1)) & mask.astype(mx.uint32)


@elementwise
def _period_codes(shifts: mx.array, mask: mx.array, *period_bytes: mx.array) -> mx.array:
    """The 8 codes of each ``bits``-byte period (its bytes as ``bits`` arrays, low byte first), ``[..., 8]``."""
    t = period_bytes[0]
    for i, b in enumerate(period_bytes[1:], 1):
        t = t | (b << (8 * i))
    return (t[..., None] >> shifts) & mask


def _unpack_periods(packed: mx.array, bits: int, n: int) -> mx.array:
    """:func:`unpack_bits` for ``n`` a multiple of 8: every 8 codes fill ``bits`` whole bytes of the stream, read as
    one integer (uint32 up to 4 bytes, else uint64) and cut by shifts -- no gather of words per code (on this CPU
    3-bit codes 5x faster, 7-bit 2.8x)."""
    lead = packed.shape[:-1]
    wide = mx.uint64 if bits > 4 else mx.uint32
    period = mx.view(packed, mx.uint8)[..., : n * bits // 8].reshape(*lead, n // 8, bits).astype(wide)
    shifts = mx.arange(0, 8 * bits, bits, dtype=wide)
    codes = _period_codes(shifts, mx.array((1 << bits) - 1, dtype=wide), *(period[..., i] for i in range(bits)))
    return codes.reshape(*lead, n).astype(mx.uint8)


def unpack_bits(packed: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of :func:`pack_bits`: ``(..., words)`` ``uint32`` -> ``(..., n)`` ``uint8`` codes (8- and 4-bit
    codes read the words as bytes; other widths, ``n`` a multiple of 8, as ``bits``-byte periods of 8 codes)."""
    if packed.dtype != mx.uint32:
        raise ValueError(f"packed must be uint32, got {packed.dtype}")
    n_words = packed_words(n, bits)
    if packed.ndim == 0 or packed.shape[-1] < n_words:
        raise ValueError(f"packed has shape {packed.shape}; {n} codes of {bits} bits need {n_words} words")
    lead = packed.shape[:-1]
    if bits == 8:
        return mx.view(packed, mx.uint8)[..., :n]
    if bits == 4:
        b = mx.view(packed, mx.uint8)
        return mx.stack([b & 15, b >> 4], axis=-1).reshape(*lead, -1)[..., :n]
    if n and n % 8 == 0:
        return _unpack_periods(packed[..., :n_words], bits, n)
    offsets = mx.arange(n, dtype=mx.uint32) * bits
    word, shift = (offsets // 32).astype(mx.int32), offsets % 32
    ext = mx.concatenate([packed[..., :n_words], mx.zeros((*lead, 1), dtype=mx.uint32)], axis=-1)  # a next word
    lo, hi = mx.take(ext, word, axis=-1), mx.take(ext, word + 1, axis=-1)
    return extract_codes(lo, hi, shift, mx.array((1 << bits) - 1)).astype(mx.uint8)
