"""What the standalone (single-head, per-vector) caches share: checks of the config fields they read (any
object with the fields), input checks, the ``StandaloneCache`` base and polar's and turboquant's int8 values."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..core.abstractions import KVCache
from .errors import CacheInputError, QuantizerConfigError
from .primitives.bitpack import unpack_bits
from .primitives.rowstore import RowStore

INITIAL_ROWS = 256  # rows a standalone cache preallocates (fewer when ``config.capacity`` is smaller)

FP16_MAX = 65504.0


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def int_field(config, field, lo, hi=None, optional=False):
    v = getattr(config, field, None)
    if v is None and optional:
        return None
    allowed = (f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}") + (" or None" if optional else "")
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise QuantizerConfigError(field, v, allowed)
    return int(v)


def jl_width(config, d: int) -> int:
    """``config.jl_dim`` (the QJL sketch width), ``head_dim`` when None."""
    return d if getattr(config, "jl_dim", None) is None else int_field(config, "jl_dim", 1)


def derive_seed(seed: int, stream: int) -> int:
    """Independent integer seed for sub-stream ``stream`` of ``seed``."""
    return int(np.random.SeedSequence([seed % (1 << 64), stream]).generate_state(1)[0])


def as_block(x, d: int, what: str) -> tuple[mx.array, bool, mx.Dtype]:
    """Validate a ``(d,)`` / ``(n, d)`` floating, finite input: ``(float32 (n, d), was it one vector, its MLX
    dtype)`` (float64 and long double NumPy read as float32)."""
    if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating):
        x = mx.array(x if x.dtype.itemsize <= 8 else x.astype(np.float64))  # MLX has no long double
    if not isinstance(x, (mx.array, np.ndarray)):
        raise CacheInputError(f"{what} must be an mlx array, got {type(x).__name__}")
    if isinstance(x, np.ndarray) or not mx.issubdtype(x.dtype, mx.floating):
        raise CacheInputError(f"{what} must have a floating dtype, got {x.dtype}")
    if x.ndim not in (1, 2):
        raise CacheInputError(f"{what} must have shape (d,) or (n, d), got {tuple(x.shape)}")
    if x.shape[-1] != d:
        raise CacheInputError(f"{what} last dimension is {x.shape[-1]}, expected head_dim={d}")
    single, dtype = x.ndim == 1, x.dtype
    x = x.astype(mx.float32).reshape(-1, d)
    if x.shape[0] and not mx.all(mx.isfinite(x)).item():
        raise CacheInputError(f"{what} contains NaN or Inf")
    return x, single, dtype


def from_store(store, key: str, make, shape: tuple) -> mx.array:
    """``make()`` or, with an ArtifactStore, the stored artifact under ``key`` (created if absent)."""
    if store is None:
        return make()
    value = store.get_or_create(key, make)
    if tuple(value.shape) != tuple(shape):
        raise QuantizerConfigError("store", key, f"an artifact of shape {tuple(shape)}, got {tuple(value.shape)}")
    return value.astype(mx.float32)


def check_norm16(x: mx.array, what: str) -> None:
    if x.shape[0] and mx.max(mx.sum(x * x, axis=1)).item() > FP16_MAX**2:
        raise CacheInputError(f"{what} norm exceeds the float16 range ({FP16_MAX}) of the stored norms")


def qjl_signs(store: RowStore, name: str, n: int, m: int) -> mx.array:
    """``(n, m)`` 0/1 sign bits of the ``n`` oldest rows of the packed 1-bit column ``name``."""
    return unpack_bits(store.view(name)[:n], 1, m)


class StandaloneCache(KVCache):
    """Base of the standalone caches: inputs ``(d,)`` or ``(n, d)`` finite floating arrays (MLX or NumPy);
    ``attend`` covers the complete (key, value) pairs at scale ``1/sqrt(head_dim)``; ``config.capacity`` (the spec's
    "maximum tokens to store") bounds the rows: an append past it raises ``ValueError`` and stores nothing. A
    subclass calls :meth:`_setup`, keeps rows in ``_keys``/``_values`` (``RowStore``-like) and implements
    ``append_key``, ``append_value``, ``_scores(q, n)`` (against the ``n`` oldest keys), ``_attend_values(w, n)``
    and ``_state_arrays()`` (its token-independent arrays)."""

    def _setup(self, config) -> int:
        """Validate and keep the fields every standalone cache reads; return the rows to preallocate."""
        self.config = config
        self.head_dim = d = int_field(config, "head_dim", 2)
        if not is_int(seed := getattr(config, "seed", 0)):
            raise QuantizerConfigError("seed", seed, "an int")
        self.seed = int(seed)
        self.capacity = capacity = int_field(config, "capacity", 1, optional=True)  # at most this many tokens
        self.dtype = getattr(config, "dtype", None)
        if self.dtype is not None and not (isinstance(self.dtype, mx.Dtype) and mx.issubdtype(self.dtype, mx.floating)):
            raise QuantizerConfigError("dtype", self.dtype, "None or a floating mlx dtype")
        self.bit_width_inlier = int_field(config, "bit_width_inlier", 1, 8)
        self.observers = list(getattr(config, "observers", None) or [])
        self.store = getattr(config, "store", None)
        self.scale = 1.0 / math.sqrt(d)
        return min(capacity or INITIAL_ROWS, INITIAL_ROWS)

    n_keys = property(lambda self: self._keys.n)
    n_values = property(lambda self: self._values.n)
    n_tokens = property(lambda self: min(self._keys.n, self._values.n), doc="Complete (key, value) pairs.")

    def memory_bytes(self) -> int:
        """Bytes of the per-token arrays held, capacity included (the rest: :meth:`state_bytes`)."""
        return self._keys.nbytes() + self._values.nbytes()

    def state_bytes(self) -> int:
        """Bytes of the token-independent state (rotations, codebooks, sketches, bases)."""
        return sum(a.nbytes for a in self._state_arrays())

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest (key, value) pairs, in place (used by SlidingWindowKVCache)."""
        if not is_int(n) or n < 0:
            raise CacheInputError(f"drop_oldest needs an int n >= 0, got {n!r}")
        self._keys.drop_oldest(int(n))
        self._values.drop_oldest(int(n))

    def reset(self) -> None:
        """Drop all tokens; the token-independent state is kept."""
        self._keys.clear()
        self._values.clear()

    def key_scores(self, q) -> mx.array:
        """Estimated ``<q, k_i>`` for every stored key: ``(n,)`` for ``q (d,)``, ``(m, n)`` for ``(m, d)``."""
        q, single, _ = as_block(q, self.head_dim, "query")
        s = self._scores(q, self.n_keys)
        return s[0] if single else s

    def attend(self, q) -> mx.array:
        """``softmax(<q, k_i> / sqrt(d)) @ v`` over the complete pairs, shaped like ``q``, in ``config.dtype``
        or else the query's dtype; zeros when nothing is stored."""
        qf, single, qdt = as_block(q, self.head_dim, "query")
        odt = self.dtype if self.dtype is not None else qdt
        n = self.n_tokens
        out = self._attend_values(mx.softmax(self._scores(qf, n) * self.scale, axis=-1), n) if n else mx.zeros(qf.shape)
        return (out[0] if single else out).astype(odt)


class Int8Values:
    """Values as symmetric int8 codes with a float16 absmax scale per token (~0.2% error, well below the key
    error of polar and TurboQuant)."""

    def _value_store(self, d: int, initial: int) -> RowStore:
        return RowStore({"v": ((d,), mx.int8), "vscale": ((), mx.float16)}, initial, self.capacity)

    def append_value(self, v) -> None:
        v = as_block(v, self.head_dim, "value")[0]
        if v.shape[0]:
            scale16 = mx.minimum(mx.max(mx.abs(v), axis=1) / 127.0, FP16_MAX).astype(mx.float16)
            scale = scale16.astype(mx.float32)
            q = mx.where(scale[:, None] > 0, mx.round(v / mx.maximum(scale, 1e-30)[:, None]), 0.0)
            self._values.append({"v": mx.clip(q, -127, 127).astype(mx.int8), "vscale": scale16})

    def _value_parts(self, n: int):
        return (self._values.view("v")[:n].astype(mx.float32), self._values.view("vscale")[:n].astype(mx.float32))

    def reconstruct_values(self) -> mx.array:
        v, scale = self._value_parts(self._values.n)
        return v * scale[:, None]

    def _attend_values(self, w: mx.array, n: int) -> mx.array:
        v, scale = self._value_parts(n)
        return (w * scale[None, :]) @ v  # the per-token scale folded into the weights
