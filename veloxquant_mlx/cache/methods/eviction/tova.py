"""TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104): Token Omission Via
Attention.

The cache is a fixed-size multi-state: whenever it holds more than ``tova_budget`` rows, the rows
with the lowest attention from the *current* query are dropped, one per decode step. The attention
of a KV head is the mean over the query heads that share it (the paper's treatment of grouped-query
attention), so each KV head keeps its own rows. No history is accumulated: only the current query
decides. With the attention dispatch point installed the current query is the model's real query
(its probabilities are taken from the attention that was just computed, not recomputed); without it
the newest key stands in for it.

Deviations from the paper:
* Sinks: the first ``tova_n_sink`` tokens are never dropped (the paper has none; ``tova_n_sink=0``
  reproduces it).
* Prefill chunks are cut to the budget at once by the attention of the chunk's last query (the
  paper's multi-state view feeds tokens one at a time, dropping one per token).
* ``tova_backend`` is accepted for compatibility and ignored: scoring is MLX, batched over heads.

``decode_evict=False`` (not the paper) keeps every decode row and cuts only the prompt.
Decode evicts exactly one row per step (``evict_slack = 0``), with an argmin rather than a sort, so
the cache holds exactly ``tova_budget`` rows between steps; the per-step cost is one gather of the
kept rows, the same order of memory traffic as the attention itself.
"""

from __future__ import annotations

from operator import attrgetter

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, check_budget, observation_scores


@register_with_mlx_lm
@register("tova")
class TOVAKVCache(BatchedEviction, EvictionKVCache):
    """Drop the row the current query attends to least (mean over each KV head's query heads)."""
    # a prefill chunk is cut to the budget by its last query, decode drops one row per step
    chunk_invariant = False
    exact_trim = False  # decode steps evict older rows

    uses_attention_weights = True
    evict_slack = 0
    obs_window = 1
    _current = None  # [B, H, rows] attention of this call's last query (transient)

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.recent = o.budget, o.n_sink, 0
        self.backend = o.backend  # accepted, ignored
        check_budget("tova_budget", self.budget, self.n_sink, "tova_n_sink")

    def _store(self, keys, values):
        self._current = None  # never score with a previous call's attention
        super()._store(keys, values)

    def observe(self, weights):
        """weights [B, H, rep, N, rows]: keep the last query's row, averaged over the group."""
        self._current = weights[:, :, :, -1, :].mean(axis=2)

    def score(self, obs_queries, obs_positions, scale):
        cur = self._current
        self._current = None
        if cur is not None and cur.shape[-1] == self.rows:
            return cur
        # No probabilities were observed for this call (e.g. attention with sinks): compute the
        # current query's attention over the stored rows.
        rows = self.rows
        rep = obs_queries.shape[1] // self.keys.shape[1]
        return observation_scores(obs_queries[:, :, -1:], self.keys[:, :, :rows], scale, obs_positions[-1:],
                                  self.positions[:, :, :rows]) / rep

    tova_kept_bytes = property(attrgetter("nbytes"))  # spec telemetry name
