"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453): every
query sees the first ``stream_n_sink`` tokens and the ``stream_window_size`` newest, itself included, and the cache
holds exactly those between calls. A decode step on a full cache overwrites the oldest window row (a ring, as
mlx_lm's ``RotatingKVCache``); a multi-token call appends, attends under a position mask and keeps sinks + window;
with its rows in position order each tile of query rows attends the sinks and its own band of the window only
(``attention.window_attention``), not every row the call returned.

Deviations: keys are cached after RoPE at their original positions (the paper re-assigns positions in the cache),
as ``RotatingKVCache``; the window counts the current token.
"""

from __future__ import annotations

import mlx.core as mx

from ...attention import window_attention
from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache


@register_with_mlx_lm
@register("streaming_llm")
class StreamingLLMKVCache(EvictionKVCache):
    """Attention sinks + a sliding window, exact; holds at most sinks + window rows."""
    chunk_invariant, exact_trim = True, False  # exactly sinks + window; rows slid out meanwhile are gone
    batchable = True  # merge -> StreamingLLMBatchKVCache (streaming_llm_batch.py)
    scalar_fields = EvictionKVCache.scalar_fields + ("ring",)
    ring = -1  # next row a full cache's decode step overwrites (-1: rows are in position order)
    _band = None  # rows before this call, when they are in position order (``attend``); else None

    def _init_layout(self):
        o = self.config.options
        self.n_sink, self.window = o.n_sink, o.window_size
        self.budget = self.n_sink + self.window

    def _full_decode(self, n: int) -> bool:
        return n == 1 and self.rows == self.budget and self.offset >= self.budget

    def update_and_fetch(self, keys, values):
        if self._full_decode(keys.shape[2]):
            self._band = None
            return self._overwrite_oldest(keys, values)
        self._band = self.rows if self.ring < 0 else None
        out = super(EvictionKVCache, self).update_and_fetch(keys, values)
        if self.rows > self.budget:
            self.evict(None)  # position-only rule: no scores, no deferral needed
        return out

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """A multi-row call under the window's mask array, its rows returned in position order: each tile of query
        rows over the sinks and its band of the window only (``attention.window_attention``); else as any cache."""
        band, self._band = self._band, None
        N, M = queries.shape[2], keys.shape[2]
        if band is None or N == 1 or not isinstance(mask, mx.array) or mask.shape[-2:] != (N, M) or band + N != M:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        # rows 0 .. n_sink - 1 are the sinks (positions 0 ..), every later row r position offset - M + r
        return window_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, n_sink=min(self.n_sink, M),
                                first=band, window=self.window)

    def _overwrite_oldest(self, keys, values):
        """Decode step on a full cache: the new row replaces the oldest window row, in place."""
        self._check_input(keys, values)
        r = self.n_sink if self.ring < 0 else self.ring  # in position order the oldest window row follows the sinks
        dt = self.storage_dtype(keys.dtype)
        self.keys[:, :, r : r + 1] = keys.astype(dt)
        self.values[:, :, r : r + 1] = values.astype(dt)
        self.positions[:, :, r : r + 1] = mx.full(keys.shape[:2] + (1,), self.offset, dtype=mx.int32)
        self.ring = self.n_sink + (r + 1 - self.n_sink) % self.window
        self.offset += 1
        self._n_new = 1
        # nothing here reads ``positions``: tie it to the rows returned, so it is evaluated with them
        # instead of stacking one pending update per step (memory crept ~4 B/step)
        return tuple(mx.depends(list(self._dense()), self.positions))

    def _keep_in_order(self, idx):
        self.keep_rows(mx.broadcast_to(idx, self.keys.shape[:2] + (idx.size,)))
        self.ring = -1

    def evict(self, scores, keep=None):
        """Keep the sinks and the ``window`` newest tokens, in position order."""
        order = mx.argsort(self.positions[0, 0, : self.rows]).astype(mx.int32)
        sink = min(self.n_sink, self.rows - self.window)
        self._keep_in_order(mx.concatenate([order[:sink], order[self.rows - self.window :]]))

    def _trim_order(self):
        pos = super()._trim_order()
        return mx.sort(pos, axis=-1) if self.ring >= 0 else pos  # the order ``_trim_rows`` restores first

    def _trim_rows(self, n):
        if self.ring >= 0:  # restore position order first, so the newest rows are the last ones
            self._keep_in_order(mx.argsort(self.positions[0, 0, : self.rows]).astype(mx.int32))
        return super()._trim_rows(n)

    def make_mask(self, N, return_array=False, window_size=None):
        past = self.rows
        if window_size is None and not return_array and (self._full_decode(N) or past + N <= self.window):
            return None if N == 1 else "causal"  # exactly sinks + window, or a short context that sees all
        new = mx.arange(self.offset, self.offset + N, dtype=mx.int32)
        key_pos, q_pos = (mx.concatenate([self.positions[0, 0, :past], new]) if past else new)[None], new[:, None]
        win = self.window if window_size is None else min(self.window, window_size)
        return (key_pos <= q_pos) & ((key_pos < self.n_sink) | (key_pos > q_pos - win))

    @classmethod
    def _merge_batch(cls, caches):
        from .streaming_llm_batch import StreamingLLMBatchKVCache

        return StreamingLLMBatchKVCache.from_caches(caches)

    tokens_in_window, stream_kept_bytes = EvictionKVCache.tokens_kept, EvictionKVCache.kept_bytes  # spec names
