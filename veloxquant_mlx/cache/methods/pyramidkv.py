"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069).

Attention is broad in the lower layers and concentrates on a few tokens in the upper ones, so lower
layers get larger KV budgets than upper ones. With ``m`` layers, an average budget ``b`` and
``s = b - (n_sink + window)`` selectable rows per layer, the top layer gets ``s / beta`` selectable rows,
the bottom layer ``2s - s / beta``, and the layers between follow the arithmetic sequence, so the budgets
sum to ``m * b`` (``pyramid_budgets``; ``build_layers`` writes each layer's budget into
``pyramid_resolved_budget``; a single cache built without it uses ``pyramid_budget``). Within a layer
tokens are chosen as in SnapKV: the last ``OBS_WINDOW`` queries vote with their softmax attention
(summed over the window and over the query heads of each KV head), the votes are smoothed by average
pooling and each KV head keeps its top rows; the window itself and the first ``pyramid_n_sink`` tokens
are always kept.

Layers holding different row counts share mlx_lm's one mask per forward pass: every cache of this
library returns its past rows (all visible) followed by the new ones, so the bottom-right-aligned
``"causal"`` mask (or ``None`` for one query) is right for every layer, and array masks are rebuilt per
layer (``CompressedKVCache._own_mask``).

Deviations from the paper:
* The schedule is applied to the selectable rows, with the sinks and the window added to every layer
  (the released code likewise subtracts the window first); budgets are rounded so that they sum to
  exactly ``m * b`` and never increase with depth (the extra rows of the rounding go to the lowest
  layers). ``beta`` must be >= 1 (``beta = 1`` is uniform); the paper uses ``beta = 20``, the
  default here is 2. The released code's shrinking of the schedule for prompts shorter than ``2 b`` is
  not reproduced.
* ``decode_evict=False`` restores the paper's prompt-only compression (decode rows are all kept).
* The paper compresses the prompt only. Here decoding is compressed too, so memory stays bounded: the
  cache may grow by ``evict_slack`` rows (``max(8, budget // 8)``) during decoding, then
  evicts back to its budget; the votes then come from the queries seen since the previous eviction
  (the newest ``evict_slack + 1`` queries, a decode-time observation window). Prompts longer than one
  prefill chunk are compressed chunk by chunk, each chunk's last queries voting.
* Sinks are an addition (the paper keeps none; ``pyramid_n_sink=0`` removes them). The pooling kernel
  is the SnapKV module's 7 (PyramidKV's release defaults to 5).
* ``pyramid_backend`` is accepted and unused (one MLX implementation).

This module also holds ``VotingEviction``, the layer the four layer-budget methods of this group
(PyramidKV, SqueezeAttention, ChunkKV, CaM) share on top of ``EvictionKVCache``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..eviction import SETTLE_EVERY, EvictionKVCache, check_min, default_slack
from .snapkv import POOL_KERNEL, avg_pool_last

OBS_WINDOW = 32  # observation window (queries that vote) and protected recent window, in tokens
class VotingEviction(EvictionKVCache):
    """``EvictionKVCache`` plus what the layer-budget methods share.

    * ``votes`` [B, H, capacity] float32, a per-row field: the attention mass each row received.
      ``observe`` adds the probabilities of the last ``obs_window`` queries of each call
      (``vote_all_queries = False``, SnapKV-style windows; the votes are reset after each eviction so
      the next eviction counts only newer queries) or of every query (``True``, H2O-style accumulation,
      never reset). With the dispatch point they come from the model's real queries, without it from
      the new keys standing in for queries (the base's documented fallback).
    * Batched decode eviction: after a one-row call the cache waits until more than
      ``budget + evict_slack`` rows are held; after a multi-row call it cuts to ``budget`` at once.
    * ``keep_rows`` gathers spare rows along (up to ``budget + evict_slack + 1``), so the decode rows up
      to the next eviction append in place (no re-allocation); ``nbytes`` counts them (they are held).
    """

    array_fields = EvictionKVCache.array_fields + ("votes",)
    row_fields = ("votes",)
    uses_attention_weights = True
    obs_window = OBS_WINDOW
    recent = OBS_WINDOW
    vote_all_queries = False
    _unsettled = 0

    @property
    def evict_slack(self) -> int:
        return default_slack(self.budget)

    # ---------------------------------------------------------------- scoring
    def observe(self, weights):
        w = weights if self.vote_all_queries else weights[..., -self.obs_window :, :]
        n = self.rows
        self.votes[:, :, :n] = self.votes[:, :, :n] + w.sum(axis=(2, 3))
        self._settle()

    def _settle(self):
        """Votes are not needed for the logits, so nothing evaluates them between evictions: schedule
        them (no host sync) every ``SETTLE_EVERY`` calls so the lazy graph stays bounded."""
        self._unsettled += 1
        if self._unsettled >= SETTLE_EVERY:
            mx.async_eval([getattr(self, n) for n in self.row_fields])
            self._unsettled = 0

    def score(self, obs_queries, obs_positions, scale):
        return self.votes[:, :, : self.rows]

    def wants_eviction(self, n_new: int) -> bool:
        return self.rows > self.budget + (self.evict_slack if n_new == 1 else 0)

    # ---------------------------------------------------------------- storage
    def keep_rows(self, idx):
        spare = max(self.budget - idx.shape[-1], 0) + self.evict_slack + 1  # room up to the next eviction
        pad = mx.zeros(idx.shape[:2] + (spare,), dtype=idx.dtype)
        super().keep_rows(mx.concatenate([idx, pad], axis=-1))
        self.rows = idx.shape[-1]
        if not self.vote_all_queries:
            self.votes = mx.zeros_like(self.votes)
        self._unsettled = 0

    # ---------------------------------------------------------------- telemetry
    @property
    def layer_budget(self) -> int:
        return self.budget

    @property
    def kept_bytes(self) -> int:
        return self.nbytes

    @property
    def compression_ratio(self) -> float:
        """fp16 bytes of every token seen / bytes held (> 1 means memory saved)."""
        return self.full_seq_bytes / self.nbytes if self.nbytes else 1.0


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
        c = self.config
        self.n_sink = c.pyramid_n_sink
        protected = self.n_sink + self.obs_window
        check_min("pyramid_budget", c.pyramid_budget, protected + 1, f"pyramid_n_sink + {self.obs_window} + 1")
        if c.pyramid_beta < 1:
            raise QuantizerConfigError("pyramid_beta", c.pyramid_beta,
                                       "a number >= 1 (budgets decrease with depth; 1 is uniform)")
        self.budget = c.pyramid_budget if c.pyramid_resolved_budget is None else c.pyramid_resolved_budget
        check_min("pyramid_resolved_budget" if c.pyramid_resolved_budget is not None else "pyramid_budget",
                  self.budget, protected, f"pyramid_n_sink + {self.obs_window}")

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer, each with its ``pyramid_resolved_budget`` from the schedule."""
        if not layer_configs:
            return []
        c = layer_configs[0]
        cls(c)  # validates the shared fields
        budgets = pyramid_budgets(len(layer_configs), c.pyramid_budget, float(c.pyramid_beta),
                                  c.pyramid_n_sink + OBS_WINDOW)
        return [cls(cfg.replace(pyramid_resolved_budget=b)) for cfg, b in zip(layer_configs, budgets)]

    def score(self, obs_queries, obs_positions, scale):
        return avg_pool_last(self.votes[:, :, : self.rows], POOL_KERNEL)

    @property
    def pyramid_kept_bytes(self) -> int:
        return self.nbytes
