"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069).

Attention is broad in the lower layers and concentrates on a few tokens in the upper ones, so lower
layers get larger KV budgets than upper ones. With ``m`` layers, an average budget ``b`` and
``s = b - (n_sink + window)`` selectable rows per layer, the top layer gets ``s / beta`` selectable rows,
the bottom layer ``2s - s / beta``, and the layers between follow the arithmetic sequence, so the budgets
sum to ``m * b`` (``pyramid_budgets``; ``build_layers`` gives each layer its budget; a single cache uses
``pyramid_resolved_budget`` if set, else ``budget``). Within a layer tokens are chosen as in SnapKV: the
last ``OBS_WINDOW`` queries vote with their softmax attention (summed over the window and over the query
heads of each KV head), the votes are smoothed by average pooling and each KV head keeps its top rows;
the window itself and the first ``n_sink`` tokens are always kept. Real queries, slack, spare rows,
``decode_evict`` and trim: ``eviction``'s module docstring.

Layers holding different row counts share mlx_lm's one mask per forward pass: every cache returns its
past rows (all visible) followed by the new ones, so the bottom-right-aligned ``"causal"`` mask is right
for every layer (array masks are rebuilt per layer, ``CompressedKVCache._own_mask``).

Deviations from the paper:
* The schedule is applied to the selectable rows, with the sinks and the window added to every layer
  (the released code likewise subtracts the window first); budgets are rounded so that they sum to
  exactly ``m * b`` and never increase with depth (the rounding's extra rows go to the lowest layers).
  ``beta`` must be >= 1 (1 is uniform); the paper uses 20, the default here is 2. The released code's
  shrinking of the schedule for prompts shorter than ``2 b`` is not reproduced.
* The paper compresses the prompt only; here decoding is compressed too (the default slack; the votes
  then come from the queries seen since the previous eviction), and ``decode_evict=False`` restores
  prompt-only compression. Prompts longer than one prefill chunk are compressed chunk by chunk.
* Sinks are an addition (``n_sink=0`` removes them). The pooling kernel is SnapKV's 7 (PyramidKV's
  release defaults to 5). ``backend`` is accepted and unused (one MLX implementation).
"""

from __future__ import annotations

import math

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...eviction import OBS_WINDOW, VotingEviction, check_min
from .snapkv import POOL_KERNEL, avg_pool_last


def pyramid_budgets(n_layers: int, budget: int, beta: float, protected: int) -> list[int]:
    """Per-layer budgets, bottom layer first: the arithmetic schedule on the selectable rows
    ``budget - protected`` (top ``s / beta``, bottom ``2 s - s / beta``), plus ``protected`` rows each.
    Integers, non-increasing with depth, summing to exactly ``n_layers * budget``."""
    s = budget - protected
    if n_layers == 1 or beta == 1:
        vals = [float(s)] * n_layers
    else:
        top = s / beta
        bottom = 2 * s - top
        vals = [bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers)]
    floors = [int(math.floor(v + 1e-9)) for v in vals]
    for i in range(n_layers * s - sum(floors)):  # < n_layers rows left by the rounding
        floors[i] += 1
    return [protected + f for f in floors]


@register_with_mlx_lm
@register("pyramidkv")
class PyramidKVCache(VotingEviction):
    """SnapKV-style observation-window eviction with a per-layer budget from the pyramid schedule."""
    chunk_invariant = False  # observation-window eviction per prefill chunk; batched (slack) decode eviction
    exact_trim = False  # decode rows add votes and evict (slack)

    def _init_layout(self):
        o, resolved = self.config.options, self.config.pyramid_resolved_budget
        self.n_sink = o.n_sink
        protected = self.n_sink + self.obs_window
        check_min("pyramid_budget", o.budget, protected + 1, f"pyramid_n_sink + {self.obs_window} + 1")
        if o.beta < 1:
            raise QuantizerConfigError("pyramid_beta", o.beta,
                                       "a number >= 1 (budgets decrease with depth; 1 is uniform)")
        if resolved is not None:
            check_min("pyramid_resolved_budget", resolved, protected, f"pyramid_n_sink + {self.obs_window}")
        self.budget = o.budget if resolved is None else resolved

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer, each with its budget from the schedule."""
        if not layer_configs:
            return []
        first = cls(layer_configs[0])  # validates the shared options
        o = layer_configs[0].options
        budgets = pyramid_budgets(len(layer_configs), o.budget, float(o.beta), first.n_sink + OBS_WINDOW)
        return [cls(cfg, budget=b) for cfg, b in zip(layer_configs, budgets)]

    def score(self, obs_queries, obs_positions, scale):
        return avg_pool_last(self.votes[:, :, : self.rows], POOL_KERNEL)

    pyramid_kept_bytes = VotingEviction.kept_bytes
