"""The batch form of the StreamingLLM cache (mlx_lm's ``BatchGenerator``): each request keeps exactly the rows it
would keep alone; ``StreamingLLMKVCache.merge`` builds one, ``extract(i)`` gives back the single cache (same rows,
order, positions and ring slot). The single cache's arrays get a batch axis, rows left-aligned (sequence i's
``nq[i]`` rows in ``[0, nq[i])``, later slots masked), ``cap <= sinks + window``. A decode step writes each
sequence's row into one slot (a full sequence's ring slot, else after its last row: one ``put_along_axis``); any
other call appends the valid rows (right-padded prefill: ``prepare(lengths=)``) and keeps each sequence's sinks and
window in position order (one argsort, one gather).
"""

from __future__ import annotations

import mlx.core as mx

from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...eviction import EvictionKVCache
from ..batch_common import RaggedBatchCache, visible_mask
from .streaming_llm import StreamingLLMKVCache

_BIG = 2 ** 30  # sort key of invalid columns: after every real position
_FIELDS = ("keys", "values", "positions")


@register_with_mlx_lm
class StreamingLLMBatchKVCache(RaggedBatchCache):
    """StreamingLLM's sinks + window for B sequences at once (mlx_lm batch-cache protocol)."""
    method_name = "streaming_llm"
    array_fields = _FIELDS
    count_fields = ("nq", "ring", "lens")  # rows held (left-aligned), ring slot (-1: position order), tokens seen
    chunk_invariant, exact_trim = True, False  # as the single cache
    dtype_name = "float16"
    _init_layout = StreamingLLMKVCache._init_layout
    storage_dtype = EvictionKVCache.storage_dtype
    _region_dtype = storage_dtype

    def __init__(self, config, batch_size: int = 0):
        super().__init__(config, batch_size)  # ``cap``: slots allocated (<= budget between calls)
        self.ring = [-1] * batch_size  # rows in position order, as a fresh single cache

    def stored_rows(self) -> int:
        return max(self.nq, default=0)

    def _settings(self) -> tuple:  # also called on single caches (``from_caches``)
        return (self.n_sink, self.window, self.config.dtype)

    def _alloc(self, B, dtype, cap=0) -> dict:
        H, D, Dv = self._shape
        return {"keys": mx.zeros((B, H, cap, D), dtype=dtype), "values": mx.zeros((B, H, cap, Dv), dtype=dtype),
                "positions": mx.zeros((B, H, cap), dtype=mx.int32)}

    def _slot_fields(self) -> dict:
        return {name: (2, 1) for name in _FIELDS}  # one kept row per slot

    def _spare(self, need: int) -> int:
        """Slots to allocate for ``need`` rows: some room for decode appends, never beyond the budget."""
        return max(need, min(self.budget, need + max(4, need // 8)))

    @classmethod
    def from_caches(cls, caches) -> "StreamingLLMBatchKVCache":
        """Batch of single caches (empty or holding tokens): each as a one-sequence batch, joined by ``extend``."""
        first, settings = caches[0], cls._settings
        for c in caches:
            if settings(c) != settings(first):
                raise BatchingNotSupported(
                    "streaming_llm caches with different sinks / window / dtype cannot share a batch: "
                    f"{settings(c)} vs {settings(first)}")
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
        """Sequence ``idx`` as an ordinary ``StreamingLLMKVCache``."""
        idx, c = int(idx), StreamingLLMKVCache(self.config)
        c.offset = self.lens[idx]
        if self.keys is None:
            return c
        n = self.nq[idx]
        c._shape, c.compute_dtype, c.rows, c.ring = self._shape, getattr(mx, self.dtype_name), n, self.ring[idx]
        for name in _FIELDS:
            setattr(c, name, mx.contiguous(getattr(self, name)[idx : idx + 1, :, :n]))
        return c

    def _visible(self, N: int, nq, lens, past_pos, return_array: bool = False):
        """Boolean [B, 1, N, P + N]: each sequence's valid stored rows and new rows under the position rule (None /
        "causal" for a first call that sees every row, unless ``return_array``)."""
        if past_pos is None and N <= self.window and not return_array:
            return None if N == 1 else "causal"
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
        return self._visible(N, self.nq, self.lens, self._past_pos(self.stored_rows()), return_array)

    def update_and_fetch(self, keys, values):
        valid = self._begin_call(keys, values)
        N, P = keys.shape[2], self.stored_rows()
        nk, nv = keys.astype(self.keys.dtype), values.astype(self.keys.dtype)
        past_k, past_v = self.keys[:, :, :P], self.values[:, :, :P]
        self._call = (N, list(self.nq), list(self.lens), self._past_pos(P))
        decode = N == 1 and all(v == 1 for v in valid) and all(
            n < self.budget or l >= self.budget for n, l in zip(self.nq, self.lens))
        if decode:
            self._decode(nk, nv)
        else:
            self._store(past_k, past_v, nk, nv, valid)
        return tuple((mx.concatenate([p, n], axis=2) if P else n).astype(keys.dtype)
                     for p, n in ((past_k, nk), (past_v, nv)))

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
        """Append each sequence's valid rows, then keep its sinks and window newest rows in position order."""
        (B, H, N, _), P = nk.shape, past_k.shape[2]
        M = P + N
        new_pos = mx.array(self.lens, dtype=mx.int32)[:, None] + mx.arange(N, dtype=mx.int32)[None]  # [B, N]
        ck, cv, cpos = ((mx.concatenate([p, x], axis=2) if P else x) for p, x in (
            (past_k, nk), (past_v, nv), (self.positions[:, :, :P], mx.broadcast_to(new_pos[:, None], (B, H, N)))))
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
        self._gather(sel, ck, cv, cpos)
        self.cap, self.nq, self.ring = cap, keep, [-1 if v else r for v, r in zip(valid, self.ring)]
        self.lens = [x + v for x, v in zip(self.lens, valid)]
        self._sync_offset()

    def _gather(self, sel, k, v, pos) -> None:
        """Hold the columns ``sel`` [B, cols] of ``k``, ``v``, ``pos`` (the same in every head)."""
        self.keys, self.values = (mx.take_along_axis(a, sel[:, None, :, None], axis=2) for a in (k, v))
        self.positions = mx.take_along_axis(pos, sel[:, None, :], axis=2)

    def _dense(self):
        P = self.stored_rows()
        if self.keys is None or not P:
            return None, None
        dt = getattr(mx, self.dtype_name)
        return self.keys[:, :, :P].astype(dt), self.values[:, :, :P].astype(dt)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is not None and call[0] == N and keys.shape[2] == max(call[1], default=0) + N:
            mask = self._visible(*call)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _position_order(self) -> mx.array:
        """[B, P] column indices putting each sequence's valid rows in position order (invalid columns last)."""
        P = self.stored_rows()
        valid = mx.arange(P, dtype=mx.int32)[None] < mx.array(self.nq, dtype=mx.int32)[:, None]
        return mx.argsort(mx.where(valid, self.positions[:, 0, :P], _BIG), axis=1).astype(mx.int32)

    def _check_trim_rows(self, n: int) -> None:
        """As the single cache: every sequence's ``n`` newest rows must be its ``n`` newest tokens."""
        if n > min(self.nq):
            raise ValueError(f"cannot trim {n} tokens: a sequence holds only {min(self.nq)} rows "
                             f"(rows per sequence: {self.nq})")
        P, nq = self.stored_rows(), mx.array(self.nq, dtype=mx.int32)[:, None]
        j = mx.arange(n, dtype=mx.int32)[None]
        in_order = mx.take_along_axis(self.positions[:, 0, :P], self._position_order(), axis=1)
        tail = mx.take_along_axis(in_order, nq - n + j, axis=1)
        if not bool(mx.all(tail == mx.array(self.lens, dtype=mx.int32)[:, None] - n + j)):
            raise ValueError("StreamingLLMBatchKVCache: the last tokens of a sequence were evicted, "
                             "so they cannot be trimmed exactly")

    def _trim_rows(self, n: int) -> None:
        """As the single cache; rows back in position order."""
        P = self.stored_rows()
        self._gather(self._position_order(), *(getattr(self, name)[:, :, :P] for name in _FIELDS))
        self.cap, self.ring = P, [-1] * len(self.nq)
        self.nq = [x - n for x in self.nq]
