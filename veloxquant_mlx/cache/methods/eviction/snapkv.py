"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469). After each
prefill chunk the last ``snap_obs_window`` queries vote (softmax weights summed over the window and each KV head's
query heads, pooled with kernel 7, the paper's clustering); each KV head keeps ``snap_budget`` rows: its top
tokens, the window and the first ``snap_n_sink`` (so ``snap_budget > snap_n_sink + snap_obs_window``). Decode
tokens are kept (the paper compresses the prompt only); ``decode_evict=True`` (an extension) keeps a ring of the
last ``snap_obs_window`` real queries (16-bit, in ``nbytes``) that votes whenever decoding passes ``budget +
slack`` rows; such a cache no longer trims exactly.

Deviations: average pooling (the release also has max); sinks are an addition (0 reproduces it); long prompts are
compressed chunk by chunk; ``snap_dtype`` / ``snap_backend`` / ``snap_batched_scoring`` are accepted, scoring
always runs batched in float32.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, check_min, default_slack, observation_scores

POOL_KERNEL = 7


def avg_pool_last(x: mx.array, kernel: int) -> mx.array:
    """Same-length average pooling along the last axis (zero padded, like the paper's pooling)."""
    if kernel <= 1:
        return x
    pad, n = kernel // 2, x.shape[-1]
    c = mx.cumsum(mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, kernel - 1 - pad)]), axis=-1)
    c = mx.pad(c, [(0, 0)] * (x.ndim - 1) + [(1, 0)])
    return (c[..., kernel : kernel + n] - c[..., :n]) / kernel


@register_with_mlx_lm
@register("snapkv")
class SnapKVKVCache(EvictionKVCache):
    """Prefill eviction by observation-window votes, per KV head."""
    chunk_invariant, exact_trim = False, True  # each chunk votes on its own; decode rows are kept
    decode_evict_default = False  # the paper compresses the prompt only
    # the query ring of the decode-time budget: ``qring`` [B, Hq, W, D], ``qring_pos`` [W] (-1: empty)
    array_fields = EvictionKVCache.array_fields + ("qring", "qring_pos")

    def _init_layout(self):
        """The options' budget, window and sinks; the budget must hold the sinks, the window (both always kept)
        and one row to choose, else ``QuantizerConfigError`` (it would keep an arbitrary part of the kept rows)."""
        o, f = self.config.options, type(self.config.options).FIELDS
        self.budget, self.obs_window, self.n_sink = o.budget, o.obs_window, o.n_sink
        self.recent = self.obs_window  # the observation window is always kept
        check_min(f["budget"], self.budget, self.n_sink + self.recent + 1, f"{f['n_sink']} + {f['obs_window']} + 1")
        self.evict_slack = default_slack(self.budget)

    def _remember_queries(self, queries):
        """Write this call's newest queries into the ring (slot = position mod W)."""
        W = self.obs_window
        q = queries[:, :, -W:].astype(self.storage_dtype(queries.dtype))
        if self.qring is None or self.qring.shape[:2] != q.shape[:2] or self.qring.shape[-1] != q.shape[-1]:
            self.qring = mx.zeros(q.shape[:2] + (W, q.shape[-1]), q.dtype)
            self.qring_pos = mx.full((W,), -1, mx.int32)
        pos = mx.arange(self.offset - q.shape[2], self.offset, dtype=mx.int32)
        if q.shape[2] == 1:  # decode: a slice write (a scatter costs ~3x on the CPU)
            s = (self.offset - 1) % W
            self.qring[:, :, s : s + 1], self.qring_pos[s : s + 1] = q, pos
        else:
            self.qring[:, :, pos % W], self.qring_pos[pos % W] = q, pos

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self.decode_evict:
            self._remember_queries(queries)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def keep_rows(self, idx):
        super().keep_rows(idx, self.evict_slack + 1 if self.decode_evict else 0)  # decode rows append in place

    def _trimmed(self, n):
        if self.qring_pos is not None:  # trimmed queries no longer vote
            self.qring_pos = mx.where(self.qring_pos >= self.offset - n, -1, self.qring_pos)

    def score(self, obs_queries, obs_positions, scale):
        if obs_queries.shape[2] == 1 and self.qring is not None:  # decode: the ring is the window
            obs_queries, obs_positions = self.qring, self.qring_pos
        rows = self.rows
        votes = observation_scores(obs_queries, self.keys[:, :, :rows], scale, obs_positions,
                                   self.positions[:, :, :rows])
        return avg_pool_last(votes, POOL_KERNEL)

    tokens_total = EvictionKVCache.tokens_seen  # spec telemetry names
    eviction_ratio = property(lambda self: self.offset / self.rows if self.rows else 1.0)
