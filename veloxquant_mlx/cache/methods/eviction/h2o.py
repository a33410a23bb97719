"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048).

Every query's attention probabilities are added to a per-row score (the attention mass each cached
token has received so far, summed over the query heads of each KV head); when the cache is over
budget, each KV head keeps its highest-scoring rows (the "heavy hitters") plus the newest tokens.
Prefill chunks and decode steps go through the same accumulation, with the model's real queries when
the attention dispatch point is installed (keys stand in for queries without it).

Deviations from the paper:
* Recent window: the newest ``h2o_grace`` tokens are protected (the paper splits the budget half
  heavy hitters, half recent tokens); the first ``h2o_n_sink`` tokens are protected too (the paper
  has no sinks; ``h2o_n_sink=0`` removes them).
* ``h2o_decay`` multiplies every score by ``decay`` once per query before that query's mass is
  added (within a prefill chunk too, query by query), so old mass fades; the paper never decays
  (``h2o_decay=1.0`` reproduces it).
* ``decode_evict=False`` (not the paper) keeps every decode row: only the prompt is cut to the budget.
* Batched eviction (``BatchedEviction`` of ``eviction.py``, which documents the slack): the paper
  evicts one token per decode step; here decoding evicts once per ``evict_slack`` steps, so at most
  ``budget + evict_slack`` rows are held. A prefill chunk is cut to ``budget`` at once.
* ``h2o_rope_base`` is accepted and unused: keys are cached after RoPE at their original positions
  and ``offset`` stays the logical position, so nothing needs re-rotating.
* Trim drops the trimmed rows and their scores; the mass the trimmed queries added to the rows
  that remain is not subtracted (it only affects later eviction choices, never the attention over
  the held rows).
"""

from __future__ import annotations

from operator import attrgetter

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, check_budget, default_slack

@register_with_mlx_lm
@register("h2o")
class H2OKVCache(BatchedEviction, EvictionKVCache):
    """Heavy-hitter eviction: keep the rows with the most accumulated attention, per KV head."""
    chunk_invariant = False  # batched (slack) decode eviction; eviction at each prefill chunk
    exact_trim = False  # decode rows evict older rows and add attention mass

    array_fields = EvictionKVCache.array_fields + ("acc",)
    row_fields = ("acc",)
    uses_attention_weights = True

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.recent = o.budget, o.n_sink, o.grace
        self.decay = float(o.decay)
        self.rope_base = o.rope_base  # accepted, unused (see module docstring)
        check_budget("h2o_budget", self.budget, self.n_sink + self.recent, "h2o_n_sink + h2o_grace")
        self.evict_slack = default_slack(self.budget)

    def observe(self, weights):
        """weights [B, H, rep, N, rows]: add this call's attention mass, query by query with decay."""
        rows, n = self.rows, weights.shape[3]
        old = self.acc[:, :, :rows]
        if self.decay == 1.0:
            mass = weights.sum(axis=(2, 3))
        else:
            # query i of N is followed by N-1-i more decay steps within this call
            w = mx.power(mx.array(self.decay, mx.float32), mx.arange(n - 1, -1, -1, dtype=mx.float32))
            mass = (w[:, None] * weights).sum(axis=(2, 3))
            old = old * (self.decay**n)
        self.acc[:, :, :rows] = old + mass
        self.settle()

    def score(self, obs_queries, obs_positions, scale):
        return self.acc[:, :, : self.rows]

    h2o_kept_bytes = property(attrgetter("nbytes"))  # spec telemetry name
