"""CurDKV (Sengupta, Chaudhary & Chakraborty, "Value-Guided KV Compression for LLMs via Approximated
CUR Decomposition", NeurIPS 2025, arXiv 2509.15038).

The attention output softmax(QK^T)V is what eviction must preserve, so CurDKV picks tokens the way a
CUR decomposition picks rows: by statistical leverage. The leverage of row i of a matrix X (M x c) at
rank r is the squared norm of row i of U_r, the top-r left singular vectors of X; rows with high
leverage span directions few other rows cover (an outlier value row has leverage near 1) and are the
rows a rank-r CUR approximation needs. Each KV head keeps the ``curdkv_budget`` rows with the highest
product of key-side and value-side leverage (the paper's default "kv product" rule), plus the first
``curdkv_n_sink`` tokens.

Leverage is computed exactly at rank r = min(``curdkv_rank_cap``, columns): the top-r eigenpairs of
the c x c Gram matrix X^T X give U_r = X V_r / sigma_r (one batched eigendecomposition per head, no
sampling), instead of the paper's Gaussian-sketch approximation.

Key side, real queries: with the attention dispatch point the key-side matrix is the attention the
last ``obs_window`` (32) real queries of the call (all query heads of the group) pay to each row,
i.e. the columns of softmax(QK^T) themselves, whose leverage is what the paper's key leverage
approximates. Fallback without the dispatch point: the leverage of the key rows (the paper's own,
query-agnostic score; no stand-in queries are needed).

Deviations from the paper:
* Exact truncated-SVD leverage (rank <= ``curdkv_rank_cap``) instead of a random projection, and no
  local-window normalisation of the scores.
* The real-query key side above (an addition; without dispatch the paper's key leverage is used).
* The paper compresses the prompt once; here decode-time eviction keeps memory bounded: the cache
  grows to ``budget + slack`` rows (the slack of ``eviction.py``) and is then re-scored (leverage
  over all held rows, the newest queries) and cut back to ``budget``.
* ``curdkv_rope_base`` is accepted for compatibility and unused (keys are scored as stored, after RoPE).
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, check_budget, default_slack
from ...attention import attention_logits

EIG_EPS = 1e-6  # singular directions below this fraction of the largest carry no leverage


def leverage_scores(x: mx.array, rank: int) -> mx.array:
    """Rank-``rank`` leverage of each row of ``x`` [..., M, c]: ||U_r[i]||^2, in [0, 1]. Returns [..., M]."""
    x = x.astype(mx.float32)
    r = max(1, min(rank, x.shape[-1], x.shape[-2]))
    evals, evecs = mx.linalg.eigh(x.swapaxes(-1, -2) @ x, stream=mx.cpu)  # ascending
    evals, evecs = evals[..., -r:], evecs[..., -r:]
    keep = evals > EIG_EPS * evals[..., -1:]
    inv = mx.where(keep, 1.0 / mx.maximum(evals, 1e-30), 0.0)
    proj = x @ evecs  # [..., M, r] = U_r * sigma_r
    return (proj * proj * inv[..., None, :]).sum(-1)


def attention_columns(obs_queries, keys, scale, obs_positions, key_positions):
    """[B, H, M, rep * W]: attention probabilities the observation queries give each key row (causal)."""
    logits = attention_logits(obs_queries, keys, scale)  # [B, H, rep, W, M]
    visible = key_positions[:, :, None, None, :] <= obs_positions[None, None, None, :, None]
    w = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    B, H, R, W, M = w.shape
    return w.transpose(0, 1, 4, 2, 3).reshape(B, H, M, R * W)


@register_with_mlx_lm
@register("curdkv")
class CurDKVKVCache(EvictionKVCache):
    """Eviction by CUR leverage: key-side (real attention) leverage x value leverage, per KV head."""
    chunk_invariant = False  # leverage eviction per prefill chunk; batched (slack) decode eviction
    exact_trim = False  # decode steps evict older rows (slack)

    _proxy_scoring = False

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.rank_cap = o.budget, o.n_sink, o.rank_cap
        self.recent, self.obs_window = 0, 32
        check_budget("curdkv_budget", self.budget, self.n_sink + self.recent, "n_sink + recent")
        self.slack = default_slack(self.budget)

    def wants_eviction(self, n_new):
        return self.rows > (self.budget if n_new > 1 else self.budget + self.slack)

    def _evict_with_proxy(self):
        self._proxy_scoring = True  # no real queries: use the paper's query-agnostic key leverage
        try:
            super()._evict_with_proxy()
        finally:
            self._proxy_scoring = False

    def score(self, obs_queries, obs_positions, scale):
        rows = self.rows
        keys, values = self.keys[:, :, :rows], self.values[:, :, :rows]
        if self._proxy_scoring:
            key_side = leverage_scores(keys, self.rank_cap)
        else:
            cols = attention_columns(obs_queries, keys, scale, obs_positions, self.positions[:, :, :rows])
            key_side = leverage_scores(cols, self.rank_cap)
        return key_side * leverage_scores(values, self.rank_cap)
