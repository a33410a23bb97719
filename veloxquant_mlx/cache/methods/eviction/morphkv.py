"""MorphKV (Ghadia et al., "Dialogue Without Limits: Constant-Sized KV Caches for Extended Responses
in LLMs", ICML 2025, arXiv 2503.00979).

The cache holds the ``morphkv_window`` most recent tokens plus the older tokens that those recent
tokens' queries attend to most, and nothing else: after every step (prefill chunk or decode token)
each KV head is cut back to exactly ``morphkv_budget`` rows, so its size stays constant however long
the response grows. An older row's score is the attention it receives from the window's queries,
fused over the window and over the query heads sharing the KV head (GQA) by a sum (the paper's
``sum_fused``; set ``fusion = "max"`` for its ``max_fused``). The window's queries are the model's
real ones when the attention dispatch point is installed: the cache keeps the window's queries
(``queries``, ``query_positions``: ``window`` x query heads x head_dim values at 16 bits, counted in
``nbytes``) and rescores the stored rows with them at every eviction. Without the dispatch point the
window's keys stand in for its queries.

Deviations from the paper:
* Sinks: the first ``morphkv_n_sink`` tokens are never evicted (the paper has none;
  ``morphkv_n_sink=0`` reproduces it).
* The window's attention over the rows is recomputed from the kept queries at each eviction (the
  paper keeps the window's attention profiles: window x rows values per KV head, against
  window x group size x head_dim for the queries, fewer values once rows > group size x
  head_dim); the softmax is over the rows held now, so a row evicted since a window query
  ran no longer takes part in its normalisation.
* Trimming ``n`` tokens drops their queries too; until ``n`` new tokens arrive the window votes with
  fewer queries than a cache that never saw the trimmed tokens would.

Decode evicts exactly one row per step (argmin, no sort): the cost is one gather of the kept rows
and ``window`` query-key products per row, the same order as the attention itself.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, check_budget
from ...attention import attention_logits


@register_with_mlx_lm
@register("morphkv")
class MorphKVKVCache(BatchedEviction, EvictionKVCache):
    """Constant-size cache: recent window + the older rows the window attends to most."""
    chunk_invariant = False  # evicts after every call, by the window's queries
    exact_trim = False  # decode steps evict older rows

    array_fields = EvictionKVCache.array_fields + ("queries", "query_positions")
    evict_slack = 0
    fusion = "sum"
    _live = False  # True while ``attend`` (real queries) is evicting

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.window = o.budget, o.n_sink, o.window
        self.recent = self.obs_window = self.window
        check_budget("morphkv_budget", self.budget, self.n_sink + self.window, "morphkv_n_sink + morphkv_window")

    # ------------------------------------------------------------ the window's queries
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        n = queries.shape[2]
        keep = self.window
        q = queries[:, :, -keep:].astype(self.storage_dtype(queries.dtype))
        pos = mx.arange(self.offset - q.shape[2], self.offset, dtype=mx.int32)
        if self.queries is not None and n < keep and self.queries.shape[:2] == q.shape[:2]:
            # copies of the kept rows: a slice would keep the whole concatenation alive (one row more)
            q = mx.contiguous(mx.concatenate([self.queries, q], axis=2)[:, :, -keep:])
            pos = mx.arange(self.offset - q.shape[2], self.offset, dtype=mx.int32)  # queries come in position order
        self.queries, self.query_positions = q, pos
        self._live = True
        try:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        finally:
            self._live = False

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        if self.queries is not None:
            held = int(self.query_positions.shape[0])
            left = max(0, held - dropped)  # the trimmed tokens' queries are the newest ones
            if left == 0:
                self.queries = self.query_positions = None
            else:
                self.queries = mx.contiguous(self.queries[:, :, :left])
                self.query_positions = mx.array(self.query_positions[:left])
        return dropped

    # ------------------------------------------------------------ scoring
    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        if self._live:  # the newest ``window`` real queries
            q, q_pos = self.queries[:, :, -self.window :], self.query_positions[-self.window :]
        else:  # fallback: the window's keys stand in for its queries
            w = min(self.window, rows)
            q, q_pos = self.keys[:, :, rows - w : rows], mx.arange(self.offset - w, self.offset, dtype=mx.int32)
            scale = q.shape[-1] ** -0.5
        k_pos = self.positions[:, :, :rows]
        logits = attention_logits(q, self.keys[:, :, :rows], scale)  # [B, H, rep, W, rows]
        visible = k_pos[:, :, None, None, :] <= q_pos[None, None, None, :, None]
        weights = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
        if self.fusion == "max":
            return weights.max(axis=(2, 3))
        return weights.sum(axis=(2, 3))
