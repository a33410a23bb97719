"""The batch form of TurboQuant-RVQ (the default method) for mlx_lm's ``BatchGenerator``: several
requests decoded together, each keeping exactly the compressed state it would hold alone
(``TurboQuantRVQKVCache.merge`` builds it when every cache is exactly a ``TurboQuantRVQKVCache`` with the
same settings; ``extract(i)`` gives the single cache back).

Layout per sequence, in position order: float16 sink rows (``sink_k [B, H, SINK_ROWS, D]``, left-aligned,
``ns[i]`` used), codes and norms (``k_codes1``/``k_codes2``/``k_norms`` and the values', ``[B, H, cap, .]``,
left-aligned, ``nq[i]`` used; later slots are masked and may hold finite leftovers) and the float16 window
(``win_k [B, H, W, D]``, right-aligned, ``nw[i]`` used). A window that reaches ``R + QUANT_BLOCK`` rows
flushes its oldest whole blocks beyond the newest R as the single cache does (the stream's first
``SINK_ROWS`` tokens to the sinks): one gather, one ``_Quantizer.encode`` and one ``put_along_axis`` into
slots ``nq[i] ..`` for the whole batch. The counts (``ns``, ``nq``, ``nw``, ``lens``) are host-side ints
from the call sizes (``batch_common.RaggedBatchCache``): no per-step device sync, no loop over tokens,
heads or sequences per step. ``make_mask`` shows each sequence its own rows; ``attend`` runs the single
cache's ``_quantized_part`` and ``joint_attention`` with that mask. ``nbytes``: the arrays held plus,
as the single caches, the shared constants where ``counts_constants``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ...attention import bool_mask, group_queries
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives.bitpack import packed_words
from ..batch_common import RaggedBatchCache, borrows, grow_slots, keep_right, rows_ending_at, rows_from, visible_mask
from ...primitives.rvq import split_bits
from ...window import QUANT_BLOCK, SINK_ROWS, concat_rows, joint_attention, rows_part
from .turboquant_rvq import TurboQuantRVQKVCache

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


@register_with_mlx_lm
@borrows(TurboQuantRVQKVCache, "_init_layout", "_quantizers", "_qs", "_planes", "_quantized_dense", "_quantized_part",
         "_quantized_tiles", "_lut_scores", "constant_nbytes", "storage_dtype", "__deepcopy__")
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
    W = property(lambda self: self.right_width)  # the window's columns

    def size(self) -> int:
        return max(self.ns, default=0) + max(self.nq, default=0) + self.W

    def _settings(self) -> tuple:
        return (self.residual_length, self.key_sub_dim, self.value_sub_dim, self.key_bits, self.value_bits, self.seed)

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
        cls._check_mergeable(caches, cls._settings, "settings (residual length, sub-vector dims, bits, seed)")
        held = [c for c in caches if c.win_k is not None]
        shapes, dtypes = {tuple(c._shape) for c in held}, {c.win_k.dtype for c in held}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise BatchingNotSupported(
                f"turboquant_rvq caches with different head shapes / storage dtypes cannot share a batch: "
                f"{shapes}, {dtypes}")
        out = cls(first.config, len(caches))
        out.counts_constants = first.counts_constants
        if not held:
            return out  # nothing stored yet: buffers are allocated by the first update
        out._shape, out.dtype_name = shapes.pop(), held[0].dtype_name
        out._quantizers(out._shape[1], out._shape[2])
        out.ns, out.nq, out.nw = [c.n_sink for c in caches], [c.n_quant for c in caches], [c.n_win for c in caches]
        out.lens = [c.offset for c in caches]
        out.cap, W = max(out.nq), max(out.nw)
        dtype = dtypes.pop()
        ones = []
        for c, s, q, w in zip(caches, out.ns, out.nq, out.nw):  # once per request, not per step
            one = out._alloc(1, dtype, out.cap, W)
            for names, n, dst in ((list(out._code_widths()), q, slice(0, q)), (("sink_k", "sink_v"), s, slice(0, s)),
                                  (("win_k", "win_v"), w, slice(W - w, W))):
                for name in names if n else ():
                    one[name][:, :, dst] = getattr(c, name)[:, :, :n]
            ones.append(one)
        return out._stack(ones)

    def extract(self, idx: int) -> TurboQuantRVQKVCache:
        """Sequence ``idx`` as an ordinary ``TurboQuantRVQKVCache`` (the same state it would hold alone)."""
        idx = int(idx)
        c = TurboQuantRVQKVCache(self.config)
        c.counts_constants, c.offset = self.counts_constants, self.lens[idx]
        if self.win_k is None:
            return c
        c.n_sink, c.n_quant, c.n_win = s, q, w = self.ns[idx], self.nq[idx], self.nw[idx]
        c._shape, c.dtype_name, c._kq, c._vq = self._shape, self.dtype_name, self._kq, self._vq
        one = slice(idx, idx + 1)
        if q:
            for name in self._code_widths():
                setattr(c, name, mx.contiguous(getattr(self, name)[one, :, :q]))
        if s:
            c.sink_k, c.sink_v = mx.contiguous(self.sink_k[one]), mx.contiguous(self.sink_v[one])
        for name in ("win_k", "win_v"):  # a copy of the window's rows only: the single cache grows it when rows arrive
            rows = getattr(self, name)[one, :, self.W - w:]
            setattr(c, name, mx.concatenate([rows, mx.zeros((*rows.shape[:2], 0, rows.shape[3]), dtype=rows.dtype)], 2))
        return c

    # ---------------------------------------------------------------- masks
    @staticmethod
    def _visible(N: int, ns, nq, nw, W: int) -> mx.array:
        """Boolean [B, 1, N, M]: per sequence its sink rows, code slots and window rows, the new rows causally."""
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
        parts = [(sink_k[:, :, :S0], sink_v[:, :, :S0]) if S0 else (None, None),
                 self._quantized_dense(qw) if qw else (None, None)]
        parts += [(k, v) if k is not None and k.shape[2] else (None, None) for k, v in ((win_k, win_v), (new_k, new_v))]
        return concat_rows(parts, dtype) if any(k is not None for k, _ in parts) else (None, None)

    def _dense(self):
        return self._rows(max(self.ns, default=0), max(self.nq, default=0), self.sink_k, self.sink_v,
                          self.win_k, self.win_v, getattr(mx, self.dtype_name))

    def update_and_fetch(self, keys, values):
        self._check_input(keys, values)
        self._quantizers(keys.shape[-1], values.shape[-1])  # constants (and dim checks) up front
        valid = self._begin_call(keys, values)
        S0 = max(self.ns, default=0)
        self._call = call = _BatchCall(list(self.ns), list(self.nq), list(self.nw), self.sink_k[:, :, :S0],
                                       self.sink_v[:, :, :S0], self.win_k, self.win_v, keys, values)
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
        """Rows each window of ``nw`` rows flushes, as the single cache (``_compact_blocks``)."""
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
        S0, qw, W0 = call.widths if call is not None else (0, 0, 0)
        n_keys = S0 + qw + W0 + N
        if call is None or call.new_k.shape[2] != N or keys.shape[2] != n_keys:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if n_keys == N:  # nothing stored before this call: plain (causal) attention over the new rows
            return mx.fast.scaled_dot_product_attention(queries, call.new_k, call.new_v, scale=scale,
                                                        mask="causal" if N > 1 else None, sinks=sinks)
        B, Hq, _, D = queries.shape
        H = call.new_k.shape[1]
        q = group_queries(queries, H).astype(mx.float32) * scale  # [B, H, rep, N, D]
        qf = q.reshape(B, H, -1, D)
        # exact rows (float16 sink rows and window, the call's own rows) as one group, in key order
        ek, ev = concat_rows(((call.sink_k, call.sink_v), (call.past_k, call.past_v), (call.new_k, call.new_v)),
                             mx.float32)
        parts = [(*self._quantized_part(qf, qw), ((S0, S0 + qw),))] if qw else []
        parts.append(rows_part(qf, ek, ev, ((0, S0), (S0 + qw, n_keys))))
        m = bool_mask(self._visible(N, call.ns, call.nq, call.nw, W0), N, n_keys, H)  # [B, 1, 1, N, M]
        if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == (N, n_keys):
            m = m & bool_mask(mask, N, n_keys, H)  # a caller's extra array mask (ours is already in m)
        return joint_attention(q, parts, m, sinks, n_keys, queries.dtype)

    # ---------------------------------------------------------------- trim
    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens of every sequence as the single cache does (window, codes, sinks)."""
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
