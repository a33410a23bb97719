"""The residual-window layout and the one-softmax attention over stored parts (family bases beside
``contract.py``): ``joint_attention`` (one softmax over groups of keys -- float16 sinks, quantized rows scored
on their codes, a float16 window, the call's rows -- used by every quantizer that attends on its compressed
form: the grouped layout, TurboQuant-RVQ, Waterfill and their batch forms) and ``ResidualWindowCache``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import mlx.core as mx

from . import kernels, native
from .attention import (bool_mask, cpu_cuts, dense_attention, dense_blocks, group_queries, on_cpu_streams,
                        online_softmax_attention, split_on_cpu_streams, tile_ranges, tile_rows, ungroup)
from .contract import CompressedKVCache
from .eviction import EvictionKVCache
from .primitives.buffers import dtype_name, fp16_row_bytes, grow_rows  # noqa: F401 (fp16_row_bytes re-exported)
from .primitives.fused import elementwise

QUANT_BLOCK = 32  # the window is compacted when it holds R + QUANT_BLOCK rows
SINK_ROWS = 4  # the stream's first tokens stay in float16 (attention sinks)


def concat_rows(pairs, dtype):
    """(K, V) of the ``(keys, values)`` pairs (None, (None, None) skipped) concatenated on the rows, in ``dtype``."""
    cast = lambda x: x if x.dtype == dtype else x.astype(dtype)  # noqa: E731
    pairs = [p for p in pairs if p is not None and p[0] is not None]
    if len(pairs) == 1:
        return cast(pairs[0][0]), cast(pairs[0][1])
    return tuple(mx.concatenate([cast(p[i]) for p in pairs], axis=2) for i in (0, 1))


class WindowCall(NamedTuple):
    """One call's keys in order: ``s0`` sink rows, ``q0`` quantized rows, the ``r0`` window rows stored before it
    (``past_k``/``past_v``) and its own rows."""

    s0: int
    q0: int
    r0: int
    past_k: Optional[mx.array]
    past_v: Optional[mx.array]
    new_k: mx.array
    new_v: mx.array


class Partials(NamedTuple):
    """A group of keys already reduced to an online softmax's partials (a CPU kernel's output): per query row the
    scores' max ``m`` and ``l = sum exp(s - m)`` [B, H, R], and ``acc = sum exp(s - m) v`` [B, H, R, Dv]."""

    m: mx.array
    l: mx.array  # noqa: E741
    acc: mx.array

    @staticmethod
    def empty(B: int, H: int, R: int, dv: int) -> "Partials":
        """The partials of no rows (m = -inf, l = 0, acc = 0): a step whose rows are all exact groups."""
        return Partials(mx.full((B, H, R), -mx.inf), mx.zeros((B, H, R)), mx.zeros((B, H, R, dv)))


def join_partials(parts: list) -> Partials:
    """One :class:`Partials` from several over disjoint rows: each sum rescaled to the largest maximum."""
    if len(parts) == 1:
        return parts[0]
    m = mx.stack([p.m for p in parts]).max(axis=0)
    ref = mx.where(m == -mx.inf, 0.0, m)  # rows that no part saw keep l = 0, acc = 0
    w = [mx.exp(p.m - ref) for p in parts]
    return Partials(m, sum(wi * p.l for wi, p in zip(w, parts)), sum(wi[..., None] * p.acc for wi, p in zip(w, parts)))


def attend_joint(queries, call: WindowCall, sink, quantized_part, *, scale, mask, sinks, n_keys: int, weights=False):
    """One softmax (``joint_attention``) over ``call``'s keys: the sink rows ``sink`` (K, V or None), ``call.q0``
    quantized rows (``quantized_part(q, n)`` -> (scores, value_fn), or :class:`Partials`: then ``mask`` must be None
    or a string), then the window before the call and the call's rows (exact rows scored as one group). A CPU kernel's
    one-row step (``Partials``) ends in ``native``'s ``joint_finish``: the same softmax in one primitive."""
    B, Hq, N, D = queries.shape
    H = call.new_k.shape[1]
    q = group_queries(queries, H).astype(mx.float32) * scale  # [B, H, rep, N, D]
    qf = q.reshape(B, H, -1, D)
    s0, q0 = call.s0, call.q0
    part = quantized_part(qf, q0) if q0 else None
    if isinstance(part, Partials) and N == 1 and not weights and isinstance(mask, (str, type(None))):
        # a CPU kernel's step: its exact rows, sinks and normalization in one primitive too (native/joint_finish_cpu)
        groups = [g for g in (sink, (call.past_k, call.past_v), (call.new_k, call.new_v)) if g and g[0] is not None]
        return finish_partials(queries, qf, part, groups, sinks)
    ek, ev = concat_rows((sink, (call.past_k, call.past_v), (call.new_k, call.new_v)), mx.float32)
    parts = [(part, None, ((s0, s0 + q0),)) if isinstance(part, Partials) else (*part, ((s0, s0 + q0),))] if q0 else []
    parts.append((qf @ ek.swapaxes(-1, -2), lambda p: p @ ev, ((0, s0), (s0 + q0, n_keys))))
    return joint_attention(q, parts, mask, sinks, n_keys, queries.dtype, weights=weights)


def finish_partials(queries, qf, part: Partials, groups: list, sinks, spans=None) -> mx.array:
    """A CPU kernel's one-row step ended in one primitive (``native``'s ``joint_finish``): its partials ``part`` for
    the scaled grouped queries ``qf`` [B, H, R, D], joined with the exact ``groups`` [(keys, values)] and the sinks;
    the output [B, Hq, 1, Dv] in ``queries``' dtype. ``spans`` (a batch form's): per group, per sequence, the (start,
    count) of its rows (its own mask's visibility, so no mask is applied), else every row of each group."""
    flat = [] if spans is None else [x for per_group in spans for pair in per_group for x in pair]
    return native.module().joint_finish(qf, part.m, part.l, part.acc, [k for k, _ in groups], [v for _, v in groups],
                                        [k.shape[2] for k, _ in groups], sinks, queries, spans=flat)


def scaled_rows(queries, H: int, scale) -> mx.array:
    """Queries [B, Hq, N, D] as float32 times ``scale``, grouped by KV head: [B, H, Hq // H * N, D]."""
    B, Hq, N, D = queries.shape
    return (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, Hq // H * N, D)


def batch_finish(queries, H: int, scale, part, groups: list, sinks) -> mx.array:
    """A batch form's one-row CPU step: ``part(qf)`` (a CPU kernel's :class:`Partials` over each sequence's own code
    slots, for the scaled grouped queries ``qf``), then ``groups`` [((keys, values), [(start, count) per sequence])]
    (groups without rows dropped), joined by ``finish_partials``."""
    qf = scaled_rows(queries, H, scale)
    groups = [(g, spans) for g, spans in groups if g[0] is not None and g[0].shape[2]]
    return finish_partials(queries, qf, part(qf), [g for g, _ in groups], sinks, [spans for _, spans in groups])


def split_rows_part(n: int, scores, values, finish=None):
    """A ``_quantized_part``'s ``(scores [B, H, R, n], value_fn)`` over quantized rows ``0 .. n`` from its range
    forms ``scores(a, b)`` and ``values(p, a, b)`` (``p`` the rows' probabilities), ``finish`` applied to the
    values' sum (a rotation back). On the CPU a long step's rows are decoded in ``cpu_cuts`` parts, each on its own
    stream: MLX runs a stream's ops on one thread, and these decodings (gathers, RoPE, codebooks) are elementwise
    passes that BLAS does not spread over the cores as it does the plain cache's matmuls."""
    fin = finish or (lambda x: x)
    cuts = cpu_cuts(n, n)
    if len(cuts) == 1:
        return scores(0, n), lambda p: fin(values(p, 0, n))
    s = mx.concatenate(on_cpu_streams([lambda a=a, b=b: scores(a, b) for a, b in cuts]), axis=-1)
    return s, lambda p: fin(split_on_cpu_streams([lambda a=a, b=b: values(p[..., a:b], a, b) for a, b in cuts]))


def attend_tiled(queries, call: WindowCall, sink, quantized_tiles, *, scale, mask, sinks, n_keys: int, block: int):
    """``call``'s attention as an online softmax over tiles of rows (``attention.online_softmax_attention``):
    the sinks, the quantized rows (``quantized_tiles(q, ranges)``), the window and the call's rows; tiles of
    ``tile_rows`` rows, so no [N, M] float32 array exists."""
    B, Hq, N, D = queries.shape
    H = call.new_k.shape[1]
    qf = scaled_rows(queries, H, scale)
    tile = tile_rows(B * Hq * N, n_keys, block)
    s0, q0 = call.s0, call.q0
    blocks = dense_blocks(qf, *sink, 0, tile) if s0 else []
    if q0:
        ranges = tile_ranges(0, q0, tile)
        blocks += [(s0 + a, s0 + b, sf, vf) for (a, b), (sf, vf) in zip(ranges, quantized_tiles(qf, ranges))]
    ek, ev = concat_rows(((call.past_k, call.past_v), (call.new_k, call.new_v)), call.new_k.dtype)
    blocks += dense_blocks(qf, ek, ev, s0 + q0, tile)
    return online_softmax_attention((B, H, Hq // H, N), blocks, n_keys, mask, sinks, queries.dtype)


_EXP_TAYLOR = tuple(1.0 / math.factorial(i) for i in range(8))  # e^r to 5e-9 on |r| <= ln(2) / 2
_LN2_HI, _LN2_LO = 0.693145751953125, 1.42860682030941723212e-6  # ln 2 = HI + LO, HI exact in 16 bits


@elementwise
def _exp_scale(x):
    """``x`` clamped at the smallest exponent, ``k = round(x / ln 2)`` and ``r = x - k ln 2`` (Cody-Waite)."""
    x = mx.maximum(x, -127 * _LN2_HI)
    k = (x * (1 / math.log(2)) - 0.5).astype(mx.int32)  # round half up, for x <= 0
    kf = k.astype(mx.float32)
    return (x - kf * _LN2_HI) - kf * _LN2_LO, (k + 127) << 23


@elementwise
def _exp_poly(r, scale):
    p = _EXP_TAYLOR[-1]
    for c in _EXP_TAYLOR[-2::-1]:
        p = p * r + c
    return p * scale


def softmax_exp(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 softmax arguments ``x <= 0`` (``-inf`` -> 0, below ``-87.3`` 0 or a denormal):
    ``2^k e^r``, ``|r| <= ln(2) / 2``, a degree-7 polynomial, the exponent written into the float's bits; relative
    error ~2e-7. Two fused kernels: MLX's CPU ``exp`` (one libm call per element) is ~6x slower, and dominates
    the softmax of a long decode step."""
    r, bits = _exp_scale(x)
    return _exp_poly(r, mx.view(bits, mx.float32))


def joint_attention(q, parts, mask, sinks, n_keys: int, out_dtype, weights: bool = False):
    """One softmax over several groups of keys. ``q`` [B, H, rep, N, D] (scaled, float32); ``parts``:
    ``(scores [B, H, rep*N, M_i], value_fn, cols)``, ``value_fn(p)`` -> [B, H, rep*N, Dv], ``cols`` the (start,
    stop) ranges of the ``n_keys`` key axis that the part's keys are; the last part ends with the call's ``N``
    rows (the only keys "causal" hides). ``mask``: mlx_lm's; ``sinks``: [Hq] logits or None. Returns [B, Hq, N,
    Dv]; with ``weights`` also each part's probability mass per key summed over the queries, [B, H, M_i]
    (zipcache's saliency; ``(1 / denom) @ p``: no normalized [N, M_i] copy). A part whose scores are
    :class:`Partials` joins through its partials (a string or no ``mask`` only; ``weights`` then lists the other
    parts' masses alone)."""
    B, H, rep, N, _ = q.shape
    reduced = [p for p, _, _ in parts if isinstance(p, Partials)]
    parts = [p for p in parts if not isinstance(p[0], Partials)]
    if reduced and not isinstance(mask, (str, type(None))):
        raise ValueError("a Partials part takes no array mask")
    scores = [s.reshape(B, H, rep, N, s.shape[-1]) for s, _, _ in parts]
    if isinstance(mask, str):
        if N > 1:  # bottom-right aligned over the last part: its last N columns are the new rows
            m = scores[-1].shape[-1]
            allowed = mx.arange(m)[None] <= (m - N + mx.arange(N))[:, None]
            scores[-1] = mx.where(allowed, scores[-1], -mx.inf)
    elif mask is not None:
        full = bool_mask(mask, N, n_keys, H)
        for i, (_, _, cols) in enumerate(parts):
            pieces = [full[..., a:b] for a, b in cols if b > a]
            m = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
            scores[i] = mx.where(m, scores[i], -mx.inf)
    sink = [] if sinks is None else [sinks.astype(mx.float32).reshape(1, H, rep, 1, 1)]
    ms = [r.m.reshape(B, H, rep, N, 1) for r in reduced]
    peak = functools.reduce(mx.maximum, [s.max(axis=-1, keepdims=True) for s in scores] + sink + ms)
    probs = [softmax_exp(s - peak) for s in scores]
    scaled = [mx.exp(m - peak) for m in ms]  # each reduced part's exp(m - peak)
    denom = functools.reduce(mx.add, [p.sum(axis=-1, keepdims=True) for p in probs] + [mx.exp(t - peak) for t in sink]
                             + [w * r.l.reshape(w.shape) for w, r in zip(scaled, reduced)])
    out = functools.reduce(mx.add, [fn(p.reshape(B, H, rep * N, p.shape[-1])) for p, (_, fn, _) in zip(probs, parts)]
                           + [w.reshape(B, H, rep * N, 1) * r.acc for w, r in zip(scaled, reduced)])
    out = ungroup(out.reshape(B, H, rep, N, out.shape[-1]) / denom).astype(out_dtype)
    if not weights:
        return out
    inv = (1.0 / denom).swapaxes(-1, -2)  # [B, H, rep, 1, N]
    return out, [(inv @ p).sum(axis=(2, 3)) for p in probs]


class ResidualWindowCache(CompressedKVCache):
    """Float16 sink rows + quantized blocks + a float16 window of the newest rows, attended with one softmax.

    Rows in position order: ``n_sink`` sinks (the stream's first ``SINK_ROWS`` tokens), ``n_quant`` quantized,
    ``n_win`` window rows. When the window holds ``residual_length + quant_block`` rows its oldest whole blocks
    beyond ``residual_length`` leave it (sinks first). ``update_and_fetch`` returns the stored rows (stored form)
    then the call's; ``attend`` computes the same attention on the quantized form (a prefill chunk: over the decoded
    rows in tiles of query rows, ``_attend_chunk``). Subclasses implement
    ``_append_quantized(keys, values)`` (store rows after the ``n_quant`` ones), ``_quantized_dense(n, dtype)``
    (float32 (K, V) of the first n; a kernel may give them in ``dtype``) and ``_quantized_part(q, n)``
    ((scores [B, H, R, n], value_fn) of the first n quantized rows, for a decode step's one softmax)."""

    window_fields = ("win_k", "win_v")
    sink_fields = ("sink_k", "sink_v")
    residual_length = 128
    quant_block = QUANT_BLOCK  # rows leave the window in whole blocks of this many
    n_sink = 0  # float16 sink rows (the stream's first tokens)
    n_quant = 0  # rows in quantized storage
    n_win = 0  # rows in the float16 window
    dtype_name = "float32"  # dtype of the rows last handed to the cache (dense outputs use it)
    _call: Optional[WindowCall] = None
    # a first chunk is attended exactly on its own rows (``attend``): it decodes nothing, need not wait (RESULTS.md)
    first_chunk_waits = False

    def _quantized_part(self, q: mx.array, n: int):
        """(scores [B, H, R, n], value_fn) of the first ``n`` quantized rows for scaled float32 queries ``q``."""
        raise NotImplementedError

    storage_dtype = EvictionKVCache.storage_dtype  # window/sink rows: the eviction caches' 16-bit rule

    def _store(self, keys, values):
        self.dtype_name = dtype_name(keys.dtype)
        r0 = self.n_win
        past = (self.win_k[:, :, :r0], self.win_v[:, :, :r0]) if r0 else (None, None)
        self._call = WindowCall(self.n_sink, self.n_quant, r0, *past, keys, values)
        sd = self.storage_dtype(keys.dtype)
        self.win_k = grow_rows(self.win_k, r0, keys.astype(sd))
        self.win_v = grow_rows(self.win_v, r0, values.astype(sd))
        self.n_win = r0 + keys.shape[2]
        self._compact_blocks()

    def _compact_blocks(self) -> None:
        """Compact the window's oldest whole blocks beyond the newest ``residual_length`` rows: whole blocks, so
        which rows leave depends on positions, not on how rows were split into calls (``chunk_invariant``)."""
        block, R = self.quant_block, self.residual_length
        if self.n_win >= R + block:
            self._compact((self.n_win - R) // block * block)

    def _compact(self, n: int) -> None:
        """Move the ``n`` oldest window rows out (sinks first, then codes); the rest start a window buffer of
        ``residual_length + quant_block`` rows (never more between calls)."""
        kernels._common.RowsMemo.forget(self)
        w = self.n_win
        k, v = self.win_k[:, :, :n], self.win_v[:, :, :n]
        s = min(SINK_ROWS - self.n_sink, n) if self.n_quant == 0 else 0
        if s > 0:  # a buffer of exactly SINK_ROWS rows
            if self.sink_k is None or self.sink_k.shape[2] < SINK_ROWS:
                kept = slice(0, self.n_sink if self.sink_k is not None else 0)
                self.sink_k = self._fresh(k, SINK_ROWS, (self.sink_k if self.sink_k is not None else k)[:, :, kept])
                self.sink_v = self._fresh(v, SINK_ROWS, (self.sink_v if self.sink_v is not None else v)[:, :, kept])
            # copies: a slice assignment that fills the whole buffer hands back its source, here a view
            # that would keep the whole (prompt-sized) window buffer alive behind 4 rows
            self.sink_k[:, :, self.n_sink : self.n_sink + s] = mx.contiguous(k[:, :, :s])
            self.sink_v[:, :, self.n_sink : self.n_sink + s] = mx.contiguous(v[:, :, :s])
            self.n_sink += s
        if n > s:
            self._append_quantized(k[:, :, s:], v[:, :, s:])
            self.n_quant += n - s
        cap = self.residual_length + self.quant_block
        self.win_k, self.win_v = (self._fresh(a, cap, a[:, :, n:w]) for a in (self.win_k, self.win_v))
        self.n_win = w - n

    @staticmethod
    def _fresh(like: mx.array, capacity: int, rows: mx.array) -> mx.array:
        """A buffer of ``capacity`` rows shaped like ``like``, starting with ``rows``."""
        buf = mx.zeros((*like.shape[:2], capacity, like.shape[3]), dtype=like.dtype)
        if rows.shape[2]:
            buf[:, :, : rows.shape[2]] = rows
        return buf

    def _rows(self, s0, q0, past_k, past_v, new_k=None, new_v=None, dtype=mx.float32):
        return concat_rows((self._sinks(s0), self._quantized_dense(q0, dtype) if q0 else None, (past_k, past_v),
                            (new_k, new_v)), dtype)

    def _dense(self):
        r = self.n_win
        win = (self.win_k[:, :, :r], self.win_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_sink, self.n_quant, *win, dtype=getattr(mx, self.dtype_name))

    def _fetched(self, dtype):
        c = self._call
        return self._rows(c.s0, c.q0, c.past_k, c.past_v, c.new_k, c.new_v, dtype=dtype)

    def _short_steps(self) -> bool:
        """Whether a decode row compacting nothing may skip ``_store`` (a subclass adding to it answers for that)."""
        return type(self)._store is ResidualWindowCache._store

    def _step_fits(self, step) -> bool:
        """A repeated checked one-row call (``_repeats_checked_step``) that compacts nothing and fits the window
        buffer: ``_decode_step`` takes it."""
        r = self.n_win + 1
        return (r < self.residual_length + self.quant_block and self.win_k is not None and r <= self.win_k.shape[2]
                and self._repeats_checked_step(step) and self._short_steps())

    def _decode_step(self, keys, values):
        """``update_and_fetch`` of a decode row that compacts nothing: what ``_check_input`` and ``_store`` do for
        it without their general cases."""
        r0, wk, wv = self.n_win, self.win_k, self.win_v
        past_k, past_v = (wk[:, :, :r0], wv[:, :, :r0]) if r0 else (None, None)
        c = self._call = WindowCall(self.n_sink, self.n_quant, r0, past_k, past_v, keys, values)
        sd = wk.dtype
        wk[:, :, r0 : r0 + 1] = keys if keys.dtype == sd else keys.astype(sd)
        wv[:, :, r0 : r0 + 1] = values if values.dtype == sd else values.astype(sd)
        self.n_win = r0 + 1
        self.offset += 1
        return self._rows(c.s0, c.q0, past_k, past_v, keys, values, dtype=keys.dtype)

    def stored_rows(self) -> int:
        return self.n_sink + self.n_quant + self.n_win

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        n = queries.shape[2]
        if call is None or call.new_k.shape[2] != n or keys.shape[2] != call.s0 + call.q0 + call.r0 + n:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        mask = self._own_mask(mask, queries, keys)
        if call.s0 + call.q0 + call.r0 == 0:  # nothing stored before this call: exact attention
            return dense_attention(queries, call.new_k, call.new_v, scale=scale, mask=mask, sinks=sinks)
        if n > 1:  # a prefill chunk (a decode step, however long, is one tile: faster on the CPU, RESULTS.md)
            return self._attend_chunk(queries, keys, values, call, scale=scale, mask=mask, sinks=sinks)
        return attend_joint(queries, call, self._sinks(call.s0), self._quantized_part, scale=scale, mask=mask,
                            sinks=sinks, n_keys=keys.shape[2])

    def _sinks(self, s0: int):
        return (self.sink_k[:, :, :s0], self.sink_v[:, :, :s0]) if s0 else None

    def _attend_chunk(self, queries, keys, values, call: WindowCall, *, scale, mask, sinks):
        """A prefill chunk without any prompt-sized float32 score array: ``dense_attention`` over the rows
        ``update_and_fetch`` returned (the quantized past decoded once per layer, lazily): MLX's fused attention,
        on the CPU in tiles of query rows queued one by one. Measured against an online softmax over tiles of the
        codes (``attend_tiled``, the path until session 32): SmolLM2, 2048 tokens in chunks of 1024, turboquant_rvq
        peak 0.52x -> 0.32x the plain cache's, time 1.32x -> 1.16x; waterfill-4 0.53x -> 0.39x, 1.13x -> 0.90x."""
        return dense_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _one_row_over_codes(self, queries, keys, mask) -> bool:
        """A call the decode kernels take: one query row and one new row over quantized rows and the float16 sinks,
        the keys ``update_and_fetch`` returned, a string or no mask."""
        call = self._call
        return (queries.shape[2] == 1 and call is not None and call.q0 > 0 and call.s0 > 0 and call.new_k.shape[2] == 1
                and isinstance(mask, (str, type(None))) and keys.shape[2] == call.s0 + call.q0 + call.r0 + 1)

    def _attend_part(self, queries, keys, part, *, scale, mask, sinks=None):
        """A call ``_one_row_over_codes`` accepts, its quantized rows attended by ``part(q, n)`` (a CPU kernel's
        :class:`Partials`), the rest as ``attend`` does."""
        call, self._call = self._call, None
        return attend_joint(queries, call, self._sinks(call.s0), part, scale=scale, mask=mask, sinks=sinks,
                            n_keys=keys.shape[2])

    def _memo_rows(self, n: int, buf, build):
        """``build()``, the first ``n`` quantized rows' dense lazy graph, reused between decode steps that go to a
        kernel (their attention never evaluates it: rebuilding it is host time; ``kernels._common.RowsMemo``); cleared
        whenever the quantized rows change (compaction, trim, state)."""
        keep = kernels.keeps_rows(self, self._call.new_k.shape[2] if self._call else 0)
        return kernels._common.RowsMemo.of(self).fetch(n, buf, build, keep)

    def _check_trim_rows(self, n: int) -> None:
        """No more than the stored rows."""
        self._check_stored(n, self.stored_rows())

    def _trim_rows(self, n: int) -> int:
        """Window rows are dropped exactly; beyond the window the newest codes, then sink rows."""
        kernels._common.RowsMemo.forget(self)
        w = min(n, self.n_win)
        q = min(n - w, self.n_quant)
        self.n_win -= w
        self.n_quant -= q
        self.n_sink -= n - w - q
        return n

    counts_constants = True  # this cache's nbytes includes the process-wide constants it uses

    @staticmethod
    def constants_key(c):
        """The config fields the shared constants (rotations, codebooks) depend on."""
        return None

    @classmethod
    def build_layers(cls, configs):
        """One cache per layer; the first of each ``constants_key`` counts the shared constants in ``nbytes``."""
        caches, seen = [cls(c) for c in configs], set()
        for cache, c in zip(caches, configs):
            key = cls.constants_key(c)
            cache.counts_constants = key not in seen
            seen.add(key)
        return caches

    _shared: tuple = ()  # attributes a deepcopy shares (rotations, codebooks, tables), not copies

    def __deepcopy__(self, memo):
        for name in self._shared:
            v = self.__dict__.get(name)
            if v is not None:
                memo[id(v)] = v  # deepcopy returns a memoised object as it is
        return CompressedKVCache.__deepcopy__(self, memo)  # (the batch forms borrow this method)

    def _dims(self, head_dim=None, value_dim=None) -> tuple[int, int]:
        """(key, value) head dims: the given ones, else those seen, else ``config.head_dim``."""
        shape = getattr(self, "_shape", None)
        d = head_dim or (shape[1] if shape else self.config.head_dim)
        return d, value_dim or (shape[2] if shape else d)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the used rows of every array (``_used`` None: all of it; no spare capacity, no constants)."""
        return sum(a[:, :, : self._used(n)].nbytes for n in self.array_fields if (a := getattr(self, n)) is not None)

    full_seq_bytes = property(lambda self: fp16_row_bytes(self.win_k, self.win_v, self.offset))

    def _used(self, name: str) -> int:
        if name in self.window_fields:
            return self.n_win
        return self.n_sink if name in self.sink_fields else self.n_quant

    @property
    def state(self):
        out = CompressedKVCache.state.fget(self)
        out.update({n: a[:, :, : self._used(n)] for n in self.array_fields if (a := out.get(n)) is not None})
        return out

    @state.setter
    def state(self, v):
        kernels._common.RowsMemo.forget(self)
        CompressedKVCache.state.fset(self, v)
