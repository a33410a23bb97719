"""NestedKV ("NestedKV: Nested Memory Routing for Long-Context KV Cache Compression", arXiv 2605.26678). Only the
abstract was accessible (global, block-level and sliding-window key memories with routing, after Nested Learning's
Continuum Memory System): the formulas are **our own design**. Three memories score each held row of a KV head,
each as a rank in [0, 1]: current, ``cur``, the attention mass of recent queries decayed by 1 - 1/``nestedkv_window``
per query (the newest ``window`` tokens are kept verbatim); block, 1 - cos(k, mean key of its ``window``-position
block); global, 1 - cos(k, mean held key). A surprise gate g = sigmoid(``kappa`` (r_block - ``tau``)) and a per-head
blend lambda = sigmoid(``beta`` (1 - 2 H_norm)) (H_norm: normalised entropy of ``cur``) give ``score = lambda r_cur
+ (1 - lambda) (g max(r_global, r_block) + (1 - g) r_cur)``. The ceil(``safeguard_alpha`` (budget - n_sink -
window)) old rows of highest ``cur`` and the first ``nestedkv_n_sink`` tokens are always kept. Eviction runs after
every prefill chunk and, decoding, at ``budget + slack`` rows (also ours); trim keeps the trimmed queries' mass.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache
from .h2o import decayed_add


def rank01(x: mx.array) -> mx.array:
    """Rank of each entry along the last axis, scaled to [0, 1] (ties broken by position)."""
    return mx.argsort(mx.argsort(x, axis=-1), axis=-1).astype(mx.float32) / max(x.shape[-1] - 1, 1)


def _cos_distance(k: mx.array, centre: mx.array) -> mx.array:
    return 1.0 - (k * centre).sum(-1) / (mx.sqrt((k * k).sum(-1) * (centre * centre).sum(-1)) + 1e-12)


@register_with_mlx_lm
@register("nestedkv")
class NestedKVKVCache(EvictionKVCache):
    """Nested global / block / sliding-window memories with a surprise gate and an attention safeguard."""
    chunk_invariant, exact_trim = False, False  # evicts per prefill chunk; decode rows add mass, evict
    uses_attention_weights = True
    row_fields = ("cur",)
    array_fields = EvictionKVCache.array_fields + ("cur",)
    recent_option = "window"  # the sliding-window memory is kept verbatim

    def observe(self, weights, first=0, total=None):  # tiles in order: the decay carries over
        rows = weights.shape[4]
        self.cur[:, :, :rows] = decayed_add(self.cur[:, :, :rows], weights, 1.0 - 1.0 / self.recent)

    def score(self, obs_queries, obs_positions, scale):
        rows, o = self.rows, self.config.options
        k = self.keys[:, :, :rows].astype(mx.float32)
        pos, cur = self.positions[:, :, :rows], self.cur[:, :, :rows]
        block = pos // self.recent
        same = (block[..., :, None] == block[..., None, :]).astype(mx.float32)  # [B, H, rows, rows]
        r_block = rank01(_cos_distance(k, same @ k))
        r_global = rank01(_cos_distance(k, k.mean(axis=2, keepdims=True)))
        r_cur = rank01(cur)
        p = cur / mx.maximum(cur.sum(-1, keepdims=True), 1e-30)
        entropy = -(p * mx.log(mx.maximum(p, 1e-30))).sum(-1, keepdims=True) / math.log(max(rows, 2))
        lam = mx.sigmoid(o.beta * (1.0 - 2.0 * entropy))  # [B, H, 1]
        gate = mx.sigmoid(o.kappa * (r_block - o.tau))
        routed = gate * mx.maximum(r_global, r_block) + (1.0 - gate) * r_cur
        score = lam * r_cur + (1.0 - lam) * routed
        n_safe = math.ceil(o.safeguard_alpha * (self.budget - self.n_sink - self.recent))
        if n_safe > 0:  # safeguard: the highest-attention old rows are always kept
            old = mx.where(self.protected(), -mx.inf, cur)
            safe = rank01(old) * max(rows - 1, 1) >= rows - n_safe - 0.5
            score = mx.where(safe, mx.inf, score)
        return score
