"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", arXiv
2406.02069): budgets shrink with depth. With ``m`` layers, average budget ``b`` and ``s = b - (n_sink + window)``
selectable rows, the top layer gets ``s / beta``, the bottom ``2s - s / beta``, the others the arithmetic sequence
(``pyramid_budgets``); within a layer SnapKV's pooled votes choose (``VotingEviction``).

Deviations: the schedule applies to the selectable rows (as the release), rounded to sum to ``m * b``, never
increasing with depth; ``beta >= 1`` (default 2, the paper's 20); no shrinking for prompts shorter than ``2 b``;
decoding is compressed too (``decode_evict=False``: prompt only), long prompts chunk by chunk; sinks are an
addition; pooling kernel 7 (the release: 5); ``backend`` is unused.
"""

from __future__ import annotations

import math

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import OBS_WINDOW, VotingEviction
from .snapkv import POOL_KERNEL, avg_pool_last


def pyramid_budgets(n_layers: int, budget: int, beta: float, protected: int) -> list[int]:
    """Per-layer budgets, bottom layer first: the schedule on ``budget - protected`` selectable rows
    plus ``protected`` each; integers, non-increasing, summing to exactly ``n_layers * budget``."""
    s = budget - protected
    top = s / beta if n_layers > 1 else float(s)
    bottom = 2 * s - top
    floors = [int(math.floor(bottom - (bottom - top) * i / max(n_layers - 1, 1) + 1e-9)) for i in range(n_layers)]
    rest = n_layers * s - sum(floors)  # < n_layers rows left by the rounding go to the bottom layers
    return [protected + f + (i < rest) for i, f in enumerate(floors)]


@register_with_mlx_lm
@register("pyramidkv")
class PyramidKVCache(VotingEviction):
    """SnapKV-style observation-window eviction with a per-layer budget from the pyramid schedule."""
    chunk_invariant, exact_trim = False, False  # votes per prefill chunk; decode rows vote, evict
    resolved_margin = 0  # a layer may keep only the sinks and the window

    @classmethod
    def build_layers(cls, layer_configs):
        if not layer_configs:
            return []
        first, o = cls(layer_configs[0]), layer_configs[0].options  # validates the shared options
        budgets = pyramid_budgets(len(layer_configs), o.budget, float(o.beta), first.n_sink + OBS_WINDOW)
        return [cls(cfg, budget=b) for cfg, b in zip(layer_configs, budgets)]

    def score(self, obs_queries, obs_positions, scale):
        return avg_pool_last(self.votes[:, :, : self.rows], POOL_KERNEL)

    pyramid_kept_bytes = VotingEviction.kept_bytes
