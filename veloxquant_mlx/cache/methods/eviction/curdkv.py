"""CurDKV (Sengupta, Chaudhary & Chakraborty, "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition", NeurIPS 2025, arXiv 2509.15038): tokens are picked as CUR picks rows, by leverage (squared row
norms of the top-r left singular vectors). Each KV head keeps the ``curdkv_budget`` rows of highest key-side x
value-side leverage (the paper's "kv product") plus the first ``curdkv_n_sink``; the key side is the leverage of
the attention columns the call's last 32 real queries give each row, else (no dispatch point) the keys' own.

Deviations: exact rank-``curdkv_rank_cap`` leverage from the eigenpairs of X^T X (the paper: a Gaussian sketch),
no local-window normalisation; the real-query key side is an addition; decoding evicts too (grow to ``budget +
slack``, rescore, cut back); ``curdkv_rope_base`` is unused.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, causal_weights

EIG_EPS = 1e-6  # singular directions below this fraction of the largest carry no leverage


def leverage_scores(x: mx.array, rank: int) -> mx.array:
    """Rank-``rank`` leverage ||U_r[i]||^2 in [0, 1] of each row of ``x`` [..., M, c]: [..., M]."""
    x = x.astype(mx.float32)
    r = max(1, min(rank, x.shape[-1], x.shape[-2]))
    evals, evecs = mx.linalg.eigh(x.swapaxes(-1, -2) @ x, stream=mx.cpu)  # ascending
    evals, evecs = evals[..., -r:], evecs[..., -r:]
    inv = mx.where(evals > EIG_EPS * evals[..., -1:], 1.0 / mx.maximum(evals, 1e-30), 0.0)
    proj = x @ evecs  # [..., M, r] = U_r * sigma_r
    return (proj * proj * inv[..., None, :]).sum(-1)


@register_with_mlx_lm
@register("curdkv")
class CurDKVKVCache(EvictionKVCache):
    """Eviction by CUR leverage: key-side (real attention) leverage x value leverage, per KV head."""
    chunk_invariant, exact_trim = False, False  # evicts per prefill chunk; decode steps evict (slack)

    def _leverage(self, key_side: mx.array) -> mx.array:
        r = self.config.options.rank_cap
        return leverage_scores(key_side, r) * leverage_scores(self.values[:, :, : self.rows], r)

    def _evict_with_proxy(self):  # no real queries: the paper's query-agnostic key leverage
        self.evict(self._leverage(self.keys[:, :, : self.rows]))

    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        w = causal_weights(obs_queries, self.keys[:, :, :rows], scale, obs_positions, self.positions[:, :, :rows])
        B, H, R, W, M = w.shape  # key side: the attention columns [B, H, M, rep * W] of the observation queries
        return self._leverage(w.transpose(0, 1, 4, 2, 3).reshape(B, H, M, R * W))
