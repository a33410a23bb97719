"""What the standalone (single-head, per-vector) caches share: config validation (their configs may be
any object with the fields, so they check what they read), input checks, the ``StandaloneCache`` base
(bookkeeping and attention's outer shape) and the int8 value rows of polar and turboquant."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..core.abstractions import KVCache
from .errors import CacheInputError, QuantizerConfigError
from .primitives.bitpack import unpack_bits
from .primitives.rowstore import RowStore

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


def jl_width(config, d: int) -> int:
    """``config.jl_dim`` (the QJL sketch width), ``head_dim`` when None."""
    return d if getattr(config, "jl_dim", None) is None else int_field(config, "jl_dim", 1)


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


_TINY = 1e-30


def int8_rows(v: mx.array) -> dict:
    """Symmetric per-row int8 codes with a float16 absmax scale (``scale = max|v| / 127``)."""
    scale16 = mx.minimum(mx.max(mx.abs(v), axis=1) / 127.0, FP16_MAX).astype(mx.float16)
    scale = scale16.astype(mx.float32)
    q = mx.where(scale[:, None] > 0, mx.round(v / mx.maximum(scale, _TINY)[:, None]), 0.0)
    return {"v": mx.clip(q, -127, 127).astype(mx.int8), "vscale": scale16}


def qjl_signs(store: RowStore, name: str, n: int, m: int) -> mx.array:
    """``(n, m)`` 0/1 sign bits of the ``n`` oldest rows of the packed 1-bit column ``name``."""
    return unpack_bits(store.view(name)[:n], 1, m)


class StandaloneCache(KVCache):
    """Base of the standalone caches, and their shared behaviour: inputs are ``(d,)`` or ``(n, d)``
    floating arrays (MLX or NumPy) without NaN/Inf, else ``CacheInputError``; ``attend`` covers the
    ``len(cache)`` complete (key, value) pairs with scale ``1/sqrt(head_dim)``; ``config.capacity`` is
    the initial preallocation in rows (storage doubles when full). A subclass calls :meth:`_setup`, keeps its per-token rows in
    ``_keys``/``_values`` (objects with ``n``, ``nbytes()``, ``drop_oldest(n)``, ``clear()``) and
    implements ``append_key``, ``append_value``, ``_scores(q, n)`` (``(m, n)`` scores of ``(m, d)``
    queries against the ``n`` oldest keys), ``_attend_values(w, n)`` (``w @ values``) and
    ``_state_arrays()`` (its token-independent arrays)."""

    def _setup(self, config) -> int:
        """Validate and keep the fields every standalone cache reads; return the initial capacity."""
        self.config = config
        d, seed, dtype, capacity = common_fields(config)
        self.head_dim, self.seed, self.dtype = d, seed, dtype
        self.bit_width_inlier = int_field(config, "bit_width_inlier", 1, 8)
        self.observers = list(getattr(config, "observers", None) or [])
        self.store = getattr(config, "store", None)
        self.scale = 1.0 / math.sqrt(d)
        return capacity

    @property
    def n_keys(self) -> int:
        return self._keys.n

    @property
    def n_values(self) -> int:
        return self._values.n

    @property
    def n_tokens(self) -> int:
        return min(self._keys.n, self._values.n)

    def memory_bytes(self) -> int:
        """Bytes of every per-token array held, preallocated capacity included; the token-independent
        state (rotations, codebooks, sketches, bases) is reported by :meth:`state_bytes`."""
        return self._keys.nbytes() + self._values.nbytes()

    def state_bytes(self) -> int:
        """Bytes of the token-independent state."""
        return sum(a.nbytes for a in self._state_arrays())

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest (key, value) pairs, in place (used by SlidingWindowKVCache)."""
        n = check_drop(n)
        self._keys.drop_oldest(n)
        self._values.drop_oldest(n)

    def reset(self) -> None:
        """Drop all tokens and their storage; the token-independent state is kept."""
        self._keys.clear()
        self._values.clear()

    def key_scores(self, q) -> mx.array:
        """Estimated ``<q, k_i>`` for every stored key: ``(n,)`` for ``q`` ``(d,)``, ``(m, n)`` for
        ``(m, d)``."""
        q, single = as_block(q, self.head_dim, "query")
        s = self._scores(q, self.n_keys)
        return s[0] if single else s

    def attend(self, q) -> mx.array:
        """``softmax(<q, k_i> / sqrt(d)) @ v`` over the ``len(self)`` complete pairs; ``(d,)`` or
        ``(m, d)`` like ``q``, in ``config.dtype`` if set, else the query's dtype. Nothing stored: zeros."""
        odt = out_dtype(self.dtype, q)
        qf, single = as_block(q, self.head_dim, "query")
        n = self.n_tokens
        if n == 0:
            out = mx.zeros(qf.shape, dtype=mx.float32)
        else:
            out = self._attend_values(mx.softmax(self._scores(qf, n) * self.scale, axis=-1), n)
        out = out.astype(odt)
        return out[0] if single else out


class Int8Values:
    """Values stored per token as symmetric int8 codes with one float16 absmax scale (polar and the
    TurboQuant caches): ~0.2% relative error, well below their key error."""

    @staticmethod
    def _value_store(d: int, capacity: int) -> RowStore:
        return RowStore({"v": ((d,), mx.int8), "vscale": ((), mx.float16)}, capacity)

    def append_value(self, v) -> None:
        v, _ = as_block(v, self.head_dim, "value")
        if v.shape[0]:
            self._values.append(int8_rows(v))

    def _value_parts(self, n: int):
        return (self._values.view("v")[:n].astype(mx.float32), self._values.view("vscale")[:n].astype(mx.float32))

    def reconstruct_values(self) -> mx.array:
        """``(n_values, d)`` float32 decoded values."""
        v, scale = self._value_parts(self._values.n)
        return v * scale[:, None]

    def _attend_values(self, w: mx.array, n: int) -> mx.array:
        v, scale = self._value_parts(n)
        return (w * scale[None, :]) @ v  # the per-token scale folded into the weights
