"""Byte accounting for KV caches: what a cache really holds, and what mlx_lm's plain cache would hold.

* :func:`kv_bytes` — measured: the sum of ``nbytes`` over a model's caches (for this library's caches,
  the arrays they really hold; for mlx_lm's ``KVCache``, its allocated buffers including the slack of
  up to 256 rows it grows by).
* :func:`fp16_kv_bytes` — the reference: the same number of tokens in mlx_lm's plain cache at fp16
  without slack, ``sum over layers of 2 (K and V) * B * H_kv * T * D * 2 bytes``, with ``H_kv`` and
  ``D`` read from each layer's attention module. Layers whose mlx_lm cache is a sliding-window
  ``RotatingKVCache`` count at most their window; layers without a KV cache (state-space layers)
  count nothing.
* :func:`cache_tokens` — the number of tokens a model's caches have seen (their logical ``offset``).

One ratio convention everywhere (CLI tables, JSON keys, bench rows, eval rows, plots, docs):
:func:`kv_fraction_of_fp16` = held bytes / fp16 bytes (0.30 = the cache holds 30% of what mlx_lm's plain
fp16 cache would). Where a "times smaller" figure helps, :func:`compression_text` prints the inverse in
words next to it ("3.4x smaller"), never as a bare number.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["kv_bytes", "fp16_kv_bytes", "cache_tokens", "kv_fraction_of_fp16", "compression_text",
           "fraction_text", "FP16_BYTES"]

FP16_BYTES = 2


def kv_bytes(caches: Iterable) -> int:
    """Sum of ``c.nbytes`` over ``caches`` (one cache per layer), as reported by each cache."""
    return int(sum(int(c.nbytes) for c in caches))


def cache_tokens(caches: Iterable) -> int:
    """Tokens seen by the caches: the largest logical ``offset`` among them (0 if none has one)."""
    offsets = [int(c.offset) for c in caches if isinstance(getattr(c, "offset", None), int)]
    return max(offsets, default=0)


def _kv_heads(attn, head_dim: int) -> int:
    for name in ("n_kv_heads", "num_key_value_heads", "n_kv_head"):
        value = getattr(attn, name, None)
        if isinstance(value, int) and value > 0:
            return value
    k_proj = getattr(attn, "k_proj", None)
    weight = getattr(k_proj, "weight", None)
    if weight is not None:
        return int(weight.shape[0]) // head_dim
    raise ValueError(f"cannot tell the number of KV heads of {type(attn).__name__}")


def fp16_kv_bytes(model, n_tokens: int, batch_size: int = 1) -> int:
    """Bytes of ``n_tokens`` tokens in mlx_lm's plain KV cache at fp16, without its 256-row slack."""
    from mlx_lm.models import cache as mlx_cache

    from .cache.factory import _attention, _head_dim, _layers

    if n_tokens < 0 or batch_size < 1:
        raise ValueError(f"need n_tokens >= 0 and batch_size >= 1, got {n_tokens}, {batch_size}")
    defaults = mlx_cache.make_prompt_cache(model)
    layers = _layers(model)
    if len(defaults) != len(layers):
        raise ValueError(f"{type(model).__name__}: {len(defaults)} caches for {len(layers)} layers")
    total = 0
    for layer, default in zip(layers, defaults):
        if type(default) is mlx_cache.KVCache:
            tokens = n_tokens
        elif type(default) is mlx_cache.RotatingKVCache:
            tokens = min(n_tokens, int(default.max_size))
        else:
            continue
        attn = _attention(layer)
        if attn is None:
            continue
        head_dim = _head_dim(attn, fallback=0)
        if head_dim <= 0:
            raise ValueError(f"cannot tell the head dimension of {type(attn).__name__}")
        total += 2 * batch_size * _kv_heads(attn, head_dim) * tokens * head_dim * FP16_BYTES
    return total


def kv_fraction_of_fp16(held_bytes: Optional[int], fp16_bytes: Optional[int]) -> Optional[float]:
    """``held_bytes / fp16_bytes`` (lower = smaller cache); None when there is no fp16 reference."""
    if held_bytes is None or not fp16_bytes:
        return None
    return held_bytes / fp16_bytes


def compression_text(fraction: Optional[float]) -> str:
    """A :func:`kv_fraction_of_fp16` in words: ``"3.4x smaller"``, ``"1.2x larger"``, ``"n/a"``."""
    if fraction is None:
        return "n/a"
    if fraction <= 0:
        return "empty"
    if abs(fraction - 1.0) < 0.005:
        return "same size as fp16"
    return f"{1 / fraction:.1f}x smaller" if fraction < 1 else f"{fraction:.1f}x larger"


def fraction_text(fraction: Optional[float]) -> str:
    """``"0.30 (3.3x smaller)"``: the fraction, then the same figure in words."""
    return "n/a" if fraction is None else f"{fraction:.2f} ({compression_text(fraction)})"
