"""TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104): Token Omission Via Attention. Over
``tova_budget`` rows the row the current query attends to least (mean over the KV head's query heads, the paper's
GQA rule) is dropped, one per decode step (an argmin, ``evict_slack = 0``).

Deviations: the first ``tova_n_sink`` tokens are kept (0 reproduces the paper); a prefill chunk is cut at once by
its last query (the paper feeds one token at a time); ``decode_evict=False`` keeps decode rows; ``tova_backend``
is ignored (MLX, batched over heads).
"""

from __future__ import annotations

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, observation_scores


@register_with_mlx_lm
@register("tova")
class TOVAKVCache(BatchedEviction, EvictionKVCache):
    """Drop the row the current query attends to least (mean over each KV head's query heads)."""
    chunk_invariant, exact_trim = False, False  # a chunk is cut by its last query; decode steps evict
    uses_attention_weights = True
    obs_window = 1
    argmin_decode = True
    _current = None  # [B, H, rows] attention of this call's last query (transient)
    observed_fields = ("_current",)

    def _store(self, keys, values):
        self._current = None  # never score with a previous call's attention
        super()._store(keys, values)

    def observed_from(self, total):
        return total - 1

    def observe(self, weights, first=0, total=None):
        self._current = weights[:, :, :, -1, :].mean(axis=2)  # the last query, averaged over the group

    def score(self, obs_queries, obs_positions, scale):
        cur, self._current = self._current, None
        if cur is not None and cur.shape[-1] == self.rows:
            return cur
        # nothing observed for this call (e.g. attention with sinks): compute the last query's attention
        rows, rep = self.rows, obs_queries.shape[1] // self.keys.shape[1]
        return observation_scores(obs_queries[:, :, -1:], self.keys[:, :, :rows], scale, obs_positions[-1:],
                                  self.positions[:, :, :rows]) / rep

    tova_kept_bytes = EvictionKVCache.kept_bytes  # spec telemetry name
