"""K-norm eviction (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv
2406.11430): low-norm keys tend to draw high attention, so each KV head keeps the ``knorm_budget`` rows of lowest
post-RoPE key norm (``knorm_keep='high'``: highest, the paper's contrast). Query-free: it evicts in
``update_and_fetch`` and attention stays on MLX's fused kernel.

Deviations: the first ``knorm_n_sink`` and newest ``knorm_recent`` tokens are kept (0 and 0 reproduce the paper);
all layers are compressed (the paper skips two); decoding evicts in batches of ``evict_slack`` rows.
"""

from __future__ import annotations

from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache
from .chunkkv import key_norm_scores


@register_with_mlx_lm
@register("knorm")
class KNormKVCache(BatchedEviction, EvictionKVCache):
    """Keep the lowest-L2-norm keys of each KV head (query-free)."""
    chunk_invariant, exact_trim = False, False  # slack decode eviction; decode steps evict
    recent_option = "recent"

    def update_and_fetch(self, keys, values):
        out = CompressedKVCache.update_and_fetch(self, keys, values)
        if self._evicts_after(keys.shape[2]):  # no queries needed: never deferred to ``attend``
            self.evict(self.score(None, None, None))
        return out

    def score(self, obs_queries, obs_positions, scale):
        s = key_norm_scores(self.keys[:, :, : self.rows])  # minus the norm
        return s if self.config.options.keep == "low" else -s
