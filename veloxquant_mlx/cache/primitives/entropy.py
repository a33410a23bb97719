"""A small static-frequency rANS entropy coder for streams of b-bit quantization codes (numpy).

Used for the *saved* form of entropy-coded caches (CacheGen, arXiv 2310.07240, section 5.1.3: the
quantized KV codes are arithmetic-coded with probability tables grouped by channel and layer).
Saving is not a hot path, so this is numpy; it is vectorized over streams (one Python step per
symbol position, never per stream).

Model: ``symbols [T, n]`` are T independent streams of n codes in ``[0, 2**bits)``; stream ``i``
uses the static frequency table ``table_of[i]`` (of ``n_tables``). A table's frequencies are the
symbol counts of all its streams, normalized to ``M = 2**P`` with ``P = min(12, bits + 4)`` (every
symbol that occurs gets at least 1, none gets M, so an entry fits P bits). A table whose streams
would not get shorter than fixed-width packing (table and length bytes included) is stored *raw*
(the streams bit-packed at ``bits`` bits), so the output never exceeds the fixed-width form by more
than its header (1 byte + 1 bit per table).

rANS (Duda 2013, "Asymmetric numeral systems"), 32-bit state kept in ``[L, 256 L)`` with
``L = 2**23``, byte-wise renormalization: encoding symbol ``s`` (frequency ``f``, cumulative ``c``)
first emits low bytes while ``x >= (L >> P << 8) * f`` (at most two), then
``x = (x // f) * M + x % f + c``; symbols are encoded last-to-first and every stream ends with its
4-byte final state. Bytes are stored in reverse emission order, so the decoder reads forward:
``slot = x % M``, ``s = symbol_of(slot)``, ``x = f * (x >> P) + slot - c``, then reads bytes
while ``x < L``. Decoding is bit-exact: ``decode(encode(s)) == s``.

Byte layout of ``encode``'s output (uint8, little-endian integers):

* 1 byte: width W (2 or 4) of the per-stream lengths;
* ``ceil(n_tables / 8)`` bytes: mode bit per table (1 = rANS, 0 = raw), ``np.packbits`` little order;
* the rANS tables' ``2**bits`` frequencies each, P bits per entry, bit-packed (a table sums to M);
* per stream of a rANS table (stream order), its byte length (uint W);
* the rANS streams' bytes (stream order), then the raw streams (stream order, ``ceil(n * bits / 8)``
  bytes each, bits little-endian).
"""

from __future__ import annotations

import numpy as np

__all__ = ["prob_bits", "encode", "decode", "raw_nbytes"]

L = 1 << 23


def prob_bits(bits: int) -> int:
    """Precision P of the frequency tables for ``bits``-bit symbols (tables sum to 2**P)."""
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


def _freqs(sym: np.ndarray, table_of: np.ndarray, n_tables: int, S: int, P: int) -> np.ndarray:
    """Counts per table normalized to sum M = 2**P with every entry < M (so it fits P bits) and every
    occurring symbol >= 1 (int64 [n_tables, S]); a table where that fails is a zero row (the caller
    stores such tables raw)."""
    M = 1 << P
    idx = table_of[:, None].astype(np.int64) * S + sym.astype(np.int64)
    cnt = np.bincount(idx.ravel(), minlength=n_tables * S).reshape(n_tables, S)
    tot = cnt.sum(-1, keepdims=True)
    f = (cnt * M) // np.maximum(tot, 1)
    f = np.where((cnt > 0) & (f == 0), 1, f)
    top = f.argmax(-1)
    f[np.arange(n_tables), top] += M - f.sum(-1)
    full = f[np.arange(n_tables), top] == M  # one symbol only: lend one slot to a neighbour
    other = (top + 1) % S
    f[np.nonzero(full)[0], top[full]] -= 1
    f[np.nonzero(full)[0], other[full]] += 1
    bad = (f < 0).any(-1) | ((cnt > 0) & (f < 1)).any(-1) | (f.sum(-1) != M)
    f[bad] = 0
    return f


def _rans_encode(sym: np.ndarray, F: np.ndarray, C: np.ndarray, tab: np.ndarray, P: int):
    """Encode streams ``sym [T, n]`` with per-stream tables; returns (bytes per stream in stream
    order concatenated, lengths [T])."""
    T, n = sym.shape
    M, unit = 1 << P, (L >> P) << 8
    x = np.full(T, L, dtype=np.int64)
    out = np.zeros((2 * n + 4, T), dtype=np.uint8)
    emit = np.zeros((2 * n + 4, T), dtype=bool)
    k = 0
    for t in range(n - 1, -1, -1):
        s = sym[:, t]
        f = F[tab, s]
        c = C[tab, s]
        x_max = unit * f
        for _ in range(2):
            m = x >= x_max
            out[k] = (x & 255).astype(np.uint8)
            emit[k] = m
            x = np.where(m, x >> 8, x)
            k += 1
        x = (x // f) * M + (x % f) + c
    for _ in range(4):
        out[k] = (x & 255).astype(np.uint8)
        emit[k] = True
        x = x >> 8
        k += 1
    o, e = out.T[:, ::-1], emit.T[:, ::-1]  # [T, K], reverse emission order
    return o[e], e.sum(-1)


def _rans_decode(buf: np.ndarray, starts: np.ndarray, T: int, n: int, F, C, sym_of, tab, P: int) -> np.ndarray:
    M = 1 << P
    pad = np.concatenate([buf, np.zeros(8, dtype=np.uint8)]).astype(np.int64)
    p = starts.astype(np.int64).copy()
    x = np.zeros(T, dtype=np.int64)
    for _ in range(4):
        x = (x << 8) | pad[p]
        p += 1
    res = np.empty((T, n), dtype=np.uint8)
    for t in range(n):
        slot = x & (M - 1)
        s = sym_of[tab, slot]
        res[:, t] = s
        x = F[tab, s] * (x >> P) + slot - C[tab, s]
        for _ in range(2):
            m = x < L
            x = np.where(m, (x << 8) | pad[p], x)
            p = p + m
    return res


def encode(symbols: np.ndarray, bits: int, table_of: np.ndarray, n_tables: int) -> np.ndarray:
    """Entropy-code ``symbols [T, n]`` (ints in ``[0, 2**bits)``), stream i with table ``table_of[i]``."""
    sym = np.ascontiguousarray(symbols, dtype=np.uint8)
    T, n = sym.shape
    S, P = 1 << bits, prob_bits(bits)
    tab_all = np.asarray(table_of, dtype=np.int64)
    F = _freqs(sym, tab_all, n_tables, S, P)
    C = np.concatenate([np.zeros((n_tables, 1), np.int64), np.cumsum(F, -1)[:, :-1]], -1)
    ok = F.sum(-1) == (1 << P)
    streams_r = np.nonzero(ok[tab_all])[0]
    if len(streams_r):
        data_r, lens = _rans_encode(sym[streams_r], F, C, tab_all[streams_r], P)
    else:
        data_r, lens = np.zeros(0, np.uint8), np.zeros(0, np.int64)
    W = 2 if lens.max(initial=0) < 65536 else 4
    # per table: rANS only where it beats raw (table and length bytes included)
    per_tab = np.bincount(tab_all[streams_r], weights=lens + W, minlength=n_tables)
    n_streams = np.bincount(tab_all, minlength=n_tables)
    use = ok & (per_tab + S * P / 8 < n_streams * raw_nbytes(n, bits))
    keep = use[tab_all[streams_r]]  # rANS streams that stay rANS
    parts = [np.array([W], np.uint8), np.packbits(use.astype(np.uint8), bitorder="little"),
             _pack_raw(F[use].reshape(1, -1), P).ravel() if use.any() else np.zeros(0, np.uint8),
             lens[keep].astype("<u2" if W == 2 else "<u4").view(np.uint8).ravel()]
    parts.append(data_r[np.repeat(keep, lens)] if len(data_r) else data_r)  # rANS streams, in order
    raw_streams = np.nonzero(~use[tab_all])[0]
    if len(raw_streams):  # then the raw ones, in order
        parts.append(_pack_raw(sym[raw_streams], bits).ravel())
    return np.concatenate(parts).astype(np.uint8)


def decode(buf: np.ndarray, T: int, n: int, bits: int, table_of: np.ndarray, n_tables: int) -> np.ndarray:
    """Inverse of ``encode``: the ``[T, n]`` uint8 codes."""
    buf = np.asarray(buf, dtype=np.uint8)
    S, P = 1 << bits, prob_bits(bits)
    M = 1 << P
    tab_all = np.asarray(table_of, dtype=np.int64)
    W = int(buf[0])
    p = 1
    nb = (n_tables + 7) // 8
    use = np.unpackbits(buf[p : p + nb], count=n_tables, bitorder="little").astype(bool)
    p += nb
    nu = int(use.sum())
    F = np.zeros((n_tables, S), np.int64)
    tb = (nu * S * P + 7) // 8
    if nu:
        F[use] = _unpack_raw(buf[p : p + tb], 1, nu * S, P, np.int64).reshape(nu, S)
    p += tb
    r_streams = np.nonzero(use[tab_all])[0]
    lens = buf[p : p + W * len(r_streams)].view("<u2" if W == 2 else "<u4").astype(np.int64)
    p += W * len(r_streams)
    out = np.empty((T, n), dtype=np.uint8)
    if len(r_streams):
        C = np.concatenate([np.zeros((n_tables, 1), np.int64), np.cumsum(F, -1)[:, :-1]], -1)
        Fu = F.copy()
        Fu[~use, 0] = M  # tables not used by rANS: any valid slot map
        sym_of = np.repeat(np.tile(np.arange(S, dtype=np.int64), n_tables), Fu.ravel()).reshape(n_tables, M)
        starts = p + np.concatenate([[0], np.cumsum(lens)[:-1]])
        out[r_streams] = _rans_decode(buf, starts, len(r_streams), n, F, C, sym_of, tab_all[r_streams], P)
        p += int(lens.sum())
    raw_streams = np.nonzero(~use[tab_all])[0]
    if len(raw_streams):
        rb = raw_nbytes(n, bits)
        out[raw_streams] = _unpack_raw(buf[p : p + rb * len(raw_streams)], len(raw_streams), n, bits)
    return out
