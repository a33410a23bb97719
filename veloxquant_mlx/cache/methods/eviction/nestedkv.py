"""NestedKV ("NestedKV: Nested Memory Routing for Long-Context KV Cache Compression", arXiv 2605.26678).

Only the paper's abstract was accessible: it describes a key-only method, inspired by the Continuum
Memory System of Nested Learning, that keeps *global*, *block-level* and *sliding-window* key
memories and routes tokens between them, because one importance signal fails when useful context is
globally distinctive, locally episodic or immediately relevant. The formulas below are therefore
**our own design** from that description and the option names; they are not the paper's.

Three nested memories score every held row of a KV head (each signal turned into a rank in [0, 1]):

* current (sliding window): ``cur``, the attention mass the row received from the most recent queries,
  exponentially windowed with horizon ``nestedkv_window`` (decay 1 - 1/window per query). Real queries
  through the attention dispatch point; the keys stand in for them without it (documented fallback).
  The newest ``nestedkv_window`` tokens themselves are always kept verbatim.
* block (episodic): 1 - cos(k, mean key of the row's block of ``window`` consecutive positions);
* global (stable): 1 - cos(k, mean of all held keys).

Routing: a per-token surprise gate g = sigmoid(``kappa`` * (r_block - ``tau``)) sends tokens that are
surprising inside their block to the long-term score max(r_global, r_block) and the others to the
current score. A per-head blend lambda = sigmoid(``beta`` * (1 - 2 * H_norm)), where H_norm is the
normalised entropy of the head's ``cur`` distribution, lets focused heads trust their attention and
diffuse heads lean on the key memories:

    score = lambda * r_cur + (1 - lambda) * (g * max(r_global, r_block) + (1 - g) * r_cur)

Safeguard: the ceil(``safeguard_alpha`` * (budget - n_sink - window)) old rows with the highest ``cur``
are always kept, whatever the key memories say. ``nestedkv_n_sink`` first tokens are kept too.

Memory: eviction runs after every prefill chunk (to ``budget`` rows) and, while decoding, whenever the
cache reaches ``budget + slack`` rows (the slack of ``eviction.py``), so memory stays bounded (the
decode-time part is ours too).

``trim`` drops the held rows of the trimmed tokens; the running statistic keeps the trimmed queries'
contributions, and rows evicted while they were decoded are not restored (``exact_trim = False``).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, check_budget, default_slack


def rank01(x: mx.array) -> mx.array:
    """Rank of each entry along the last axis, scaled to [0, 1] (ties broken by position)."""
    n = x.shape[-1]
    r = mx.argsort(mx.argsort(x, axis=-1), axis=-1).astype(mx.float32)
    return r / max(n - 1, 1)


def _cos_distance(k: mx.array, centre: mx.array) -> mx.array:
    num = (k * centre).sum(-1)
    den = mx.sqrt((k * k).sum(-1) * (centre * centre).sum(-1)) + 1e-12
    return 1.0 - num / den


@register_with_mlx_lm
@register("nestedkv")
class NestedKVKVCache(EvictionKVCache):
    """Nested global / block / sliding-window memories with a surprise gate and an attention safeguard."""
    chunk_invariant = False  # eviction per prefill chunk; batched (slack) decode eviction
    exact_trim = False  # decode rows add attention statistics and evict (slack)

    uses_attention_weights = True
    row_fields = ("cur",)
    array_fields = EvictionKVCache.array_fields + ("cur",)

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.window = o.budget, o.n_sink, o.window
        self.beta, self.tau, self.kappa, self.alpha = o.beta, o.tau, o.kappa, o.safeguard_alpha
        self.recent = self.window  # the sliding-window memory is kept verbatim
        check_budget("nestedkv_budget", self.budget, self.n_sink + self.recent, "n_sink + recent")
        self.decay = 1.0 - 1.0 / self.window
        self.slack = default_slack(self.budget)

    def wants_eviction(self, n_new):
        return self.rows > (self.budget if n_new > 1 else self.budget + self.slack)

    def observe(self, weights):
        """cur <- cur * decay^N + sum_j decay^(N-1-j) * (attention of query j, summed over the group)."""
        n, rows = weights.shape[3], weights.shape[4]
        w = self.decay ** mx.arange(n - 1, -1, -1, dtype=mx.float32)
        mass = (weights.sum(axis=2) * w[:, None]).sum(axis=2)  # [B, H, rows]
        self.cur[:, :, :rows] = self.cur[:, :, :rows] * (self.decay**n) + mass

    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        k = self.keys[:, :, :rows].astype(mx.float32)
        pos, cur = self.positions[:, :, :rows], self.cur[:, :, :rows]
        block = pos // self.window
        same = (block[..., :, None] == block[..., None, :]).astype(mx.float32)  # [B, H, rows, rows]
        r_block = rank01(_cos_distance(k, same @ k))
        r_global = rank01(_cos_distance(k, k.mean(axis=2, keepdims=True)))
        r_cur = rank01(cur)
        p = cur / mx.maximum(cur.sum(-1, keepdims=True), 1e-30)
        entropy = -(p * mx.log(mx.maximum(p, 1e-30))).sum(-1, keepdims=True) / math.log(max(rows, 2))
        lam = mx.sigmoid(self.beta * (1.0 - 2.0 * entropy))  # [B, H, 1]
        gate = mx.sigmoid(self.kappa * (r_block - self.tau))
        routed = gate * mx.maximum(r_global, r_block) + (1.0 - gate) * r_cur
        score = lam * r_cur + (1.0 - lam) * routed
        n_safe = math.ceil(self.alpha * (self.budget - self.n_sink - self.recent))
        if n_safe > 0:  # safeguard: the highest-attention old rows are always kept
            old = mx.where(self.protected(), -mx.inf, cur)
            safe = rank01(old) * max(rows - 1, 1) >= rows - n_safe - 0.5
            score = mx.where(safe, mx.inf, score)
        return score
