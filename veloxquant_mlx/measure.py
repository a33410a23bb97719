"""Byte accounting (README.md, "Reading the byte figures"): :func:`kv_bytes` is measured, :func:`fp16_kv_bytes` the
reference (``2 * B * H_kv * T * D * 2`` bytes a layer, a sliding-window layer at most its window), and
:func:`kv_fraction_of_fp16` the one ratio, said in words ("3.4x smaller") by :func:`compression_text`.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .cache.factory import _attention, _head_dim, _layers

__all__ = ["kv_bytes", "fp16_kv_bytes", "cache_tokens", "kv_fraction_of_fp16", "compression_text",
           "fraction_text", "kv_summary", "cache_figures", "batch_figures", "process_memory", "FP16_BYTES"]

FP16_BYTES = 2


def kv_bytes(caches: Iterable) -> int:
    return int(sum(int(c.nbytes) for c in caches))


def cache_tokens(caches: Iterable) -> int:
    """Tokens seen: the largest logical ``offset`` among the caches (0 if none has one)."""
    return max((int(c.offset) for c in caches if isinstance(getattr(c, "offset", None), int)), default=0)


def _kv_heads(attn, head_dim: int) -> int:
    for name in ("n_kv_heads", "num_key_value_heads", "n_kv_head"):
        value = getattr(attn, name, None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    if weight is not None:
        return int(weight.shape[0]) // head_dim
    raise ValueError(f"cannot tell the number of KV heads of {type(attn).__name__}")


def fp16_kv_bytes(model, n_tokens: int, batch_size: int = 1) -> int:
    if n_tokens < 0 or batch_size < 1:
        raise ValueError(f"need n_tokens >= 0 and batch_size >= 1, got {n_tokens}, {batch_size}")
    defaults = mlx_cache.make_prompt_cache(model)
    layers = _layers(model)
    if len(defaults) != len(layers):
        raise ValueError(f"{type(model).__name__}: {len(defaults)} caches for {len(layers)} layers")
    total = 0
    for layer, default in zip(layers, defaults):
        attn = _attention(layer)
        if type(default) not in (mlx_cache.KVCache, mlx_cache.RotatingKVCache) or attn is None:
            continue  # no KV cache (e.g. a state-space layer)
        tokens = n_tokens if type(default) is mlx_cache.KVCache else min(n_tokens, int(default.max_size))
        head_dim = _head_dim(attn, fallback=0)
        if head_dim <= 0:
            raise ValueError(f"cannot tell the head dimension of {type(attn).__name__}")
        total += 2 * batch_size * _kv_heads(attn, head_dim) * tokens * head_dim * FP16_BYTES
    return total


def kv_fraction_of_fp16(held_bytes: Optional[int], fp16_bytes: Optional[int]) -> Optional[float]:
    """``held_bytes / fp16_bytes`` (lower = smaller); None without an fp16 reference."""
    return None if held_bytes is None or not fp16_bytes else held_bytes / fp16_bytes


def compression_text(fraction: Optional[float]) -> str:  # "3.4x smaller", "1.2x larger", "n/a"
    if fraction is None:
        return "n/a"
    if fraction <= 0:
        return "empty"
    if abs(fraction - 1.0) < 0.005:
        return "same size as fp16"
    return f"{1 / fraction:.1f}x smaller" if fraction < 1 else f"{fraction:.1f}x larger"


def fraction_text(fraction: Optional[float]) -> str:  # "0.30 (3.3x smaller)"
    return "n/a" if fraction is None else f"{fraction:.2f} ({compression_text(fraction)})"


def kv_summary(model, caches) -> dict:
    """``kv_tokens``, measured ``kv_bytes``, the ``kv_bytes_fp16`` reference and their fraction."""
    n, measured = cache_tokens(caches), kv_bytes(caches)
    reference = fp16_kv_bytes(model, n)
    return {"kv_tokens": n, "kv_bytes": measured, "kv_bytes_fp16": reference,
            "kv_fraction_of_fp16": kv_fraction_of_fp16(measured, reference)}


def cache_figures(model, caches) -> dict:
    """:func:`kv_summary` under the server's names, with the tokens each layer keeps (``stored_rows`` or ``size``)."""
    kv = kv_summary(model, caches)
    kept = [int(c.stored_rows() if hasattr(c, "stored_rows") else c.size()) for c in caches]
    return {"tokens_seen": kv.pop("kv_tokens"), "tokens_kept_max": max(kept, default=0),
            "tokens_kept_mean": (sum(kept) / len(kept)) if kept else 0.0, **kv}


def batch_figures(model, caches) -> dict:
    """:func:`cache_figures` of a running batch from host-side lengths only (no device reads: for mlx_lm's
    ``BatchKVCache`` only bytes and the batch size)."""
    first, measured = caches[0], kv_bytes(caches)
    if not hasattr(first, "lens"):
        padding = getattr(first, "left_padding", None)
        return {"batch_size": int(padding.shape[0]) if padding is not None else None, "tokens_seen": None,
                "kv_bytes": measured, "kv_bytes_fp16": None, "kv_fraction_of_fp16": None}
    lens = list(first.lens)
    reference = sum(fp16_kv_bytes(model, n) for n in lens)
    return {"batch_size": len(lens), "tokens_seen": lens, "kv_bytes": measured, "kv_bytes_fp16": reference,
            "kv_fraction_of_fp16": kv_fraction_of_fp16(measured, reference)}


def process_memory() -> dict:
    """MLX's active, peak and cache memory, and the process's resident bytes (peak where /proc is absent)."""
    out = {"mlx_active_bytes": int(mx.get_active_memory()), "mlx_peak_bytes": int(mx.get_peak_memory()),
           "mlx_cache_bytes": int(mx.get_cache_memory())}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["rss_peak_bytes"] = int(peak if sys.platform == "darwin" else peak * 1024)
    return out
