"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048): each row accumulates the attention mass every query gives it (summed over the KV head's query
heads); over budget, each KV head keeps its heavy hitters plus the newest tokens (shared behaviour: ``eviction``).

Deviations: the newest ``h2o_grace`` tokens are protected (the paper: half the budget), the first ``h2o_n_sink``
too (an addition); ``h2o_decay`` scales every score once per query (1.0: the paper's none); ``decode_evict=False``
keeps decode rows, decoding evicts once per ``evict_slack`` steps; ``h2o_rope_base`` is unused (keys are cached
after RoPE); trim keeps the trimmed queries' mass.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import BatchedEviction, EvictionKVCache


def decayed_add(acc: mx.array, weights: mx.array, decay: float) -> mx.array:
    """``acc`` [B, H, rows] decayed once per query of ``weights`` [B, H, rep, N, rows], plus their mass (query
    j of N decayed ``N - 1 - j`` times)."""
    n = weights.shape[3]
    if decay == 1.0 or n == 1:  # (the paper's H2O; a decode step): no per-query factors
        return (acc if decay == 1.0 else acc * decay) + weights.sum(axis=(2, 3))
    per_query = (decay ** mx.arange(n - 1, -1, -1, dtype=mx.float32))[None]  # [1, N]: a matmul, no [N, rows] copy
    return acc * decay**n + (per_query @ weights).sum(axis=(2, 3))


@register_with_mlx_lm
@register("h2o")
class H2OKVCache(BatchedEviction, EvictionKVCache):
    """Heavy-hitter eviction: keep the rows with the most accumulated attention, per KV head."""
    chunk_invariant, exact_trim = False, False  # evicts per prefill chunk; decode rows add mass, evict
    array_fields = EvictionKVCache.array_fields + ("acc",)
    row_fields = ("acc",)
    score_field = "acc"
    uses_attention_weights = True
    recent_option = "grace"

    def observe(self, weights, first=0, total=None):  # tiles in order: the decay carries over
        rows = self.rows
        self.acc[:, :, :rows] = decayed_add(self.acc[:, :, :rows], weights, float(self.config.options.decay))
        self.settle()

    h2o_kept_bytes = EvictionKVCache.kept_bytes  # spec telemetry name
