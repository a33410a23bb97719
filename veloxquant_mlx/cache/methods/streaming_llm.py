"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).

Every query attends to the first ``stream_n_sink`` tokens (attention sinks) and to the most recent
``stream_window_size`` tokens, itself included, and nothing else. The mask (``make_mask``) limits
each query to exactly that set, in prefill chunks and decode steps alike. Storage is evicted back to
sinks + ``window - 1`` rows whenever it exceeds that by ``slack`` rows (max(16, window/8)): dropping
one row per decode step would copy the whole window every step (measured 0.64x the plain cache's
decode speed on an H200), while the mask keeps the attended set exact between evictions.

Deviations from the paper:
* Keys are cached after RoPE (mlx_lm's order), so tokens keep their original positions; the paper
  re-assigns positions inside the cache. Same choice as mlx_lm's ``RotatingKVCache``.
* The window counts the current token (the paper's "recent tokens" window likewise ends at it).
"""

from __future__ import annotations

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..eviction import EvictionKVCache


@register_with_mlx_lm
@register("streaming_llm")
class StreamingLLMKVCache(EvictionKVCache):
    """Attention sinks + a sliding window, exact; holds at most sinks + window - 1 + slack rows."""

    def _init_layout(self):
        self.n_sink = self.config.stream_n_sink
        self.window = self.config.stream_window_size
        self.budget = self.n_sink + self.window - 1
        self.slack = max(16, self.window // 8)

    def update_and_fetch(self, keys, values):
        out = super(EvictionKVCache, self).update_and_fetch(keys, values)
        if self.rows > self.budget + (self.slack if keys.shape[2] == 1 else 0):
            self.evict(None)  # position-only rule: no scores, no deferral needed
        return out

    def evict(self, scores, keep=None):
        # Rows are in position order and identical across heads: keep the first sinks and the tail.
        n_tail = self.window - 1
        sink = min(self.n_sink, self.rows - n_tail)
        idx = mx.concatenate([mx.arange(sink), mx.arange(self.rows - n_tail, self.rows)]).astype(mx.int32)
        B, H = self.keys.shape[:2]
        self.keep_rows(mx.broadcast_to(idx, (B, H, idx.size)))

    def make_mask(self, N, return_array=False, window_size=None):
        past = self.rows
        if N == 1 and window_size is None and not return_array and past <= self.budget:
            return None  # stored rows are exactly sinks + (window - 1): all visible
        if past + N <= self.window and window_size is None and not return_array:
            return "causal"
        # key positions: stored (sinks then the recent tail, in order) followed by the N new ones
        if past:
            key_pos = mx.concatenate([self.positions[0, 0, :past], mx.arange(self.offset, self.offset + N)])
        else:
            key_pos = mx.arange(self.offset, self.offset + N)
        q_pos = mx.arange(self.offset, self.offset + N)[:, None]
        win = self.window if window_size is None else min(self.window, window_size)
        return (key_pos[None] <= q_pos) & ((key_pos[None] < self.n_sink) | (key_pos[None] > q_pos - win))

    @property
    def tokens_in_window(self) -> int:
        return self.rows

    @property
    def stream_kept_bytes(self) -> int:
        return self.nbytes
