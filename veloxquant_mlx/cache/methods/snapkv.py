"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

After each prefill chunk, the last ``snap_obs_window`` queries of the prompt (the observation window)
vote for prefix tokens: their softmax attention weights are summed over the window and over the query
heads of each KV head, smoothed with a 1-D pooling (kernel 7, as in the paper's clustering step), and
each KV head keeps its own top tokens. The observation window itself and the first ``snap_n_sink``
tokens are always kept, so ``snap_budget`` rows remain. Decode tokens are all kept (the paper
compresses the prompt only), so the cache grows by one row per generated token.

Real queries: with the attention dispatch point installed (``KVCacheBuilder.for_model`` installs it)
the votes come from the model's own queries; without it, the window's keys stand in for queries.

Deviations from the paper:
* Pooling is average pooling with a kernel of 7 (the paper's released code also uses max pooling as
  an option); sinks are an addition (the paper keeps no sinks; ``snap_n_sink=0`` reproduces it).
* Prompts longer than one prefill chunk are compressed chunk by chunk, each chunk's last queries
  voting over everything kept so far (the paper sees the whole prompt at once).
* ``snap_dtype`` / ``snap_backend`` / ``snap_batched_scoring`` are accepted for compatibility; scoring
  always runs batched over heads in float32.
"""

from __future__ import annotations

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..eviction import EvictionKVCache, observation_scores

POOL_KERNEL = 7


def avg_pool_last(x: mx.array, kernel: int) -> mx.array:
    """Same-length average pooling along the last axis (zero padded, like the paper's pooling)."""
    if kernel <= 1:
        return x
    pad = kernel // 2
    padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, kernel - 1 - pad)])
    c = mx.cumsum(padded, axis=-1)
    c = mx.pad(c, [(0, 0)] * (x.ndim - 1) + [(1, 0)])
    n = x.shape[-1]
    return (c[..., kernel : kernel + n] - c[..., :n]) / kernel


@register_with_mlx_lm
@register("snapkv")
class SnapKVKVCache(EvictionKVCache):
    """Prefill eviction by observation-window votes, per KV head."""
    chunk_invariant = False  # each prefill chunk evicts, voted by its own last queries
    exact_trim = True  # decode rows are never evicted and add no statistics

    def _init_layout(self):
        c = self.config
        self.budget, self.obs_window, self.n_sink = c.snap_budget, c.snap_obs_window, c.snap_n_sink
        self.recent = self.obs_window  # the observation window is always kept

    def wants_eviction(self, n_new):
        return n_new > 1 and self.rows > self.budget

    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        votes = observation_scores(obs_queries, self.keys[:, :, :rows], scale, obs_positions,
                                   self.positions[:, :, :rows])
        return avg_pool_last(votes, POOL_KERNEL)

    @property
    def tokens_total(self) -> int:
        return self.offset

    @property
    def eviction_ratio(self) -> float:
        return self.offset / self.rows if self.rows else 1.0
