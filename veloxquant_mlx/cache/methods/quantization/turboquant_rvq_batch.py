"""The batch form of TurboQuant-RVQ for mlx_lm's ``BatchGenerator``: B requests decoded together, each
keeping exactly the compressed state it would hold alone (``TurboQuantRVQKVCache.merge`` builds it when every
cache is exactly a ``TurboQuantRVQKVCache`` with the same settings; ``extract(i)`` gives the single cache back).

Layout per sequence, in position order: float16 sink rows (``sink_k [B, H, SINK_ROWS, D]``, ``ns[i]`` used),
codes and norms (``[B, H, cap, .]``, ``nq[i]`` used; later slots are masked and may hold finite leftovers),
both left-aligned, and the float16 window (``win_k [B, H, W, D]``, right-aligned, ``nw[i]`` used). A window
flushes as the single cache's (the stream's first ``SINK_ROWS`` tokens to the sinks), for the whole batch in
one gather, one encode and one ``put_along_axis``. Counts are host-side ints (``batch_common``): no per-step
sync, no loop over tokens, heads or sequences. ``attend`` is the single cache's one softmax with the batch mask
(``_attend_op``); a decode step whose mask is the one ``make_mask`` made (or none) takes the single cache's decode
kernel with per-sequence counts (``_step_exact``) on CUDA, or its CPU kernel ending in ``window.batch_finish``
with per-sequence spans of the sink, window and new rows on the CPU (each checked once against the op path).
Waterfill's batch form routes its own kernels through the same ``_gpu_step`` / ``_cpu_step``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ... import kernels, native
from ...kernels import turboquant_rvq as tq_kernel
from ...attention import bool_mask, dense_attention
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives.bitpack import packed_words
from ..batch_common import (RaggedBatchCache, borrows, grow_slots, keep_right, rows_ending_at, rows_from, step_counts,
                            visible_mask)
from ...primitives.rvq import split_bits
from ...window import QUANT_BLOCK, SINK_ROWS, WindowCall, attend_joint, batch_finish, concat_rows
from .turboquant_rvq import TurboQuantRVQKVCache


class _BatchCall(NamedTuple):
    """One ``update_and_fetch`` call: the counts before it, the sink rows and ``window`` (the single cache's
    record: widths ``max(ns)``, ``max(nq)``, W, the window before the call and the call's rows)."""

    ns: list
    nq: list
    nw: list
    sink: tuple  # (sink_k, sink_v) [B, H, max(ns), D]
    window: WindowCall


@register_with_mlx_lm
@borrows(TurboQuantRVQKVCache, "_init_layout", "_quantizers", "_qs", "_planes", "_decoded", "_quantized_part",
         "_lut_scores", "_cpu_dims_fit", "_cpu_part", "constant_nbytes", "storage_dtype", "__deepcopy__")
class TurboQuantRVQBatchKVCache(RaggedBatchCache):
    """TurboQuant-RVQ's compressed form for B sequences at once (mlx_lm batch-cache protocol); also the
    parent of waterfill's, which stores other codes in the same layout."""

    method_name = "turboquant_rvq"
    single = TurboQuantRVQKVCache  # what ``from_caches`` takes and ``extract`` gives
    merge_what = "settings (residual length, sub-vector dims, bits, seed)"
    per_seq = {"ns": "n_sink", "nq": "n_quant", "nw": "n_win", "lens": "offset"}  # count: the single cache's int
    shared_scalars = ("counts_constants",)  # equal in the batch and its single caches
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

    W = property(lambda self: self.right_width)  # the window's columns

    def size(self) -> int:
        return max(self.ns, default=0) + max(self.nq, default=0) + self.W

    def _settings(self) -> tuple:
        return (self.residual_length, self.key_sub_dim, self.value_sub_dim, self.key_bits, self.value_bits, self.seed)

    def _code_widths(self) -> dict:
        """Trailing shape of each code field (packed words per token; norms have none)."""
        out = {}
        for prefix, qz in zip(("k_", "v_"), self._qs()):
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

    @classmethod
    def from_caches(cls, caches):
        """Batch of ``single`` caches (empty or holding tokens: prompt-cache reuse)."""
        cls._check_mergeable(caches, cls._settings, cls.merge_what)
        held = [c for c in caches if c.win_k is not None]
        shapes, dtypes = {tuple(c._shape) for c in held}, {c.win_k.dtype for c in held}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise BatchingNotSupported(f"{cls.method_name} caches with different head shapes / storage dtypes "
                                       f"cannot share a batch: {shapes}, {dtypes}")
        out = cls(caches[0].config, len(caches))
        for name in cls.shared_scalars:
            setattr(out, name, getattr(caches[0], name))
        for name, attr in cls.per_seq.items():
            setattr(out, name, [getattr(c, attr) for c in caches])
        if not held:
            return out  # nothing stored yet: buffers are allocated by the first update
        out._shape, out.dtype_name, dtype = shapes.pop(), held[0].dtype_name, dtypes.pop()
        out._qs()
        out.cap, W = max(out.nq), max(out.nw)
        ones = []
        for c, s, q, w in zip(caches, out.ns, out.nq, out.nw):  # once per request, not per step
            one = out._alloc(1, dtype, out.cap, W)
            for names, n, dst in ((out._code_widths(), q, slice(0, q)), (("sink_k", "sink_v"), s, slice(0, s)),
                                  (("win_k", "win_v"), w, slice(W - w, W))):
                for name in names if n else ():
                    one[name][:, :, dst] = getattr(c, name)[:, :, :n]
            ones.append(out._merge_one(c, one))
        return out._stack(ones)

    def _merge_one(self, c, one: dict) -> dict:
        """``one``'s arrays (a single cache ``c`` in the batch layout) plus what the subclass keeps whole."""
        return one

    def extract(self, idx: int):
        """Sequence ``idx`` as an ordinary ``single`` cache (the same state it would hold alone)."""
        idx, c = int(idx), self.single(self.config)
        for name in self.shared_scalars:
            setattr(c, name, getattr(self, name))
        for name, attr in self.per_seq.items():
            setattr(c, attr, getattr(self, name)[idx])
        if self.win_k is None:
            return c
        c._shape, c.dtype_name, one = self._shape, self.dtype_name, slice(idx, idx + 1)
        for names, n, cols in ((self._code_widths(), c.n_quant, slice(0, c.n_quant)),
                               (("sink_k", "sink_v"), c.n_sink, slice(None))):
            for name in names if n else ():
                setattr(c, name, mx.contiguous(getattr(self, name)[one, :, cols]))
        for name in ("win_k", "win_v"):  # a copy of the window's rows only: the single cache grows it
            rows = getattr(self, name)[one, :, self.W - c.n_win:]
            setattr(c, name, mx.concatenate([rows, rows[:, :, :0]], axis=2))
        return self._extract_one(c, idx, one)

    def _extract_one(self, c, idx: int, one: slice):
        c._kq, c._vq = self._kq, self._vq
        return c

    @staticmethod
    def _visible(N: int, ns, nq, nw, W: int) -> mx.array:
        """Boolean [B, 1, N, M]: per sequence its sink rows, code slots and window rows, the new rows causally."""
        return visible_mask(N, len(ns), [(max(ns, default=0), ns, "left"), (max(nq, default=0), nq, "left"),
                                         (W, nw, "right")])

    def _call_mask(self, call: _BatchCall, mask, N: int) -> mx.array:
        """The batch mask of ``call``, and-ed with a caller's extra array mask."""
        m = self._visible(N, call.ns, call.nq, call.nw, call.window.r0)
        if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == m.shape[-2:]:
            m = m & bool_mask(mask, N, m.shape[-1])[:, :, 0]
        return m

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("TurboQuantRVQBatchKVCache has no sliding-window mask")
        if self.size() == 0 and not return_array:
            return None if N == 1 else "causal"
        mask = self._visible(N, self.ns, self.nq, self.nw, self.W)
        return self._made(mask, (tuple(self.ns), tuple(self.nq), tuple(self.nw))) if N == 1 else mask

    def _quantized_dense(self, n, dtype=None):
        return self._decoded(n)  # (the batch form keeps no memo of the dense rows)

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
        valid = self._begin_call(keys, values)  # (the first call builds the constants: dim checks up front)
        S0, qw = max(self.ns, default=0), max(self.nq, default=0)
        w = WindowCall(S0, qw, self.W, self.win_k, self.win_v, keys, values)
        self._call = _BatchCall(list(self.ns), list(self.nq), list(self.nw), (self.sink_k[:, :, :S0],
                                                                              self.sink_v[:, :, :S0]), w)
        self._store(keys, values, valid)
        # stored slots < the pre-call counts are unchanged by _store; the others are masked
        return self._rows(S0, qw, *self._call.sink, w.past_k, w.past_v, keys.dtype, keys, values)

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
        rows = {}
        for prefix, qz, x in zip(("k_", "v_"), self._qs(), (kb, vb)):
            rows.update({prefix + name: a for name, a in zip(("codes1", "codes2", "norms"), qz.encode(x, self))})
        self._scatter(K, rows)

    def _scatter(self, K, rows: dict) -> None:
        """Write ``rows`` ({field: [B, H, K(, w)]}, None skipped) into each sequence's slots nq[i] .. + K - 1."""
        slots = mx.array(self.nq, dtype=mx.int32)[:, None] + mx.arange(K, dtype=mx.int32)[None]  # [B, K]
        for name, a in rows.items():
            if a is not None:
                idx = slots[:, None, :] if a.ndim == 3 else slots[:, None, :, None]
                setattr(self, name, mx.put_along_axis(getattr(self, name), idx, a, axis=2))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None

        def op():
            return self._attend_op(queries, keys, values, call, scale=scale, mask=mask, sinks=sinks)

        if not self._one_row_step(queries, keys, call, mask):
            return op()
        if self._gpu_step_ready(queries):  # the CUDA kernel, checked once against the op path
            return kernels.checked_call(f"{self.method_name}_batch", self,
                                        lambda: self._gpu_step(queries, call, scale=scale, sinks=sinks), op)
        if self._cpu_step_ready(queries):  # the CPU kernels, likewise
            return kernels.checked_call(f"{self.method_name}_batch_cpu", self,
                                        lambda: self._cpu_step(queries, call, scale=scale, sinks=sinks), op)
        return op()

    def _attend_op(self, queries, keys, values, call, *, scale, mask, sinks=None):
        """The op path: the single cache's one softmax over the sinks, the codes (``_quantized_part``), the window
        and the new rows with the batch mask; dense attention where the call is not a stored window's."""
        N, w = queries.shape[2], call.window if call is not None else None
        if w is None or w.new_k.shape[2] != N or keys.shape[2] != w.s0 + w.q0 + w.r0 + N:
            return dense_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if keys.shape[2] == N:  # nothing stored before this call: plain (causal) attention over the new rows
            return dense_attention(queries, w.new_k, w.new_v, scale=scale, mask="causal" if N > 1 else None,
                                   sinks=sinks)
        return attend_joint(queries, w, call.sink, self._quantized_part, scale=scale,
                            mask=self._call_mask(call, mask, N), sinks=sinks, n_keys=keys.shape[2])

    def _one_row_step(self, queries, keys, call, mask) -> bool:
        """One query row per sequence over stored codes (the call's rows all returned), with the mask ``make_mask``
        made (or none): what the decode kernels take, with per-sequence counts."""
        w = call.window if call is not None else None
        return (w is not None and queries.shape[2] == 1 and w.q0 > 0 and w.new_k.shape[2] == 1
                and keys.shape[2] == w.s0 + w.q0 + w.r0 + 1
                and self._mask_is_own(mask, (tuple(call.ns), tuple(call.nq), tuple(call.nw))))

    def _gpu_step_ready(self, queries) -> bool:
        """CUDA and shapes ``kernels.turboquant_rvq`` reads."""
        H, D, DV = self._shape
        return kernels.kernels_enabled() and tq_kernel.supported(
            D, DV, queries.shape[1] // H, self.key_sub_dim, self.key_bits, self.value_sub_dim, self.value_bits)

    def _gpu_step(self, queries, call: _BatchCall, *, scale, sinks):
        """The single cache's decode kernel with per-sequence counts: sequence i's first ``nq[i]`` code slots, its
        ``ns[i]`` sink rows (left-aligned), its ``nw[i]`` window rows (right-aligned in the call's window), the new
        row; merged by the launch's last block per head, the values rotated back once."""
        kq, vq = self._qs()
        w = call.window
        counts, exact = self._step_exact(call)
        rot = vq.rotation_back()
        return tq_kernel.tq_partials(
            queries, queries @ kq.rot_t, scale, (self.k_codes1, getattr(self, "k_codes2", None)), self.k_norms,
            (self.v_codes1, getattr(self, "v_codes2", None)), self.v_norms, kq.cb, vq.cb, rot, w.q0, exact,
            counts=counts, merge=kernels.Merge(sinks, False, queries.dtype, self, rot))

    def _step_exact(self, call: _BatchCall):
        """The CUDA kernels' per-sequence counts and exact buffers of a one-row step: the sink slots (those below
        ``ns[i]`` never change), the window before the call (right-aligned) and the new row."""
        w = call.window
        W = w.r0
        win_k, win_v = (w.past_k, w.past_v) if W else (self.sink_k, self.sink_v)  # no window: 0 rows read
        counts = step_counts([(q, 0, s, W - r, r) for s, q, r in zip(call.ns, call.nq, call.nw)])
        return counts, (self.sink_k, self.sink_v, 0, win_k, win_v, 0, w.new_k, w.new_v)

    def _cpu_step_ready(self, queries) -> bool:
        """The CPU kernels built here (``native``) and head shapes they hold (``_cpu_dims_fit``)."""
        return native.available() and self._cpu_dims_fit(queries.shape[1])

    def _cpu_step(self, queries, call: _BatchCall, *, scale, sinks):
        """The step by the CPU kernels: each sequence's first ``nq[i]`` code slots (``_batch_cpu_part``), then its
        ``ns[i]`` sink rows, the last ``nw[i]`` of the window's columns and its new row, in one primitive."""
        w = call.window
        groups = [(call.sink, [(0, s) for s in call.ns]), ((w.past_k, w.past_v), [(w.r0 - r, r) for r in call.nw]),
                  ((w.new_k, w.new_v), [(0, 1)] * len(call.ns))]
        return batch_finish(queries, w.new_k.shape[1], scale, lambda qf: self._batch_cpu_part(qf, w.q0, call.nq),
                            groups, sinks)

    def _batch_cpu_part(self, q, n: int, counts: list):
        """The CPU kernel's partials over each sequence's first ``counts[i]`` of ``n`` code slots."""
        return self._cpu_part(q, n, counts)

    def _check_trim_rows(self, n: int) -> None:
        """No more than the shortest sequence's tokens."""
        if n > min(self.lens):
            raise ValueError(f"cannot trim {n} tokens: a sequence holds only {min(self.lens)} "
                             f"(tokens per sequence: {self.lens})")

    def _trim_rows(self, n: int) -> None:
        """As the single cache: the window's newest rows, then codes, then sinks."""
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

    @property
    def nbytes(self) -> int:
        return super().nbytes + (self.constant_nbytes if self.counts_constants else 0)
