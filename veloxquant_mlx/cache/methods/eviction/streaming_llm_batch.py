"""The batch form of the StreamingLLM cache: several requests decoded together by mlx_lm's
``BatchGenerator`` (continuous batching), each keeping exactly the rows it would keep alone: its own
attention sinks and its own most recent window, at its own positions.

``StreamingLLMKVCache.merge(caches)`` builds a ``StreamingLLMBatchKVCache`` (only when every cache is
exactly a ``StreamingLLMKVCache`` with the same sinks / window / storage dtype); ``extract(i)`` gives
back an ordinary ``StreamingLLMKVCache`` with the same rows, in the same order, the same positions and
the same ring slot as an unbatched run.

Layout (B sequences, H kv heads, D / Dv head dims): the single cache's storage with a batch axis,
every sequence's rows left-aligned: ``keys [B, H, cap, D]``, ``values [B, H, cap, Dv]`` (the single
cache's 16-bit storage dtype) and ``positions [B, H, cap]`` (int32, the same for every head, as alone).
Sequence i's ``nq[i]`` rows fill slots ``[0, nq[i])`` in the order the single cache holds them
(position order, or ring order once its full-cache decode steps have overwritten rows); slots
``>= nq[i]`` are invalid for it (masked; they may hold leftovers, always finite). ``cap <= sinks +
window`` (the budget), so the bytes held do not grow with the decode length.

* A decode step (one row per sequence) writes each sequence's row into one slot, as alone: a full
  sequence (budget rows, ``lens[i] >= budget``) over its oldest window row (its ring slot ``ring[i]``,
  host-side), the others after their last row. One ``put_along_axis`` per array, no gather.
* Any other call (prefill chunks, right-padded prefill, a decode step that meets a request with no
  row this call) appends each sequence's valid rows and keeps, exactly as the single cache's
  ``evict``, its sinks and its ``window`` newest rows in position order (one argsort of the
  positions and one gather over the batch; a sequence with no valid rows keeps its order).

The per-sequence counts (``nq``, ``ring``, ``lens``) are host-side ints, as in every
``batch_common.RaggedBatchCache``; only ``merge`` / ``extract`` loop over the sequences (once per request).

``update_and_fetch`` returns [the stored rows before the call (max(nq) columns), the call's rows
(rounded through the storage dtype, as alone)] and ``make_mask`` the boolean mask [B, 1, N, M] that
shows each sequence its valid rows under StreamingLLM's position rule (key position <= query
position, and key position < sinks or within the query's window); ``attend`` (dispatch point) applies
the same mask, rebuilt from the call's own counts. Right-padded prefill (``prepare(lengths=)``): only
each sequence's first ``lengths[i]`` rows are stored. ``offset`` is an ``mx.array``.
"""

from __future__ import annotations

import mlx.core as mx

from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...eviction import EvictionKVCache
from ..batch_common import RaggedBatchCache, visible_mask
from .streaming_llm import StreamingLLMKVCache

_BIG = 2 ** 30  # sort key of invalid columns: after every real position

_FIELDS = ("keys", "values", "positions")


def _settings(c) -> tuple:
    return (c.n_sink, c.window, c.config.dtype)


@register_with_mlx_lm
class StreamingLLMBatchKVCache(RaggedBatchCache):
    """StreamingLLM's sinks + window for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "streaming_llm"
    array_fields = _FIELDS
    count_fields = ("nq", "ring", "lens")  # rows held (left-aligned), ring slot (-1: position order), tokens seen
    right_fields = ()  # no right-aligned region: every row is in the left-aligned buffers
    chunk_invariant = True  # as the single cache
    exact_trim = False  # as the single cache

    dtype_name = "float16"
    _init_layout = StreamingLLMKVCache._init_layout
    storage_dtype = EvictionKVCache.storage_dtype

    def __init__(self, config, batch_size: int = 0):
        super().__init__(config)
        self._init_counts(batch_size)  # ``cap``: slots allocated (<= budget between calls)
        self.ring = [-1] * batch_size  # rows in position order, as a fresh single cache

    # ---------------------------------------------------------------- bookkeeping
    def stored_rows(self) -> int:
        return max(self.nq, default=0)

    def _settings(self) -> tuple:
        return _settings(self)

    def _region_dtype(self, compute_dtype):
        return self.storage_dtype(compute_dtype)

    def _alloc(self, B, dtype, cap=0) -> dict:
        H, D, Dv = self._shape
        return {"keys": mx.zeros((B, H, cap, D), dtype=dtype), "values": mx.zeros((B, H, cap, Dv), dtype=dtype),
                "positions": mx.zeros((B, H, cap), dtype=mx.int32)}

    def _slot_fields(self) -> dict:
        return {name: (2, 1) for name in _FIELDS}  # one kept row per slot

    def _spare(self, need: int) -> int:
        """Slots to allocate for ``need`` rows: some room for decode appends, never beyond the budget."""
        return max(need, min(self.budget, need + max(4, need // 8)))

    # ---------------------------------------------------------------- batch protocol
    @classmethod
    def from_caches(cls, caches) -> "StreamingLLMBatchKVCache":
        """Batch of single ``StreamingLLMKVCache``s (empty or holding tokens: prompt-cache reuse): each
        one as a one-sequence batch, joined by ``extend`` (once per request, not per step)."""
        first = caches[0]
        for c in caches:
            if _settings(c) != _settings(first):
                raise BatchingNotSupported(
                    "streaming_llm caches with different sinks / window / dtype cannot share a batch: "
                    f"{_settings(c)} vs {_settings(first)}")
            if getattr(c, "_pending", False):
                raise BatchingNotSupported("streaming_llm cache with a deferred eviction")
        out = cls(first.config)
        for c in caches:
            one = cls(c.config, 1)
            one.lens = [c.offset]
            if c.keys is not None:
                one._shape, one.nq, one.ring, one.cap = c._shape, [c.rows], [c.ring], c.rows
                one.dtype_name = str(getattr(c, "compute_dtype", c.keys.dtype)).rsplit(".", 1)[-1]
                for name in _FIELDS:
                    setattr(one, name, getattr(c, name)[:, :, : c.rows])
            out.extend(one)
        return out

    def extract(self, idx: int) -> StreamingLLMKVCache:
        """Sequence ``idx`` as an ordinary ``StreamingLLMKVCache`` (the same rows, order, positions and
        ring slot it would hold alone)."""
        idx = int(idx)
        c = StreamingLLMKVCache(self.config)
        c.offset = self.lens[idx]
        if self.keys is None:
            return c
        n = self.nq[idx]
        c._shape = self._shape
        c.compute_dtype = getattr(mx, self.dtype_name)
        one = slice(idx, idx + 1)
        for name in _FIELDS:
            setattr(c, name, mx.contiguous(getattr(self, name)[one, :, :n]))
        c.rows, c.ring = n, self.ring[idx]
        return c

    # ---------------------------------------------------------------- masks
    def _visible(self, N: int, nq, lens, past_pos) -> mx.array:
        """Boolean [B, 1, N, P + N]: per sequence, its valid stored rows and the new rows causally,
        under the position rule (sinks, or within the query's window)."""
        B = len(nq)
        P = 0 if past_pos is None else past_pos.shape[1]
        m = visible_mask(N, B, [(P, nq, "left")])
        new = mx.array(lens, dtype=mx.int32)[:, None] + mx.arange(N, dtype=mx.int32)[None]  # [B, N]
        kp = new if not P else mx.concatenate([past_pos, new], axis=1)
        kp, qp = kp[:, None, None, :], new[:, None, :, None]
        return m & ((kp < self.n_sink) | (kp > qp - self.window))

    def _past_pos(self, P):
        return self.positions[:, 0, :P] if P else None

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("StreamingLLMBatchKVCache has no sliding-window mask (its window is its own)")
        P = self.stored_rows()
        if P == 0 and N <= self.window and not return_array:
            return None if N == 1 else "causal"
        return self._visible(N, self.nq, self.lens, self._past_pos(P))

    # ---------------------------------------------------------------- storage
    def update_and_fetch(self, keys, values):
        valid = self._begin_call(keys, values)
        N, P = keys.shape[2], self.stored_rows()
        sd = self.keys.dtype
        nk, nv = keys.astype(sd), values.astype(sd)
        past_k, past_v = self.keys[:, :, :P], self.values[:, :, :P]
        self._call = (N, list(self.nq), list(self.lens), self._past_pos(P))
        decode = N == 1 and all(v == 1 for v in valid) and all(
            n < self.budget or l >= self.budget for n, l in zip(self.nq, self.lens))
        if decode:
            self._decode(nk, nv)
        else:
            self._store(past_k, past_v, nk, nv, valid)
        dt = keys.dtype
        if not P:
            return nk.astype(dt), nv.astype(dt)
        return (mx.concatenate([past_k, nk], axis=2).astype(dt), mx.concatenate([past_v, nv], axis=2).astype(dt))

    def _decode(self, nk, nv):
        """One row per sequence: over the oldest window row of a full sequence, else appended."""
        full = [n == self.budget and l >= self.budget for n, l in zip(self.nq, self.lens)]
        slots = [(r if r >= 0 else self.n_sink) if f else n for f, r, n in zip(full, self.ring, self.nq)]
        need = max(slots) + 1
        if need > self.cap:
            self._set_capacity(self._spare(need))
        B, H = nk.shape[:2]
        s = mx.array(slots, dtype=mx.int32)[:, None, None]  # [B, 1, 1]
        self.keys = mx.put_along_axis(self.keys, s[..., None], nk, axis=2)
        self.values = mx.put_along_axis(self.values, s[..., None], nv, axis=2)
        pos = mx.broadcast_to(mx.array(self.lens, dtype=mx.int32)[:, None, None], (B, H, 1))
        self.positions = mx.put_along_axis(self.positions, s, pos, axis=2)
        self.ring = [self.n_sink + (sl + 1 - self.n_sink) % self.window if f else r
                     for f, sl, r in zip(full, slots, self.ring)]
        self.nq = [n + (0 if f else 1) for n, f in zip(self.nq, full)]
        self.lens = [x + 1 for x in self.lens]
        self._sync_offset()

    def _store(self, past_k, past_v, nk, nv, valid):
        """Append each sequence's valid rows, then keep its sinks and window newest rows in position
        order (the single cache's ``evict``); a sequence without valid rows keeps its rows as they are."""
        B, H, N, _ = nk.shape
        P = past_k.shape[2]
        M = P + N
        new_pos = mx.array(self.lens, dtype=mx.int32)[:, None] + mx.arange(N, dtype=mx.int32)[None]  # [B, N]
        ck = mx.concatenate([past_k, nk], axis=2) if P else nk
        cv = mx.concatenate([past_v, nv], axis=2) if P else nv
        cpos = mx.broadcast_to(new_pos[:, None], (B, H, N))
        if P:
            cpos = mx.concatenate([self.positions[:, :, :P], cpos], axis=2)
        cols = mx.arange(M, dtype=mx.int32)[None]
        nq_a, val_a = mx.array(self.nq, dtype=mx.int32)[:, None], mx.array(valid, dtype=mx.int32)[:, None]
        ok = (cols < nq_a) | ((cols >= P) & (cols < P + val_a))
        key = mx.where(ok, mx.where(val_a > 0, cpos[:, 0], cols), _BIG)
        order = mx.argsort(key, axis=1).astype(mx.int32)  # [B, M]: valid rows first, in position order
        total = [n + v for n, v in zip(self.nq, valid)]
        sink = [min(self.n_sink, t - self.window) if t > self.budget else t for t in total]
        keep = [s + self.window if t > self.budget else t for s, t in zip(sink, total)]
        drop = [t - k for t, k in zip(total, keep)]
        cap = self._spare(max(keep, default=0))
        j = mx.arange(cap, dtype=mx.int32)[None]
        src = j + mx.where(j >= mx.array(sink, dtype=mx.int32)[:, None], mx.array(drop, dtype=mx.int32)[:, None], 0)
        sel = mx.take_along_axis(order, mx.minimum(src, M - 1), axis=1)  # [B, cap] columns kept, in order
        self.keys = mx.take_along_axis(ck, sel[:, None, :, None], axis=2)
        self.values = mx.take_along_axis(cv, sel[:, None, :, None], axis=2)
        self.positions = mx.take_along_axis(cpos, sel[:, None, :], axis=2)
        self.cap = cap
        self.ring = [-1 if v else r for v, r in zip(valid, self.ring)]
        self.nq = keep
        self.lens = [x + v for x, v in zip(self.lens, valid)]
        self._sync_offset()

    def _dense(self):
        P = self.stored_rows()
        if self.keys is None or not P:
            return None, None
        dt = getattr(mx, self.dtype_name)
        return self.keys[:, :, :P].astype(dt), self.values[:, :, :P].astype(dt)

    # ---------------------------------------------------------------- attention
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is not None and call[0] == N and keys.shape[2] == max(call[1], default=0) + N:
            _, nq, lens, past_pos = call
            if past_pos is None and N <= self.window:
                mask = None if N == 1 else "causal"
            else:
                mask = self._visible(N, nq, lens, past_pos)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    # ---------------------------------------------------------------- trim
    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens of every sequence, as the single cache does (rows back in
        position order); raises ``ValueError`` where a sequence no longer holds them."""
        n = int(n)
        if n <= 0 or not self.lens:
            return 0
        if n > min(self.nq):
            raise ValueError(f"cannot trim {n} tokens: a sequence holds only {min(self.nq)} rows "
                             f"(rows per sequence: {self.nq})")
        self._call = None
        P = self.stored_rows()
        cols = mx.arange(P, dtype=mx.int32)[None]
        pos = self.positions[:, 0, :P]
        order = mx.argsort(mx.where(cols < mx.array(self.nq, dtype=mx.int32)[:, None], pos, _BIG), axis=1)
        order = order.astype(mx.int32)
        spos = mx.take_along_axis(pos, order, axis=1)
        j = mx.arange(n, dtype=mx.int32)[None]
        tail = mx.take_along_axis(spos, mx.array(self.nq, dtype=mx.int32)[:, None] - n + j, axis=1)
        if not bool(mx.all(tail == mx.array(self.lens, dtype=mx.int32)[:, None] - n + j)):
            raise ValueError("StreamingLLMBatchKVCache: the last tokens of a sequence were evicted, "
                             "so they cannot be trimmed exactly")
        self.keys = mx.take_along_axis(self.keys[:, :, :P], order[:, None, :, None], axis=2)
        self.values = mx.take_along_axis(self.values[:, :, :P], order[:, None, :, None], axis=2)
        self.positions = mx.take_along_axis(self.positions[:, :, :P], order[:, None, :], axis=2)
        self.cap = P
        self.nq = [x - n for x in self.nq]
        self.ring = [-1] * len(self.nq)
        self.lens = [x - n for x in self.lens]
        self._sync_offset()
        return n
