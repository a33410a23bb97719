"""Variable-width bit packing: every channel has its own code width (0..8 bits). A ``VarLayout`` is built once
from a width table ``bits [G, D]`` (equal row sums ``P``); a row of ``D`` codes is one little-endian bit stream as
in ``bitpack``, channel ``c`` at bits ``[off_c, off_c + bits_c)``, padded to ``ceil(P / 32)`` words (a 0-bit
channel unpacks to 0). Packing is one gather of stream bits; unpacking two gathers per code.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .bitpack import extract_codes, stream_words
from .fused import elementwise

__all__ = ["VarLayout", "extract_codes"]


class VarLayout:
    """Index tables of the layout of ``bits [G, D]``, for rows ``[.., G, n, D]``: per stream bit its channel
    and bit (``src_channel``/``src_bit`` [G, P]); per channel its first word, the next, its bit offset and
    width mask (``word``/``next_word``/``shift``/``mask`` [G, D])."""

    def __init__(self, bits, total_bits: int | None = None):
        """``bits``: a host table (checked), or a device one (``mx.array``, e.g. from ``allocate_bits``) with its
        row total ``total_bits`` (trusted: checking it would wait for the device); the tables stay lazy."""
        if isinstance(bits, mx.array):
            if total_bits is None or bits.ndim != 2:
                raise ValueError("a device width table must be [G, D] and come with its total_bits")
            b = bits.astype(mx.int32)
        else:
            h = np.asarray(bits, dtype=np.int64)
            if h.ndim != 2 or h.size == 0:
                raise ValueError(f"bits must be a non-empty [G, D] table, got shape {h.shape}")
            if h.min() < 0 or h.max() > 8:
                raise ValueError(f"code widths must be in 0..8, got {h.min()}..{h.max()}")
            totals = h.sum(axis=1)
            if not (totals == totals[0]).all():
                raise ValueError(f"every row of bits must sum to the same total, got {sorted(set(totals.tolist()))}")
            b, total_bits = mx.array(h.astype(np.int32)), int(totals[0])
        self.groups, self.dim = b.shape
        self.total_bits = P = int(total_bits)
        self.words = (P + 31) // 32
        idx_t = mx.uint8 if self.dim <= 256 and self.words <= 256 else mx.int32  # small tables: they are held
        off = mx.cumsum(b, axis=1) - b  # exclusive cumulative sum: each channel's first stream bit
        stream_bit = mx.arange(max(P, 1))  # a 0-bit layout keeps one (unused) column
        ch = ((off + b)[:, None, :] <= stream_bit[None, :, None]).sum(axis=-1)  # channels ending at or before it
        ch = mx.minimum(ch, self.dim - 1) if P == 0 else ch
        self.bits = b.astype(mx.uint8)
        self.src_channel = ch.astype(idx_t)
        self.src_bit = (stream_bit - mx.take_along_axis(off, ch, axis=1)).astype(mx.uint8)  # bit within its code
        self.word = (off // 32).astype(idx_t)
        self.next_word = mx.minimum(off // 32 + 1, max(self.words - 1, 0)).astype(idx_t)
        self.shift = (off % 32).astype(mx.uint8)
        self.mask = (mx.left_shift(1, b) - 1).astype(mx.uint8)

    def arrays(self) -> list[mx.array]:
        return [self.bits, self.src_channel, self.src_bit, self.word, self.next_word, self.shift, self.mask]

    nbytes = property(lambda self: sum(a.nbytes for a in self.arrays()))

    def pack(self, codes: mx.array) -> mx.array:
        """``codes [.., G, n, D]`` (integers, each below ``2**bits``) -> ``uint32`` words ``[.., G, n, W]``."""
        lead = codes.shape[:-1]
        if codes.shape[-3] != self.groups or codes.shape[-1] != self.dim:
            raise ValueError(f"codes {codes.shape} do not match the layout [.., {self.groups}, n, {self.dim}]")
        if self.total_bits == 0:
            return mx.zeros((*lead, 0), dtype=mx.uint32)
        P = self.total_bits
        idx = mx.broadcast_to(self.src_channel[:, None, :P], (*lead, P))
        stream = (mx.take_along_axis(codes.astype(mx.uint32), idx, axis=-1) >> self.src_bit[:, None, :P]) & 1
        return stream_words(stream, self.words)

    def gather(self, words: mx.array) -> tuple[mx.array, mx.array]:
        """Each channel's first word and the next one, ``[.., G, n, D]`` each (two gathers)."""
        lead = (1,) * (words.ndim - 3) + (self.groups, 1, self.dim)
        return (mx.take_along_axis(words, self.word.reshape(lead), axis=-1),
                mx.take_along_axis(words, self.next_word.reshape(lead), axis=-1))

    def unpack(self, words: mx.array) -> mx.array:
        """Inverse of :meth:`pack`: ``[.., G, n, W]`` words -> ``uint32`` codes ``[.., G, n, D]``."""
        if self.total_bits == 0:
            return mx.zeros((*words.shape[:-1], self.dim), dtype=mx.uint32)
        lo, hi = self.gather(words)
        return extract_codes(lo, hi, self.shift[:, None], self.mask[:, None])


def pair_table(layout: VarLayout):
    """Per (group, channel): the byte where its code starts (``[1, G, 1, D]``) and the code's bit offset in
    that byte (``[G, 1, D]``), for :func:`dequantize_pairs`."""
    dt = mx.uint8 if layout.words * 4 <= 256 else mx.uint16
    byte = (layout.word.astype(mx.uint16) * 4 + (layout.shift >> 3)).astype(dt)[None, :, None]
    return byte, (layout.shift & 7)[:, None]


def dequantize_pairs(words, byte, shift, mask, lo, step):
    """``lo + code * step`` for every channel of ``words [B, G, n, W]`` (codes of width <= 8): a code at stream
    bit ``o`` lies in the 16 bits from byte ``o // 8``, so the bytes are paired with their next byte once, then
    one gather per code, a shift and a mask (:meth:`VarLayout.unpack` gathers two words per code)."""
    by = mx.view(mx.contiguous(words), mx.uint8)  # (a strided input makes the fused kernels ~4x slower)
    pairs = _byte_pairs(by, mx.pad(by[..., 1:], [(0, 0)] * (by.ndim - 1) + [(0, 1)]))
    return _pair_dequantize(mx.take_along_axis(pairs, byte, axis=-1), shift, mask, lo, step)


@elementwise
def _byte_pairs(b, following):
    return b.astype(mx.uint16) | (following.astype(mx.uint16) << 8)


@elementwise
def _pair_dequantize(pairs, shift, mask, lo, step):
    return lo + ((pairs >> shift) & mask).astype(mx.float32) * step  # (float16 -> 32 per element: 3x slower)
