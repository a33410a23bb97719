"""Entropy coding of b-bit code streams for CacheGen's saved form (arXiv 2310.07240, 5.1.3: codes arithmetic-coded
with tables grouped by channel and layer), with ``constriction``'s ANS coder. ``symbols [T, n]``: T streams of n
codes, stream ``i`` under static table ``table_of[i]`` (its streams' symbol counts scaled to ``P = min(12, bits +
4)`` bits, stored in the output; the leaky model gives every symbol a nonzero probability, so any code
round-trips). Output (format 2): byte ``FORMAT_ANS`` (0xC2), the bit-packed tables, the little-endian uint32 ANS
words (table 0's streams first); or ``FORMAT_RAW`` (0xC3) and the streams packed at ``bits`` bits when coding is not
shorter. Format 1 (the numpy rANS coder, first byte 2 or 4) is refused with an error naming it.
"""

from __future__ import annotations

import constriction
import numpy as np

FORMAT_ANS, FORMAT_RAW = 0xC2, 0xC3


def prob_bits(bits: int) -> int:
    """Precision P of the stored frequency tables for ``bits``-bit symbols (entries < 2**P)."""
    return min(12, bits + 4)


def raw_nbytes(n: int, bits: int) -> int:
    """Bytes of one stream of n codes packed at ``bits`` bits."""
    return (n * bits + 7) // 8


def _pack_raw(sym: np.ndarray, bits: int) -> np.ndarray:
    """Rows of ``sym [t, n]`` packed at ``bits`` bits (little-endian bit order), ``raw_nbytes`` each."""
    t, n = sym.shape
    b = ((sym[..., None].astype(np.int64) >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(b.reshape(t, n * bits), axis=-1, bitorder="little")


def _unpack_raw(buf: np.ndarray, t: int, n: int, bits: int, dtype=np.uint8) -> np.ndarray:
    b = np.unpackbits(buf.reshape(t, -1), axis=-1, count=n * bits, bitorder="little").reshape(t, n, bits)
    return (b.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(-1).astype(dtype)


def _models(F: np.ndarray):
    """One leaky categorical model per table of stored frequencies (None for a table with no counts)."""
    return [constriction.stream.model.Categorical(f / f.sum(), perfect=False) if f.any() else None
            for f in F.astype(np.float64)]


def encode(symbols: np.ndarray, bits: int, table_of: np.ndarray, n_tables: int) -> np.ndarray:
    """Entropy-code ``symbols [T, n]`` (ints in ``[0, 2**bits)``), stream i with table ``table_of[i]``."""
    sym = np.ascontiguousarray(symbols, dtype=np.uint8)
    T, n = sym.shape
    S, P = 1 << bits, prob_bits(bits)
    tab = np.asarray(table_of, dtype=np.int64)
    cnt = np.bincount((tab[:, None] * S + sym).ravel(), minlength=n_tables * S).reshape(n_tables, S)
    F = (cnt * ((1 << P) - 1)) // np.maximum(cnt.sum(-1, keepdims=True), 1)  # < 2**P; a used symbol may get 0
    coder = constriction.stream.stack.AnsCoder()
    models = _models(F)
    for t in reversed(range(n_tables)):  # a stack: the last table coded is the first decoded
        streams = sym[tab == t]
        if streams.size:
            coder.encode_reverse(streams.ravel().astype(np.int32), models[t])
    words = coder.get_compressed().astype("<u4").view(np.uint8)
    table_bytes = _pack_raw(F.reshape(1, -1), P).ravel()
    if table_bytes.size + words.size >= T * raw_nbytes(n, bits):
        return np.concatenate([[FORMAT_RAW], _pack_raw(sym, bits).ravel()]).astype(np.uint8)
    return np.concatenate([[FORMAT_ANS], table_bytes, words]).astype(np.uint8)


def decode(buf: np.ndarray, T: int, n: int, bits: int, table_of: np.ndarray, n_tables: int) -> np.ndarray:
    """Inverse of ``encode``: the ``[T, n]`` uint8 codes."""
    buf = np.asarray(buf, dtype=np.uint8)
    if buf[0] == FORMAT_RAW:
        return _unpack_raw(buf[1 : 1 + T * raw_nbytes(n, bits)], T, n, bits)
    if buf[0] != FORMAT_ANS:
        raise ValueError(f"entropy-coded stream of format 1 (first byte {int(buf[0])}: the numpy rANS coder of "
                         "veloxquant-mlx before issue #15) or not entropy-coded; this version reads format 2 only")
    S, P = 1 << bits, prob_bits(bits)
    nt = (n_tables * S * P + 7) // 8
    F = _unpack_raw(buf[1 : 1 + nt], 1, n_tables * S, P, np.int64).reshape(n_tables, S)
    tail = buf[1 + nt :]
    coder = constriction.stream.stack.AnsCoder(tail[: tail.size // 4 * 4].view("<u4").astype(np.uint32))
    models = _models(F)
    tab = np.asarray(table_of, dtype=np.int64)
    out = np.empty((T, n), dtype=np.uint8)
    for t in range(n_tables):
        rows = np.nonzero(tab == t)[0]
        if rows.size:
            out[rows] = coder.decode(models[t], rows.size * n).reshape(rows.size, n)
    return out
