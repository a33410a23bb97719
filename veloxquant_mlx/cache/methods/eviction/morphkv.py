"""MorphKV (Ghadia et al., "Dialogue Without Limits: Constant-Sized KV Caches for Extended Responses in LLMs",
ICML 2025, arXiv 2503.00979). Each KV head holds the ``morphkv_window`` newest tokens plus the older ones their
queries attend to most, cut back to exactly ``morphkv_budget`` rows after every call (an argmin per decode step);
a row's score is the window queries' attention summed (``fusion = "max"``: maxed) over the window and the query
heads. The window's real queries are kept (16-bit, in ``nbytes``); without the dispatch point its keys stand in.

Deviations: the first ``morphkv_n_sink`` tokens are kept (0 reproduces it); the window's attention is recomputed
from the kept queries at each eviction (the paper keeps attention profiles), so the softmax covers only the rows
held now; a trim drops its tokens' queries too.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, causal_weights


@register_with_mlx_lm
@register("morphkv")
class MorphKVKVCache(BatchedEviction, EvictionKVCache):
    """Constant-size cache: recent window + the older rows the window attends to most."""
    chunk_invariant, exact_trim = False, False  # evicts after every call; decode steps evict
    array_fields = EvictionKVCache.array_fields + ("queries", "query_positions")
    fusion = "sum"
    recent_option = "window"
    argmin_decode = True

    def _init_layout(self):
        super()._init_layout()
        self.window = self.obs_window = self.recent

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        keep = self.window
        q = queries[:, :, -keep:].astype(self.storage_dtype(queries.dtype))
        if self.queries is not None and queries.shape[2] < keep and self.queries.shape[:2] == q.shape[:2]:
            # copies of the kept rows: a slice would keep the whole concatenation alive (one row more)
            q = mx.contiguous(mx.concatenate([self.queries, q], axis=2)[:, :, -keep:])
        self.queries = q
        # in order (an arange: built from a host list of the window's positions it cost 15% on an H100)
        self.query_positions = mx.arange(self.offset - q.shape[2], self.offset, dtype=mx.int32)
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        return mx.depends(out, q)  # the kept window is copied with the layer: left lazy it held all the queries

    def _trimmed(self, n):
        if self.queries is not None:
            left = max(0, self.query_positions.shape[0] - n)  # the trimmed queries are the newest
            self.queries = mx.contiguous(self.queries[:, :, :left]) if left else None
            self.query_positions = mx.array(self.query_positions[:left]) if left else None

    def score(self, obs_queries, obs_positions, scale):  # (from ``attend``) the newest ``window`` real queries
        return self._fused(self.queries[:, :, -self.window :], self.query_positions[-self.window :], scale)

    def _evict_with_proxy(self):  # the window's keys stand in for its queries
        w = min(self.window, self.rows)
        q = self.keys[:, :, self.rows - w : self.rows]
        self.evict(self._fused(q, mx.arange(self.offset - w, self.offset, dtype=mx.int32), q.shape[-1] ** -0.5))

    def _fused(self, q, q_pos, scale):
        weights = causal_weights(q, self.keys[:, :, : self.rows], scale, q_pos, self.positions[:, :, : self.rows])
        return weights.max(axis=(2, 3)) if self.fusion == "max" else weights.sum(axis=(2, 3))
