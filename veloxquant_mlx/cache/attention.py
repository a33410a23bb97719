"""Attention helpers shared by caches that compute attention themselves (dispatch point).

All of them take mlx_lm's layouts: queries [B, Hq, N, D], keys/values [B, H, M, D] with Hq a
multiple of H (grouped-query attention), and mlx_lm's mask conventions (None, "causal" meaning
bottom-right aligned, or a boolean/additive array broadcastable to [B, Hq, N, M]).
"""

from __future__ import annotations

import mlx.core as mx


def group_queries(queries: mx.array, n_kv_heads: int) -> mx.array:
    """[B, Hq, N, D] -> [B, H, rep, N, D] so each KV head meets its query heads."""
    B, Hq, N, D = queries.shape
    return queries.reshape(B, n_kv_heads, Hq // n_kv_heads, N, D)


def ungroup(x: mx.array) -> mx.array:
    """[B, H, rep, N, D] -> [B, Hq, N, D]."""
    B, H, R, N, D = x.shape
    return x.reshape(B, H * R, N, D)


def bool_mask(mask, n_queries: int, n_keys: int, n_kv_heads: int | None = None):
    """mlx_lm's mask as a boolean array broadcastable to [B, H, rep, N, M] (None if no mask).

    A "causal" string means query i sees keys 0 .. M - N + i. Array masks of shape [.., Hq, N, M]
    are regrouped to [.., H, rep, N, M]."""
    if mask is None:
        return None
    if isinstance(mask, str):
        q = mx.arange(n_keys - n_queries, n_keys)[:, None]
        return q >= mx.arange(n_keys)[None]
    if mask.dtype != mx.bool_:
        mask = mask > -1e30  # additive mask: -inf (or dtype min) marks hidden keys
    if mask.ndim == 4 and n_kv_heads is not None and mask.shape[1] > 1:
        b = mask.shape[0]
        mask = mask.reshape(b, n_kv_heads, mask.shape[1] // n_kv_heads, n_queries, n_keys)
    elif mask.ndim == 4:
        mask = mask[:, :, None]
    return mask


def attention_logits(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Scaled scores [B, H, rep, N, M] in float32."""
    q = group_queries(queries, keys.shape[1]).astype(mx.float32) * scale
    return q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)


def attention_with_weights(queries, keys, values, *, scale, mask):
    """Dense attention that also returns its probabilities.

    Returns (out [B, Hq, N, Dv] in the queries' dtype, weights [B, H, rep, N, M] float32)."""
    logits = attention_logits(queries, keys, scale)
    m = bool_mask(mask, queries.shape[2], keys.shape[2], keys.shape[1])
    if m is not None:
        logits = mx.where(m, logits, -mx.inf)
    weights = mx.softmax(logits, axis=-1, precise=True)
    out = weights @ values.astype(mx.float32)[:, :, None]
    return ungroup(out).astype(queries.dtype), weights
