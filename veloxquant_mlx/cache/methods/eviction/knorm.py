"""K-norm eviction (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv 2406.11430).

The paper observes that keys with a low L2 norm tend to receive high attention, so each KV head keeps
the ``knorm_budget`` rows whose (post-RoPE, so position-independent) key norm is lowest and drops the
rest. The score needs no queries and no attention probabilities: it works the same with or without
the attention dispatch point, leaves attention to MLX's fused kernel, and evicts right inside
``update_and_fetch`` (after this call's rows were returned, so the mask still fits).
``knorm_keep='high'`` keeps the highest-norm keys instead (the paper's contrast experiment).

Deviations from the paper:
* Sinks and a recent window: the first ``knorm_n_sink`` tokens and the newest ``knorm_recent`` are
  never dropped (the paper has neither; set both to 0 to reproduce it).
* All layers are compressed; the paper leaves the first two layers uncompressed, where the
  norm/attention correlation is weak.
* Compression runs during decoding too, in batches of ``evict_slack`` rows (``eviction.py``). A row's
  score never changes, so the rows held right after each cut are exactly the lowest-norm rows among
  every unprotected token seen, as if one row had been dropped per step.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache, check_budget, default_slack


@register_with_mlx_lm
@register("knorm")
class KNormKVCache(BatchedEviction, EvictionKVCache):
    """Keep the lowest-L2-norm keys of each KV head (query-free)."""
    # batched (slack) decode eviction: after decode steps up to budget + slack rows are held
    chunk_invariant = False
    exact_trim = False  # decode steps evict older rows (slack)

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.recent = o.budget, o.n_sink, o.recent
        self.keep_which = o.keep
        check_budget("knorm_budget", self.budget, self.n_sink + self.recent, "knorm_n_sink + knorm_recent")
        self.evict_slack = default_slack(self.budget)

    def update_and_fetch(self, keys, values):
        out = CompressedKVCache.update_and_fetch(self, keys, values)
        if self._evicts_after(keys.shape[2]):  # no queries needed: never deferred to ``attend``
            self.evict(self.score(None, None, None))
        return out

    def score(self, obs_queries, obs_positions, scale):
        k = self.keys[:, :, : self.rows].astype(mx.float32)
        norm = mx.sqrt((k * k).sum(axis=-1))
        return -norm if self.keep_which == "low" else norm
