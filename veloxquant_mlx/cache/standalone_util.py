"""Validation and small helpers shared by the standalone (per-vector) caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .errors import CacheInputError, QuantizerConfigError

DEFAULT_CAPACITY = 256
FP16_MAX = 65504.0


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def int_field(config, field, lo, hi=None, optional=False):
    v = getattr(config, field, None)
    if v is None and optional:
        return None
    allowed = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"
    if optional:
        allowed += " or None"
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise QuantizerConfigError(field, v, allowed)
    return int(v)


def derive_seed(seed: int, stream: int) -> int:
    """Independent integer seed for sub-stream ``stream`` of ``seed``."""
    return int(np.random.SeedSequence([seed % (1 << 64), stream]).generate_state(1)[0])


def as_block(x, d: int, what: str) -> tuple[mx.array, bool]:
    """Validate a ``(d,)`` / ``(n, d)`` floating, finite input; return it as float32 ``(n, d)``."""
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise CacheInputError(f"{what} must have a floating dtype, got {x.dtype}")
        x = mx.array(x)
    if not isinstance(x, mx.array):
        raise CacheInputError(f"{what} must be an mlx array, got {type(x).__name__}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise CacheInputError(f"{what} must have a floating dtype, got {x.dtype}")
    if x.ndim not in (1, 2):
        raise CacheInputError(f"{what} must have shape (d,) or (n, d), got {tuple(x.shape)}")
    if x.shape[-1] != d:
        raise CacheInputError(f"{what} last dimension is {x.shape[-1]}, expected head_dim={d}")
    single = x.ndim == 1
    x = x.astype(mx.float32).reshape(-1, d)
    if x.shape[0] and not mx.all(mx.isfinite(x)).item():
        raise CacheInputError(f"{what} contains NaN or Inf")
    return x, single


def common_fields(config):
    """Validate and return ``(head_dim, seed, dtype, capacity)``."""
    d = int_field(config, "head_dim", 2)
    seed = getattr(config, "seed", 0)
    if not is_int(seed):
        raise QuantizerConfigError("seed", seed, "an int")
    cap = int_field(config, "capacity", 1, optional=True)
    dtype = getattr(config, "dtype", None)
    if dtype is not None and not (isinstance(dtype, mx.Dtype) and mx.issubdtype(dtype, mx.floating)):
        raise QuantizerConfigError("dtype", dtype, "None or a floating mlx dtype")
    return d, int(seed), dtype, (cap if cap is not None else DEFAULT_CAPACITY)


def from_store(store, key: str, make, shape: tuple) -> mx.array:
    """``make()`` or, with an ArtifactStore, the stored artifact under ``key`` (created if absent)."""
    if store is None:
        return make()
    value = store.get_or_create(key, make)
    if tuple(value.shape) != tuple(shape):
        raise QuantizerConfigError("store", key, f"an artifact of shape {tuple(shape)}, got {tuple(value.shape)}")
    return value.astype(mx.float32)


def out_dtype(dtype, q):
    out = dtype if dtype is not None else (q.dtype if isinstance(q, mx.array) else None)
    if out is None or not mx.issubdtype(out, mx.floating):
        out = mx.float32
    return out


def check_norm16(x: mx.array, what: str) -> None:
    if x.shape[0] and mx.max(mx.sum(x * x, axis=1)).item() > FP16_MAX**2:
        raise CacheInputError(f"{what} norm exceeds the float16 range ({FP16_MAX}) of the stored norms")


def check_drop(n) -> int:
    if not is_int(n) or n < 0:
        raise CacheInputError(f"drop_oldest needs an int n >= 0, got {n!r}")
    return int(n)
