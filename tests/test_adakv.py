"""adakv = MiKV-style importance-aware mixed precision (arXiv 2402.18096) on KIVI's per-channel keys. The defining
property: at the same bytes (the same tiers, the same arrays), giving the important tokens the high widths beats
an importance-blind allocation of the same widths, for the attention the model computes. The data have the
heavy-tailed importance of real attention: a few tokens whose keys point along the queries' direction, with
log-normal strength, draw most of the attention. The shared contract (dispatch == dense, state, trim, bytes
budget, ...) is in test_quant_contract.py, the tier bookkeeping in test_quant_mixed.py."""

from __future__ import annotations

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import dispatch

from contract_table import make

B, H, HQ, D, T = 1, 2, 6, 64, 512


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(5)


def heavy_tailed(n_queries):
    """Keys / values with 8% salient tokens (key component along the query direction u, log-normal strength);
    queries along u plus noise, so attention mass is concentrated and heavy-tailed."""
    u = mx.random.normal((B, H, 1, D))
    u = u / mx.linalg.norm(u, axis=-1, keepdims=True)
    salient = mx.random.uniform(shape=(B, H, T, 1)) < 0.08
    strength = mx.exp(0.8 * mx.random.normal((B, H, T, 1)) + 1.2)
    k = mx.random.normal((B, H, T, D)) + mx.where(salient, strength, 0.0) * u
    v = mx.random.normal((B, H, T, D))
    uq = mx.repeat(u, HQ // H, axis=1)
    q = 3.0 * uq + 0.5 * mx.random.normal((B, HQ, n_queries, D))
    return k, v, q


def out_err(cache, q, k, v):
    """Mean squared error of the attention output of queries ``q`` over the stored form vs the exact rows."""
    dk, dv = cache._dense()
    scale = D ** -0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)
    out = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=scale, mask=None)
    return float(mx.mean((out - ref) ** 2))


def filled(importance, allocation, k, v, q_prompt):
    dispatch.install()  # attend re-ranks the stored groups only where the dispatch point routes attention
    c = make("adakv", importance=importance)
    c.allocation = allocation
    K, V = c.update_and_fetch(k, v)
    if importance == "attention":  # the prompt's real queries, through the dispatch point
        dispatch.dispatched_sdpa(q_prompt, K, V, cache=c, scale=D ** -0.5, mask="causal")
        assert c._pending is None  # the rows kept for re-ranking are dropped by attend
    assert c.n_quant == T
    return c


@pytest.mark.parametrize("importance", ["attention", "norm_variance", "norm"])
def test_importance_aware_beats_uniform_allocation_at_equal_bytes(importance):
    k, v, q_prompt = heavy_tailed(T)
    q_new = heavy_tailed(16)[2]  # later queries of the same distribution
    imp, uni = (filled(importance, a, k, v, q_prompt) for a in ("importance", "uniform"))
    assert imp.nbytes == uni.nbytes and imp.used_nbytes == uni.used_nbytes  # the same bytes
    assert imp.realized_avg_bits == uni.realized_avg_bits == 2.5
    e_imp, e_uni = out_err(imp, q_new, k, v), out_err(uni, q_new, k, v)
    assert e_imp < 0.7 * e_uni, (importance, e_imp, e_uni)


def test_attention_importance_ranks_by_the_observed_queries():
    """With 'attention' the tokens the observation window's queries attend to most are in the high tier (the
    rank order stored per group), and the ranking differs from the query-free fallback."""
    k, v, q_prompt = heavy_tailed(T)
    c = filled("attention", "importance", k, v, q_prompt)
    W = c.config.adakv_obs_window
    qo = q_prompt[:, :, -W:].reshape(B, H, HQ // H, W, D) * D ** -0.5
    seen = mx.arange(T)[None, :] <= (T - W + mx.arange(W))[:, None]  # causal: [W, T]
    p = mx.softmax(mx.where(seen, qo @ k[:, :, None].swapaxes(-1, -2), -mx.inf), axis=-1).sum(axis=(2, 3))
    p = p / seen.sum(axis=0)  # mean attention per observation (a token late in the window is seen less)
    order = c.order[:, :, :T].astype(mx.int32).reshape(B, H, T // 32, 32)
    ranked = mx.take_along_axis(p.reshape(B, H, T // 32, 32), order, axis=-1)
    n_hi = c.counts["hi"] + c.counts["mid"]  # the widths above lo (2.5 bits: 16 tokens at 3 bits)
    # every high-tier token got at least the attention of every low-tier token of its group
    assert bool(mx.all(ranked[..., :n_hi].min(axis=-1) >= ranked[..., n_hi:].max(axis=-1) - 1e-6))
    fallback = make("adakv", importance="attention")
    fallback.update_and_fetch(k, v)  # no queries seen: the norm_variance ranking
    assert fallback._pending is not None  # held for attend, and dropped by it (dispatch installed)
    dispatch.uninstall()
    unseen = make("adakv", importance="attention")
    unseen.update_and_fetch(k, v)
    assert unseen._pending is None  # without the dispatch point nothing waits for an attend that never comes
    assert not bool(mx.array_equal(fallback.order[:, :, :T], c.order[:, :, :T]))


def test_attention_importance_accumulates_over_decode_steps():
    """Decode steps observe the residual rows; the group a step completes is ranked by the attention its
    tokens received over the steps they waited (mean per observation), and the score buffers are counted."""
    k, v, q = heavy_tailed(T)
    dispatch.install()
    c = make("adakv", importance="attention")
    K, V = c.update_and_fetch(k[:, :, :480], v[:, :, :480])
    dispatch.dispatched_sdpa(q[:, :, :480], K, V, cache=c, scale=D ** -0.5, mask="causal")
    for t in range(480, T):
        K, V = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        dispatch.dispatched_sdpa(q[:, :, t : t + 1], K, V, cache=c, scale=D ** -0.5, mask=None)
    assert (c.n_quant, c.n_res) == (T, 0)
    order = c.order[:, :, 480:T].astype(mx.int32)
    salient_first = mx.take_along_axis((k[:, :, 480:T] @ mx.mean(q, axis=(1, 2))[:, None, :, None])[..., 0],
                                       order, axis=-1)
    # the high tier holds the tokens the decode queries align with most
    n_hi = c.counts["hi"] + c.counts["mid"]  # the widths above lo (2.5 bits: 16 tokens at 3 bits)
    assert float(mx.mean(salient_first[..., :n_hi])) > float(mx.mean(salient_first[..., n_hi:]))
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) and c.res_score is not None
