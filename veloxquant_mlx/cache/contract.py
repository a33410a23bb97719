"""The mlx_lm cache contract, implemented once for every mlx_lm-protocol cache.

mlx_lm ropes q and k at ``cache.offset``, calls ``k, v = cache.update_and_fetch(k, v)``, then attends with a
mask built beforehand from layer 0's ``make_mask`` and shared by all layers. ``CompressedKVCache`` keeps that
contract for caches that store fewer or encoded rows:

* ``offset`` is always the logical position (it drives RoPE), whatever is stored.
* ``update_and_fetch`` returns every stored row (position order) then the new ones; past rows are visible to
  every new query, so the bottom-right ``"causal"`` mask fits any stored count. The dense rows are lazy: when
  the dispatch point (``dispatch.py``) routes attention to ``attend``, MLX never computes them.
* ``state`` is ``{"meta": json, <array name>: array, ...}`` and carries the config, so ``from_state`` (and
  mlx_lm's ``load_prompt_cache``) rebuild an identical cache.
* ``nbytes`` is the sum of the held arrays' ``.nbytes`` (``held_arrays``), never an estimate.
* ``merge`` raises ``BatchingNotSupported`` unless the class batches its compressed form (``batchable``).
* A prefill chunk holding NaN or Inf makes the cache's next calls raise ``CacheInputError`` (checked without a
  host sync: ``queue_chunk_check``).

A subclass implements ``_store`` / ``_dense`` / ``_trim_rows`` / ``stored_rows`` and may override ``attend``; one
whose trim can refuse (``ValueError``) decides that in ``_check_trim_rows``, which ``trim`` runs before
``_trim_rows`` and ``check_trim`` runs alone, so ``trim_caches`` can ask every layer of a model before it trims any.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import os
from typing import Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from .attention import dense_attention
from .errors import CacheInputError

#: Prefill layers a compressed cache lets the device run behind the graph being built (see ``queue_chunk_check``;
#: environment ``VELOXQUANT_PREFILL_LAYERS_IN_FLIGHT``: more trades memory for time).
LAYERS_IN_FLIGHT = max(1, int(os.environ.get("VELOXQUANT_PREFILL_LAYERS_IN_FLIGHT", "2")))
_in_flight: collections.deque = collections.deque()


def queue_chunk_check(flag: mx.array, wait: bool = True) -> None:
    """Queue a prefill chunk's check ``flag`` (``mx.async_eval``: no host wait) and, ``wait``, wait for the one
    queued ``LAYERS_IN_FLIGHT`` calls before.

    Without a wait a whole chunk's graph (every layer's decoded past) is queued at once and its transients pile up;
    waiting for each layer (a host sync) leaves the device idle while the host builds the next. Waiting
    ``LAYERS_IN_FLIGHT`` layers back keeps the device busy and the transients to that many layers. A cache whose
    first chunk attends its own rows exactly (``first_chunk_waits = False``) queues that chunk without a wait."""
    mx.async_eval(flag)
    if not wait:
        return
    _in_flight.append(flag)
    while len(_in_flight) > LAYERS_IN_FLIGHT:
        _in_flight.popleft().item()


def all_finite(*arrays: mx.array) -> mx.array:
    """A scalar: True when no element of ``arrays`` is NaN or +-Inf. ``sum(x * 0)`` is 0 for finite ``x`` (any
    magnitude) and NaN otherwise: two kernels per array, where ``mx.all(mx.isfinite(x))`` launched ~8 per array."""
    return functools.reduce(mx.add, [mx.sum(x * 0) for x in arrays]) == 0


class BatchingNotSupported(NotImplementedError):
    """Raised by ``merge`` for caches whose compressed form cannot be batched."""


_CONFIG_SKIP = ("store", "observers", "options", "dtype")
# a cache's fused decode launches' block counters and its last launch's output (kernels.step_counters): held, not state
_KERNEL_HELD = ("_kernel_counters", "_kernel_after")


def config_to_json(config) -> str:
    """The config fields that differ from their defaults, as JSON (for ``state``)."""
    from .config import _DEFAULTS
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)  # arrays (codebooks) are skipped: the state holds what the cache fitted
        plain = isinstance(v, (int, float, str, bool, tuple, list, type(None)))
        if f.name not in _CONFIG_SKIP and plain and v != _DEFAULTS[f.name]:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    if config.dtype is not None:
        out["dtype"] = str(config.dtype).replace("mlx.core.", "")
    return json.dumps(out, sort_keys=True)


def config_from_json(text: str):
    """The config :func:`config_to_json` wrote."""
    from .config import _DEFAULTS, KVCacheConfig, _quiet_flat_fields
    values = json.loads(text)
    values.update({k: tuple(v) for k, v in values.items() if isinstance(_DEFAULTS.get(k), tuple)})
    if "dtype" in values:
        values["dtype"] = getattr(mx, values["dtype"])
    with _quiet_flat_fields():
        return KVCacheConfig(**values)


#: Float16 rows per layer a cache may hold beyond its tokens' before it compresses (spare rows, a KIVI
#: residual, calibration), per-model constants aside; ``tests/test_prefill_memory.py`` checks every method.
SHORT_PROMPT_SLACK_ROWS = 32


def short_prompt_bound(n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int) -> int:
    """Most bytes a cache (batch 1) may hold for ``n_tokens`` tokens before it compresses (see above)."""
    return 2 * n_layers * n_kv_heads * (head_dim + value_dim) * (n_tokens + SHORT_PROMPT_SLACK_ROWS)


class CompressedKVCache(mlx_cache._BaseCache):
    """Base of every mlx_lm-protocol cache of this library. See the module docstring."""

    method_name = "?"
    array_fields: tuple[str, ...] = ()  # the array attributes held (state and nbytes)
    scalar_fields: tuple[str, ...] = ()  # the other attributes of its state besides ``offset``
    object_scalar_fields: tuple[str, ...] = ()  # scalar fields holding a JSON object (a RoPE spec)

    # Prefix reuse (trim to the shared prefix, prefill the rest) equals a fresh run only where both hold
    # (tests/test_chunk_invariance.py; docs/ARCHITECTURE.md "Prefix reuse"):
    chunk_invariant: bool = True  # outputs do not depend on how the rows were split across calls
    exact_trim: bool = True  # trim(n) after n appended rows leaves a cache that never saw them
    # such a trim is exact unless it raises ValueError (KIVI: rows still in the residual); a server retries
    trim_exact_or_raises: bool = False
    batchable: bool = False  # ``_merge_batch`` builds a batch form (a server batches only these); not inherited
    first_chunk_waits: bool = True  # a first prefill chunk waits for the layers in flight (``queue_chunk_check``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "batchable" not in cls.__dict__:
            cls.batchable = False

    def __init__(self, config):
        self.config = config
        self.offset = 0
        for name in self.array_fields:
            setattr(self, name, None)
        self._call = None  # a subclass's record of the last call, for its attend
        self._init_layout()

    def _init_layout(self) -> None:
        """Set derived, non-array attributes from ``self.config`` (called at init and from_state)."""

    def _store(self, keys: mx.array, values: mx.array) -> None:
        """Encode and store new rows [B, H, N, D] (already RoPE-rotated)."""
        raise NotImplementedError

    def _dense(self) -> tuple[mx.array, mx.array]:
        """Dense (keys, values) of every stored row, in the order described above."""
        raise NotImplementedError

    def _trim_rows(self, n: int) -> int:
        """Drop the ``n`` newest stored rows exactly (``_check_trim_rows(n)`` passed); return how many were dropped."""
        raise NotImplementedError

    def _check_trim_rows(self, n: int) -> None:
        """Raise ``ValueError``, changing nothing, where ``_trim_rows(n)`` (0 < n <= offset) cannot trim exactly: the
        one place of a cache's refusal (``trim`` and ``check_trim`` run it); by default none."""

    @staticmethod
    def _check_stored(n: int, stored: int) -> None:
        """Refuse a trim of more tokens than the ``stored`` rows (for ``_check_trim_rows``)."""
        if n > stored:
            raise ValueError(f"cannot trim {n} tokens: only {stored} rows are stored")

    def stored_rows(self) -> int:
        """Rows currently stored (may be fewer than ``offset``)."""
        raise NotImplementedError

    def held_arrays(self) -> list[mx.array]:
        """``array_fields``, and the decode kernels' block counters and last output once a fused launch made them
        (``kernels.step_counters``: held between steps, so counted)."""
        arrays = [getattr(self, n) for n in self.array_fields] + [self.__dict__.get(n) for n in _KERNEL_HELD]
        return [a for a in arrays if a is not None]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        step = keys.shape, values.shape, keys.dtype, values.dtype
        if self._step_fits(step):  # a repeated decode row the layout stores by its short path
            return self._decode_step(keys, values)
        self._check_input(keys, values)
        self._store(keys, values)
        self.offset += keys.shape[2]
        if keys.shape[2] == 1:  # remembered for ``_repeats_checked_step``
            self._step_sig = step + (self._shape,)
        return self._fetched(keys.dtype)

    def _step_fits(self, step) -> bool:
        """Whether ``_decode_step`` may store this one-row call (layouts with a short decode path say when)."""
        return False

    def _fetched(self, dtype):
        """What ``update_and_fetch`` returns once ``_store`` holds the call: by default every stored row."""
        return self._dense()

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention for this call (dispatch point); by default dense over what ``update_and_fetch`` returned."""
        return dense_attention(queries, keys, values, scale=scale, mask=self._own_mask(mask, queries, keys),
                               sinks=sinks)

    def _own_mask(self, mask, queries, keys):
        """mlx_lm's shared mask comes from layer 0, whose row count may differ: a string/None mask fits any
        count, an array one is rebuilt if it does not fit."""
        n, k = queries.shape[-2], keys.shape[-2]
        if mask is None or isinstance(mask, str) or mask.shape[-2:] == (n, k):
            return mask
        return create_causal_mask(n, k - n)

    def _check_input(self, keys, values):
        if keys.ndim != 4 or values.ndim != 4:
            raise CacheInputError(f"{type(self).__name__}.update_and_fetch expects [B, H, N, D] keys and values, "
                                  f"got {keys.shape} and {values.shape}")
        if keys.shape[:3] != values.shape[:3]:
            raise CacheInputError(f"keys {keys.shape} and values {values.shape} differ in B, H or N")
        if not mx.issubdtype(keys.dtype, mx.floating) or not mx.issubdtype(values.dtype, mx.floating):
            raise CacheInputError(f"keys/values must be floating point, got {keys.dtype}/{values.dtype}")
        expected = getattr(self, "_shape", None)
        if expected is not None and (keys.shape[1], keys.shape[3], values.shape[3]) != expected:
            raise CacheInputError(f"{type(self).__name__} holds H={expected[0]}, key D={expected[1]}, value "
                                  f"D={expected[2]}; got keys {keys.shape}, values {values.shape} (head_dim mismatch?)")
        self._raise_if_nonfinite()
        if keys.shape[2] > 1:  # prefill chunks only (a decode step's rows are not checked)
            finite = all_finite(keys, values)
            first = isinstance(self.offset, int) and self.offset == 0  # (batch caches: per-row offsets, always wait)
            queue_chunk_check(finite, wait=self.first_chunk_waits or not first)  # evaluated: holds none of the rows
            self._finite_check = (finite, self.offset, self.offset + keys.shape[2])
        self._shape = (keys.shape[1], keys.shape[3], values.shape[3])

    def _raise_if_nonfinite(self) -> None:
        """Raise if an earlier prefill chunk held NaN or Inf and its rows are still here. The flag is queued
        (``queue_chunk_check``: reading it at once would be a host sync inside the model's graph) and read at the
        next call; every call after raises too, until ``trim`` has removed the chunk's rows."""
        check = getattr(self, "_finite_check", None)
        if check is not None:
            self._finite_check = None
            if not check[0].item():
                self._nonfinite_rows = check[1:]
        bad = getattr(self, "_nonfinite_rows", None)
        if bad is not None and self.offset > bad[0]:
            raise CacheInputError(f"{type(self).__name__}: NaN or Inf in the keys/values of an earlier call (positions "
                                  f"{bad[0]}..{bad[1] - 1}); trim({self.offset - bad[0]}) removes them")
        self._nonfinite_rows = None

    def _repeats_checked_step(self, step) -> bool:
        """Whether a one-row call of ``step`` (shapes and dtypes of keys and values) repeats one that passed
        ``_check_input``, with no prefill chunk's finiteness pending or found bad: a short decode path (which
        skips the checks) may take it."""
        sig = self.__dict__.get("_step_sig")
        return (sig is not None and sig[:4] == step and sig[4] == getattr(self, "_shape", None)
                and getattr(self, "_finite_check", None) is None and getattr(self, "_nonfinite_rows", None) is None)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None or return_array:
            return create_causal_mask(N, self.stored_rows(), window_size=window_size)
        return None if N == 1 else "causal"

    def size(self) -> int:
        return self.stored_rows()

    def empty(self) -> bool:
        return self.stored_rows() == 0 and self.offset == 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.held_arrays())

    @property
    def compression_ratio(self) -> float:
        """fp16 bytes of every token seen / bytes held (> 1 means memory saved); needs the class's
        ``full_seq_bytes`` (what mlx_lm's plain cache would hold for the same tokens)."""
        return self.full_seq_bytes / self.nbytes if self.nbytes else 1.0

    def is_trimmable(self) -> bool:
        return True

    def check_trim(self, n: int) -> None:
        """Raise ``ValueError`` where ``trim(n)`` would, changing nothing (``trim_caches`` asks every layer first)."""
        n = min(int(n), self.offset)
        if n > 0:
            self._check_trim_rows(n)

    def trim(self, n: int) -> int:
        n = min(int(n), self.offset)
        if n <= 0:
            return 0
        self._check_trim_rows(n)
        self._call = None
        dropped = self._trim_rows(n)
        self.offset -= dropped
        return dropped

    @classmethod
    def merge(cls, caches):
        caches = list(caches)
        if cls.batchable and caches and all(type(c) is cls for c in caches):
            return cls._merge_batch(caches)
        others = sorted({type(c).__name__ for c in caches if type(c) is not cls})
        raise BatchingNotSupported(
            f"{cls.__name__} ({cls.method_name}) cannot merge into a batch cache without losing its "
            "compression; serve these requests one at a time"
            + (f" (batch also holds {', '.join(others)})" if others and cls.batchable else ""))

    def __deepcopy__(self, memo):
        """Copies all but the (never mutated) config and MLX dtypes; objects shared between layers
        (coordinators) stay shared within one deepcopy call."""
        new = memo[id(self)] = type(self).__new__(type(self))
        for k, v in self.__dict__.items():
            if k not in (*_KERNEL_HELD, "_step_sig", "_config_json"):  # per-object memos: rebuilt
                setattr(new, k, v if k == "config" or isinstance(v, mx.Dtype) else copy.deepcopy(v, memo))
        return new

    @property
    def state(self):
        return self._state_of(self.offset, self.scalar_fields)

    def _state_of(self, offset: int, scalars) -> dict:
        """``{"meta": json(config, offset, scalars, shape), <array name>: array, ...}``."""
        memo = self.__dict__.get("_config_json")  # mlx_lm reads ``state`` after every prefill chunk, per layer
        if memo is None or memo[0] is not self.config:  # (the config is never mutated: a new one is a new object)
            memo = self._config_json = (self.config, config_to_json(self.config))
        meta = {"config": memo[1], "offset": offset,
                "scalars": {n: getattr(self, n) for n in scalars}, "shape": list(getattr(self, "_shape", None) or [])}
        return {"meta": json.dumps(meta), **{name: getattr(self, name) for name in self.array_fields}}

    @state.setter
    def state(self, v):
        meta = json.loads(v["meta"])
        self.config = config_from_json(meta["config"])
        self._call = self._finite_check = self._nonfinite_rows = None
        self._init_layout()
        self.offset = meta["offset"]
        for k, val in meta["scalars"].items():
            setattr(self, k, val)
        self._shape = tuple(meta["shape"]) or None
        for name in self.array_fields:
            setattr(self, name, v.get(name))


def trim_caches(caches, n: int) -> int:
    """Trim the ``n`` newest tokens off every layer of a model's cache list, or off none: ``ValueError`` (naming the
    layer) before any layer changes when one is not trimmable or its ``check_trim`` refuses. mlx_lm's
    ``trim_prompt_cache`` trims layer by layer, so a later layer's refusal leaves the earlier ones trimmed and the
    layers out of step. Caches without ``check_trim`` (mlx_lm's) never refuse a trimmable trim. Returns the tokens
    trimmed off the first layer (each layer trims ``min(n, its offset)``), as ``trim_prompt_cache`` does."""
    caches = list(caches)
    for i, c in enumerate(caches):
        if not c.is_trimmable():
            raise ValueError(f"layer {i} ({type(c).__name__}) cannot be trimmed: no layer was trimmed")
        for part in c.caches if isinstance(c, mlx_cache.CacheList) else (c,):
            try:
                getattr(part, "check_trim", lambda n: None)(n)
            except ValueError as e:
                raise ValueError(f"layer {i}: {e}; no layer was trimmed") from e
    return [c.trim(n) for c in caches][0] if caches else 0


def register_with_mlx_lm(cls):
    """Make ``cls`` loadable by mlx_lm's ``load_prompt_cache`` (it looks names up in its cache module)."""
    setattr(mlx_cache, cls.__name__, cls)
    return cls
