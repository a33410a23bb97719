"""MLX's peak memory during one evaluated call, the measurement the memory tests share."""

from __future__ import annotations

import gc

import mlx.core as mx


def peak_of(fn, *args, **kwargs):
    """``(fn(*args, **kwargs) evaluated, MLX's peak memory during it above what was live before)``: the allocator's
    cache emptied first, so the peak counts only what the call itself allocates."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn(*args, **kwargs)
    mx.eval(out)
    return out, mx.get_peak_memory() - base
