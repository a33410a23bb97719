"""The batch form of the TurboQuant-RVQ cache (the default method): several requests decoded together
by mlx_lm's ``BatchGenerator`` (continuous batching), each keeping exactly the compressed state it
would hold alone.

``TurboQuantRVQKVCache.merge(caches)`` builds a ``TurboQuantRVQBatchKVCache`` (only when every cache
is exactly a ``TurboQuantRVQKVCache`` with the same quantizer settings); ``extract(i)`` gives back an
ordinary ``TurboQuantRVQKVCache`` with the same sink rows, codes, norms and window rows as an
unbatched run.

Layout (B sequences, H kv heads, D / Dv head dims, R = ``residual_length``, QB = ``QUANT_BLOCK``).
Each sequence keeps the single cache's three regions, in position order:

* float16 sink rows, left-aligned: ``sink_k [B, H, SINK_ROWS, D]`` (``sink_v`` likewise); sequence
  i's ``ns[i]`` rows are its first columns.
* codes, left-aligned: ``k_codes1``/``k_codes2`` (packed uint32 words), ``k_norms`` (float16) and the
  same for values, ``[B, H, cap, .]``; sequence i's ``nq[i]`` quantized tokens fill slots
  ``[0, nq[i])``, slots ``>= nq[i]`` are invalid for it (masked; they may hold leftovers, always
  finite). ``cap`` grows in steps.
* float16 window, right-aligned: ``win_k [B, H, W, D]`` with ``W = max(nw)``; sequence i's ``nw[i]``
  rows are the last columns. A call appends its valid rows; a sequence whose window then holds
  ``R + QB`` rows or more flushes its oldest whole blocks beyond the newest R, exactly as the single
  cache does (the stream's first ``SINK_ROWS`` tokens to the sink rows, the others encoded): one
  gather over the batch, one ``_Quantizer.encode`` and one ``put_along_axis`` scatter into slots
  ``nq[i] ..`` (sequences that flush fewer rows write throw-away codes into their own invalid slots);
  the region's common invalid prefix is then sliced off.

All per-sequence counts (``ns``, ``nq``, ``nw``, ``lens``) are host-side Python ints derived from the
call sizes and ``prepare``'s lengths (``batch_common.RaggedBatchCache``): the decode path never
syncs with the device and nothing loops over tokens, heads or sequences per step (``merge`` /
``extract`` / ``extend`` / ``filter`` loop over the sequences once per request).

``update_and_fetch`` returns [sink rows (max(ns)), dequantized codes (max(nq)), window (W), new rows
(N)] and ``make_mask`` the boolean mask [B, 1, N, M] that shows each sequence its own rows and the new
rows causally; ``attend`` (dispatch point) computes the same attention on the codes with the single
cache's helpers (``_quantized_part``: LUT scores for decode-sized calls, rotated-domain value sums;
``joint_attention``: one softmax over the quantized and the float16 parts), the mask hiding the
invalid slots. As alone, a call's own rows are attended as given and rows flushed during a call are
still seen in float16 by it. Right-padded batched prefill (``prepare(lengths=, right_padding=)``): only
each sequence's first ``lengths[i]`` rows of a call are stored. ``offset`` is an ``mx.array`` of the
sequences' positions.

``nbytes`` = the arrays held (codes and norms with the buffers' spare slots, the float16 sink rows and
window) plus, for the first layer of a model, the shared rotation and codebooks (``counts_constants``,
as the single caches it was merged from); no dense copy of the quantized rows is kept. ``trim(n)``
drops the n newest tokens of every sequence as the single cache does (window rows, then codes, then
sink rows); it raises ``ValueError`` if a sequence holds fewer than n tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ...attention import bool_mask, group_queries
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives.bitpack import packed_words
from ..batch_common import RaggedBatchCache, borrows, grow_slots, keep_right, rows_ending_at, rows_from, visible_mask
from ...primitives.rvq import split_bits
from ...window import QUANT_BLOCK, SINK_ROWS, joint_attention
from .turboquant_rvq import TurboQuantRVQKVCache

_CODE_FIELDS = ("k_codes1", "k_codes2", "k_norms", "v_codes1", "v_codes2", "v_norms")
_ROW_FIELDS = ("win_k", "win_v", "sink_k", "sink_v")


class _BatchCall(NamedTuple):
    """What one ``update_and_fetch`` call attends over: the counts and regions stored before it."""

    ns: list
    nq: list
    nw: list
    sink_k: mx.array  # [B, H, max(ns), D]
    sink_v: mx.array
    past_k: mx.array  # window before the call, [B, H, W0, D]
    past_v: mx.array
    new_k: mx.array
    new_v: mx.array

    @property
    def widths(self):
        return max(self.ns, default=0), max(self.nq, default=0), self.past_k.shape[2]


def _settings(c) -> tuple:
    return (c.residual_length, c.key_sub_dim, c.value_sub_dim, c.key_bits, c.value_bits, c.seed)


@register_with_mlx_lm
@borrows(TurboQuantRVQKVCache, "_init_layout", "_quantizers", "_qs", "_planes", "_quantized_dense", "_quantized_part",
         "_lut_scores", "constant_nbytes", "storage_dtype", "__deepcopy__")  # rows past a sequence's count are masked
class TurboQuantRVQBatchKVCache(RaggedBatchCache):
    """TurboQuant-RVQ's compressed form for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "turboquant_rvq"
    array_fields = TurboQuantRVQKVCache.array_fields  # narrowed by _init_layout (no stage-2 planes if B <= 8)
    count_fields = ("ns", "nq", "nw", "lens")  # sink rows, quantized tokens, window rows, tokens held
    right_fields, right_count = ("win_k", "win_v"), "nw"  # the float16 window, right-aligned
    state_scalars = ("cap", "dtype_name", "counts_constants")
    quant_block = QUANT_BLOCK  # rows leave a window in whole blocks of this many
    chunk_invariant = True  # as the single cache: per-sequence blocks at the same positions
    exact_trim = False  # as the single cache

    dtype_name = "float32"
    counts_constants = True
    _shared = TurboQuantRVQKVCache._shared


    def __init__(self, config, batch_size: int = 0):
        super().__init__(config)
        self.cap = 0  # code slots allocated
        self._init_counts(batch_size)

    # ---------------------------------------------------------------- bookkeeping
    @property
    def W(self) -> int:
        return self.right_width

    def size(self) -> int:
        return max(self.ns, default=0) + max(self.nq, default=0) + self.W

    def _settings(self) -> tuple:
        return _settings(self)

    # ---------------------------------------------------------------- allocation
    def _code_widths(self) -> dict:
        """Trailing shape of each code field (packed words per token; norms have none)."""
        kq, vq = self._qs()
        out = {}
        for prefix, qz in (("k_", kq), ("v_", vq)):
            b1, b2 = split_bits(qz.bits)
            out[prefix + "codes1"] = (packed_words(qz.cb.n_sub, b1),)
            if b2:
                out[prefix + "codes2"] = (packed_words(qz.cb.n_sub, b2),)
            out[prefix + "norms"] = ()
        return out

    def _region_dtype(self, compute_dtype):
        return self.storage_dtype(compute_dtype)

    def _alloc(self, B, dtype, cap=0, W=0) -> dict:
        """Zero arrays for B sequences: ``cap`` code slots, ``W`` window columns, the sink rows."""
        H, D, Dv = self._shape
        out = {name: mx.zeros((B, H, cap, *tail), dtype=mx.float16 if name.endswith("norms") else mx.uint32)
               for name, tail in self._code_widths().items()}
        for name, rows, d in (("win_k", W, D), ("win_v", W, Dv), ("sink_k", SINK_ROWS, D), ("sink_v", SINK_ROWS, Dv)):
            out[name] = mx.zeros((B, H, rows, d), dtype=dtype)
        return out

    def _slot_fields(self) -> dict:
        return {name: (2, 1) for name in self._code_widths()}  # one code row per slot

    # ---------------------------------------------------------------- batch protocol
    @classmethod
    def from_caches(cls, caches) -> "TurboQuantRVQBatchKVCache":
        """Batch of single ``TurboQuantRVQKVCache``s (empty or holding tokens: prompt-cache reuse)."""
        first = caches[0]
        cls._check_mergeable(caches, _settings, "settings (residual length, sub-vector dims, bits, seed)")
        held = [c for c in caches if c.win_k is not None]
        shapes = {tuple(c._shape) for c in held}
        dtypes = {c.win_k.dtype for c in held}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise BatchingNotSupported(
                f"turboquant_rvq caches with different head shapes / storage dtypes cannot share a batch: "
                f"{shapes}, {dtypes}")
        out = cls(first.config, len(caches))
        out.counts_constants = first.counts_constants
        if not held:
            return out  # nothing stored yet: buffers are allocated by the first update
        out._shape = shapes.pop()
        out.dtype_name = held[0].dtype_name
        out._quantizers(out._shape[1], out._shape[2])
        out.ns = [c.n_sink for c in caches]
        out.nq = [c.n_quant for c in caches]
        out.nw = [c.n_win for c in caches]
        out.lens = [c.offset for c in caches]
        out.cap, W = max(out.nq), max(out.nw)
        dtype = dtypes.pop()
        ones = []
        for c, s, q, w in zip(caches, out.ns, out.nq, out.nw):  # once per request, not per step
            one = out._alloc(1, dtype, out.cap, W)
            if c.win_k is not None:
                for name in out._code_widths():
                    if q:
                        one[name][:, :, :q] = getattr(c, name)[:, :, :q]
                for name in ("sink_k", "sink_v"):
                    if s:
                        one[name][:, :, :s] = getattr(c, name)[:, :, :s]
                for name in ("win_k", "win_v"):
                    if w:
                        one[name][:, :, W - w:] = getattr(c, name)[:, :, :w]
            ones.append(one)
        return out._stack(ones)

    def extract(self, idx: int) -> TurboQuantRVQKVCache:
        """Sequence ``idx`` as an ordinary ``TurboQuantRVQKVCache`` (the same state it would hold alone)."""
        idx = int(idx)
        c = TurboQuantRVQKVCache(self.config)
        c.counts_constants = self.counts_constants
        c.offset = self.lens[idx]
        if self.win_k is None:
            return c
        s, q, w = self.ns[idx], self.nq[idx], self.nw[idx]
        c._shape, c.dtype_name = self._shape, self.dtype_name
        c._kq, c._vq = self._kq, self._vq
        c.n_sink, c.n_quant, c.n_win = s, q, w
        one = slice(idx, idx + 1)
        if q:
            for name in self._code_widths():
                setattr(c, name, mx.contiguous(getattr(self, name)[one, :, :q]))
        if s:
            c.sink_k, c.sink_v = mx.contiguous(self.sink_k[one]), mx.contiguous(self.sink_v[one])
        cap, W = w, self.W  # the window's rows only: the single cache grows it when rows arrive
        for name in ("win_k", "win_v"):
            rows = getattr(self, name)[one, :, W - w:]
            setattr(c, name, mx.concatenate(
                [rows, mx.zeros((1, *rows.shape[1:2], cap - w, rows.shape[3]), dtype=rows.dtype)], axis=2))
        return c

    # ---------------------------------------------------------------- masks
    @staticmethod
    def _visible(N: int, ns, nq, nw, W: int) -> mx.array:
        """Boolean [B, 1, N, max(ns) + max(nq) + W + N]: per sequence, its sink rows, its code slots,
        its window rows, and the new rows causally."""
        return visible_mask(N, len(ns), [(max(ns, default=0), ns, "left"), (max(nq, default=0), nq, "left"),
                                         (W, nw, "right")])

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("TurboQuantRVQBatchKVCache has no sliding-window mask")
        if self.size() == 0 and not return_array:
            return None if N == 1 else "causal"
        return self._visible(N, self.ns, self.nq, self.nw, self.W)

    # ---------------------------------------------------------------- storage
    def _rows(self, S0, qw, sink_k, sink_v, win_k, win_v, dtype, new_k=None, new_v=None):
        """Dense rows in key order: sink rows, dequantized code slots, window, the call's rows."""
        ks, vs = [], []
        if S0:
            ks.append(sink_k[:, :, :S0])
            vs.append(sink_v[:, :, :S0])
        if qw:
            k, v = self._quantized_dense(qw)
            ks.append(k)
            vs.append(v)
        for k, v in ((win_k, win_v), (new_k, new_v)):
            if k is not None and k.shape[2]:
                ks.append(k)
                vs.append(v)
        if not ks:
            return None, None
        return (mx.concatenate([k.astype(dtype) for k in ks], axis=2),
                mx.concatenate([v.astype(dtype) for v in vs], axis=2))

    def _dense(self):
        return self._rows(max(self.ns, default=0), max(self.nq, default=0), self.sink_k, self.sink_v,
                          self.win_k, self.win_v, getattr(mx, self.dtype_name))

    def update_and_fetch(self, keys, values):
        self._check_input(keys, values)
        self._quantizers(keys.shape[-1], values.shape[-1])  # constants (and dim checks) up front
        valid = self._begin_call(keys, values)
        S0 = max(self.ns, default=0)
        call = _BatchCall(list(self.ns), list(self.nq), list(self.nw), self.sink_k[:, :, :S0],
                          self.sink_v[:, :, :S0], self.win_k, self.win_v, keys, values)
        self._call = call
        self._store(keys, values, valid)
        # stored slots < the pre-call counts are unchanged by _store; the others are masked
        return self._rows(S0, max(call.nq, default=0), call.sink_k, call.sink_v, call.past_k, call.past_v,
                          keys.dtype, keys, values)

    def _store(self, keys, values, valid):
        N = keys.shape[2]
        W0 = self.W
        sd = self.win_k.dtype
        fk = mx.concatenate([self.win_k, keys.astype(sd)], axis=2)  # [B, H, W0 + N, D]
        fv = mx.concatenate([self.win_v, values.astype(sd)], axis=2)
        nw1 = [w + v for w, v in zip(self.nw, valid)]
        ends = [W0 + v for v in valid]  # one past each sequence's last valid column
        start = [e - w for e, w in zip(ends, nw1)]  # its first window column
        flush = self._flush_counts(nw1)
        sink = [min(SINK_ROWS - s, f) if q == 0 else 0 for s, q, f in zip(self.ns, self.nq, flush)]
        if any(sink):  # the stream's first tokens: sink slots ns[i] .. ns[i] + sink[i]
            j = mx.arange(SINK_ROWS, dtype=mx.int32)[None]
            ns, n_in = mx.array(self.ns, dtype=mx.int32)[:, None], mx.array(sink, dtype=mx.int32)[:, None]
            src = mx.clip(mx.array(start, dtype=mx.int32)[:, None] + j - ns, 0, fk.shape[2] - 1)[:, None, :, None]
            take = ((j >= ns) & (j < ns + n_in))[:, None, :, None]
            self.sink_k = mx.where(take, mx.take_along_axis(fk, src, axis=2), self.sink_k)
            self.sink_v = mx.where(take, mx.take_along_axis(fv, src, axis=2), self.sink_v)
        add = [f - s for f, s in zip(flush, sink)]
        K = max(add, default=0)
        if K:  # encode each sequence's flushed rows into its next code slots
            need = max(q + K for q in self.nq)
            self._set_capacity(need if N > 1 else grow_slots(self.cap, need))  # decode: grow in steps
            first = [st + s for st, s in zip(start, sink)]
            self._put_codes(rows_from(fk, first, K), rows_from(fv, first, K), K)
            self.nq = [q + a for q, a in zip(self.nq, add)]
        self.ns = [s + n for s, n in zip(self.ns, sink)]
        self.nw = [w - f for w, f in zip(nw1, flush)]
        W = max(self.nw, default=0)
        # decode: a view of the shared columns; ragged ends or a long call: a fresh array
        self.win_k = rows_ending_at(fk, ends, W, view=N < self.quant_block)
        self.win_v = rows_ending_at(fv, ends, W, view=N < self.quant_block)
        self.lens = [n + v for n, v in zip(self.lens, valid)]
        self._sync_offset()

    def _flush_counts(self, nw) -> list:
        """Rows each window of ``nw`` rows flushes, as the single cache: whole blocks beyond the newest R
        rows, once it holds R + ``quant_block``."""
        R, QB = self.residual_length, self.quant_block
        return [(w - R) // QB * QB if w >= R + QB else 0 for w in nw]

    def _put_codes(self, kb, vb, K):
        """Encode K rows per sequence (kb/vb [B, H, K, D]) into slots nq[i] .. nq[i] + K - 1."""
        kq, vq = self._qs()
        slots = mx.array(self.nq, dtype=mx.int32)[:, None] + mx.arange(K, dtype=mx.int32)[None]  # [B, K]
        for prefix, qz, x in (("k_", kq, kb), ("v_", vq, vb)):
            p1, p2, norms = qz.encode(x)
            for name, rows in (("codes1", p1), ("codes2", p2), ("norms", norms)):
                if rows is None:
                    continue
                idx = slots[:, None, :] if rows.ndim == 3 else slots[:, None, :, None]
                setattr(self, prefix + name, mx.put_along_axis(getattr(self, prefix + name), idx, rows, axis=2))

    # ---------------------------------------------------------------- attention on the codes
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call.new_k.shape[2] != N:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        S0, qw, W0 = call.widths
        n_keys = S0 + qw + W0 + N
        if keys.shape[2] != n_keys:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if n_keys == N:  # nothing stored before this call: plain (causal) attention over the new rows
            return mx.fast.scaled_dot_product_attention(queries, call.new_k, call.new_v, scale=scale,
                                                        mask="causal" if N > 1 else None, sinks=sinks)
        B, Hq, _, D = queries.shape
        H = call.new_k.shape[1]
        q = group_queries(queries, H).astype(mx.float32) * scale  # [B, H, rep, N, D]
        qf = q.reshape(B, H, -1, D)
        # exact rows (float16 sink rows and window, the call's own rows) as one group, in key order
        ks = [a for a in (call.sink_k, call.past_k, call.new_k) if a.shape[2]]
        vs = [a for a in (call.sink_v, call.past_v, call.new_v) if a.shape[2]]
        ek = mx.concatenate([k.astype(mx.float32) for k in ks], axis=2)
        ev = mx.concatenate([v.astype(mx.float32) for v in vs], axis=2)
        parts = []
        if qw:
            scores, value_fn = self._quantized_part(qf, qw)
            parts.append((scores, value_fn, ((S0, S0 + qw),)))
        parts.append((qf @ ek.swapaxes(-1, -2), lambda p: p @ ev, ((0, S0), (S0 + qw, n_keys))))
        m = bool_mask(self._visible(N, call.ns, call.nq, call.nw, W0), N, n_keys, H)  # [B, 1, 1, N, M]
        if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == (N, n_keys):
            m = m & bool_mask(mask, N, n_keys, H)  # a caller's extra array mask (ours is already in m)
        return joint_attention(q, parts, m, sinks, n_keys, queries.dtype)

    # ---------------------------------------------------------------- trim
    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens of every sequence as the single cache does: window rows, then
        the newest codes, then sink rows."""
        n = int(n)
        if n <= 0 or not self.lens:
            return 0
        if n > min(self.lens):
            raise ValueError(f"cannot trim {n} tokens: a sequence holds only {min(self.lens)} "
                             f"(tokens per sequence: {self.lens})")
        self._call = None
        w = [min(n, x) for x in self.nw]
        q = [min(n - a, x) for a, x in zip(w, self.nq)]
        self.ns = [s - (n - a - b) for s, a, b in zip(self.ns, w, q)]
        self.nq = [x - b for x, b in zip(self.nq, q)]
        self.nw = [x - a for x, a in zip(self.nw, w)]
        if self.win_k is not None:
            # every window loses its n newest columns (all of them where it held fewer): still right-aligned
            cut, W = max(self.W - n, 0), max(self.nw, default=0)
            self.win_k = keep_right(self.win_k[:, :, :cut], W)
            self.win_v = keep_right(self.win_v[:, :, :cut], W)
        self.lens = [x - n for x in self.lens]
        self._sync_offset()
        return n

    # ---------------------------------------------------------------- accounting and state
    @property
    def nbytes(self) -> int:
        return (sum(a.nbytes for a in self.held_arrays())
                + (self.constant_nbytes if self.counts_constants else 0))
