"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

After each prefill chunk, the last ``snap_obs_window`` queries of the prompt (the observation window)
vote for prefix tokens: their softmax attention weights are summed over the window and over the query
heads of each KV head, smoothed with a 1-D pooling (kernel 7, as in the paper's clustering step), and
each KV head keeps its own top tokens. The observation window itself and the first ``snap_n_sink``
tokens are always kept, so ``snap_budget`` rows remain. By default decode tokens are all kept (the
paper compresses the prompt only), so the cache grows by one row per generated token.

Decode-time budget (``decode_evict=True``; an extension, not in the paper): the cache keeps a ring
of the last ``snap_obs_window`` real queries (prompt and generated tokens alike, stored at 16 bits and
counted in ``nbytes``). When a decode step leaves more than ``snap_budget + slack`` rows
(the slack of ``eviction.py``), the ring is the observation window of a SnapKV pass over the
stored rows (same votes, pooling, sinks and protected window as at prefill), which cuts back to
``snap_budget``; so the top-k runs once per ``slack`` steps and at most ``budget + slack`` rows are
held. The eviction buffers keep ``slack + 1`` spare rows so the decode rows in between append in
place. Such a cache no longer trims exactly (older rows evicted while decoding are not restored).

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

from operator import attrgetter

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, default_slack, observation_scores
from ...primitives.buffers import grow_rows

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
    # with the default ``decode_evict=False`` decode rows are never evicted and add no statistics
    exact_trim = True
    decode_evict_default = False  # the paper compresses the prompt only

    # the query ring of the decode-time budget: ``qring`` [B, Hq, W, D], ``qring_pos`` [W] (-1: empty)
    array_fields = EvictionKVCache.array_fields + ("qring", "qring_pos")

    def _init_layout(self):
        o = self.config.options
        self.budget, self.obs_window, self.n_sink = o.budget, o.obs_window, o.n_sink
        self.recent = self.obs_window  # the observation window is always kept
        self.evict_slack = default_slack(self.budget)

    def wants_eviction(self, n_new):
        return self.rows > self.budget + (self.evict_slack if n_new == 1 else 0)

    # ---------------------------------------------------------------- decode-time budget
    def _remember_queries(self, queries):
        """Write this call's newest queries into the ring (slot = position mod W)."""
        W, N = self.obs_window, queries.shape[2]
        q = queries[:, :, -W:].astype(self.storage_dtype(queries.dtype))
        n = q.shape[2]
        start = self.offset - n  # position of q's first query
        if self.qring is None or self.qring.shape[:2] != q.shape[:2] or self.qring.shape[-1] != q.shape[-1]:
            self.qring = mx.zeros(q.shape[:2] + (W, q.shape[-1]), q.dtype)
            self.qring_pos = mx.full((W,), -1, mx.int32)
        slots = [(start + i) % W for i in range(n)]  # host ints from Python counters: no sync
        if n == 1:
            s = slots[0]
            self.qring[:, :, s : s + 1] = q
            self.qring_pos[s : s + 1] = mx.array([start], mx.int32)
        else:
            idx = mx.array(slots, mx.int32)
            self.qring[:, :, idx] = q
            self.qring_pos[idx] = mx.arange(start, start + n, dtype=mx.int32)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self.decode_evict:
            self._remember_queries(queries)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _evict_with_proxy(self):
        if self._n_new > 1:
            return super()._evict_with_proxy()
        # decode step without the dispatch point: the newest obs_window stored keys stand in
        w = min(self.obs_window, self.rows)
        obs = self.keys[:, :, self.rows - w : self.rows]
        obs_pos = mx.arange(self.offset - w, self.offset, dtype=mx.int32)
        self.evict(self.score(obs, obs_pos, obs.shape[-1] ** -0.5))

    def keep_rows(self, idx):
        if not self.decode_evict:
            return super().keep_rows(idx)
        # gather ``evict_slack + 1`` spare rows along (never read) so decode rows append in place
        pad = mx.zeros(idx.shape[:2] + (self.evict_slack + 1,), dtype=idx.dtype)
        super().keep_rows(mx.concatenate([idx, pad], axis=-1))
        self.rows = idx.shape[-1]

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        if self.qring_pos is not None:  # trimmed queries no longer vote
            self.qring_pos = mx.where(self.qring_pos >= self.offset - dropped, -1, self.qring_pos)
        return dropped

    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        if obs_queries.shape[2] == 1 and self.qring is not None:
            # a decode step: the ring's last W real queries are the observation window
            obs_queries, obs_positions = self.qring, self.qring_pos
        votes = observation_scores(obs_queries, self.keys[:, :, :rows], scale, obs_positions,
                                   self.positions[:, :, :rows])
        return avg_pool_last(votes, POOL_KERNEL)

    tokens_total = property(attrgetter("offset"))  # spec telemetry name

    @property
    def eviction_ratio(self) -> float:
        return self.offset / self.rows if self.rows else 1.0
