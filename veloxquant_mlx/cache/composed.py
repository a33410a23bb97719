"""Evict *and* quantize: an eviction method whose kept rows are stored as a quantizer's codes.

``options=SnapKVOptions(budget=1024, quantize="waterfill")`` (or ``quantize=WaterfillOptions(...)``): any eviction
method chooses the rows, any mlx_lm-protocol quantization method stores them (shared fields from the config).
``QuantizedEviction`` (one subclass per eviction class) holds ``evict`` and ``quant``. A prefill call decodes the
stored rows into ``evict`` ("thaw"), which appends, attends, scores with the call's real queries and evicts as
the plain method does; the kept rows then go to a fresh quantizer as one prefill, shown those queries ("freeze";
waterfill weighs its key widths by them). A decode call is appended to the quantizer and attended on its codes.
The kept positions are the plain method's; ``nbytes`` sums both parts. The quantizer sees the kept rows as its
rows ``0 .. K-1``: one that undoes RoPE (waterfill) quantizes keys rotated by ``position - row``.

Deviations from the plain methods:

* Decode calls do not evict (``decode_evict=True`` is refused) and do not update per-row scores.
* A later prefill call (chunked prompt, second turn) re-quantizes the rows it keeps from their decoded
  values with a fresh, newly calibrated quantizer: errors compound; not chunk-invariant, ``trim`` not exact.
* That fresh quantizer is a copy of the layer's (its RoPE bound); after loading from a file it is built from
  the config alone (waterfill then codes keys post-RoPE: exact up to its error, less compact).
* Without the dispatch point rows are frozen in ``update_and_fetch`` (key-proxy scores), unseen by queries.
* Not batchable.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import mlx.core as mx

from . import dispatch
from .base import implemented_class
from .contract import CompressedKVCache, config_from_json, register_with_mlx_lm
from .errors import QuantizerConfigError
from .eviction import EvictionKVCache
from .options import MethodOptions, quantizer_methods
from .primitives.buffers import grow_rows

__all__ = ["QuantizedEviction", "composed_class", "quant_config", "register_composed"]


def layers_of(cls, configs) -> list:
    return cls.build_layers(configs) if hasattr(cls, "build_layers") else [cls(c) for c in configs]


def quant_config(config):
    """The quantizer's config: ``config`` with the quantizer's method and options (``options.quantize``)."""
    q = config.options.quantize
    method, opts = (q.METHOD, q) if isinstance(q, MethodOptions) else (q, None)
    return config.replace(method=method, options=opts)


class QuantizedEviction(CompressedKVCache):
    """Base of the composed caches; ``composed_class`` makes one subclass per eviction class."""

    evict_class: type = EvictionKVCache
    chunk_invariant = False  # each prefill call evicts and re-quantizes what it keeps
    exact_trim = False  # quantizer trims are not exact (window compaction, completed groups)
    scalar_fields = ("frozen",)
    frozen = False  # the rows live in ``quant`` (after a prefill call's attention, and while decoding)

    def __init__(self, config, evict=None, quant=None):
        super().__init__(config)
        self.evict = evict if evict is not None else self.evict_class(config)
        self.evict.decode_evict = False
        q = quant_config(config)
        self.quant = quant if quant is not None else implemented_class(q.method)(q)
        self._blank = None  # an empty copy of the quantizer as built (bound to its layer), taken before use

    @classmethod
    def build_layers(cls, configs):
        """The eviction class's and the quantizer class's own per-layer construction, paired."""
        qconfigs = [quant_config(c) for c in configs]
        qs = layers_of(implemented_class(qconfigs[0].method), qconfigs) if qconfigs else []
        return [cls(c, e, q) for c, e, q in zip(configs, layers_of(cls.evict_class, configs), qs)]

    def bind_attention(self, attn) -> None:
        for part in (self.evict, self.quant):
            if hasattr(part, "bind_attention"):
                part.bind_attention(attn)

    @property
    def io_hooks(self):
        return getattr(self.evict, "io_hooks", {})

    def __getattr__(self, name):  # the eviction cache's hidden-state reports (``io_hooks``)
        ev = self.__dict__.get("evict")
        if ev is not None and name in getattr(ev, "io_hooks", {}).values():
            return getattr(ev, name)
        raise AttributeError(name)

    def update_and_fetch(self, keys, values):
        ev, n = self.evict, keys.shape[2]
        if self.frozen and n == 1:  # decode: the quantizer stores and attends
            ev._raise_if_nonfinite()  # the last prefill chunk's check (the eviction cache sees no more calls)
            out = self.quant.update_and_fetch(keys, values)
            pos = mx.full((keys.shape[0], keys.shape[1], 1), self.offset, mx.int32)
            ev.positions = grow_rows(ev.positions, ev.rows, pos)
            for name in ev.row_fields:
                setattr(ev, name, grow_rows(getattr(ev, name), ev.rows, mx.zeros(pos.shape, mx.float32)))
            ev.rows += 1
            ev.offset += 1
        else:
            self._thaw()
            out = ev.update_and_fetch(keys, values)
            if not dispatch.installed():  # no ``attend`` will come: evicted already, freeze now
                self._freeze(None, None)
        self._shape = ev._shape
        self.offset += n
        return out

    def _thaw(self) -> None:
        """Decode the frozen rows back into the eviction cache (a prefill call scores them)."""
        if self.frozen:
            if self.evict.rows:  # (none after a trim of every row: the eviction cache starts afresh)
                k, v = self.quant._dense()
                dt = self.evict.storage_dtype(k.dtype)
                self.evict.keys, self.evict.values = k.astype(dt), v.astype(dt)
            self.frozen = False

    def _freeze(self, queries, scale) -> None:
        """Hand the eviction cache's kept rows to a fresh quantizer (shown ``queries``, if any)."""
        ev = self.evict
        n, dt = ev.rows, getattr(ev, "compute_dtype", ev.keys.dtype)
        k, v = mx.contiguous(ev.keys[:, :, :n].astype(dt)), mx.contiguous(ev.values[:, :, :n].astype(dt))
        ev.keys = ev.values = None
        if self._blank is None and self.quant.offset == 0:
            self._blank = copy.copy(self.quant)
        q = copy.copy(self._blank) if self._blank is not None else type(self.quant)(self.quant.config)
        qk, qv = q.update_and_fetch(k, v)
        if queries is not None:  # the quantizer sees the real queries (to calibrate)
            q.attend(queries[:, :, -n:], qk, qv, scale=scale, mask=None)
        self.quant, self.frozen = q, True

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self.frozen:
            return self.quant.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        out = self.evict.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        self._freeze(queries, scale)
        return out

    def _dense(self):
        return self.quant._dense() if self.frozen else self.evict._dense()

    def stored_rows(self) -> int:
        return self.evict.rows

    def _check_trim_rows(self, n: int) -> None:
        """Refused unless every head still holds the ``n`` newest rows (the eviction part) and, rows frozen, the
        quantizer that holds them can trim them."""
        self.evict._check_trim_rows(n)  # (ev.offset is ours)
        if self.frozen:
            self.quant.check_trim(n)

    def _trim_rows(self, n: int) -> int:
        """The newest ``n`` rows from both parts."""
        ev = self.evict
        dropped = ev._trim_rows(n)
        if self.frozen:
            ev.rows += n  # the quantizer may drop fewer, or raise
            dropped = self.quant.trim(n)
            ev.rows -= dropped
        ev.offset -= dropped
        return dropped

    def held_arrays(self):
        """Both parts' (during a prefill call the thawed rows are read from the quantizer, still held)."""
        return self.evict.held_arrays() + self.quant.held_arrays()

    @property
    def quantized_rows(self) -> int:
        """Rows held as the quantizer's (0 while a prefill call is between store and attention)."""
        return self.quant.stored_rows() if self.frozen else 0

    @property
    def state(self):
        return {**CompressedKVCache.state.fget(self), "evict": self.evict.state, "quant": self.quant.state}

    @state.setter
    def state(self, v):
        CompressedKVCache.state.fset(self, v)
        self.evict = self.evict_class.from_state(v["evict"])
        self.quant = implemented_class(self.part_method(v["quant"])).from_state(v["quant"])
        q = self.quant.config.options if self.quant.config.options is not None else self.quant.config.method
        self.config = self.config.replace(options=dataclasses.replace(self.config.options, quantize=q))
        self._blank = None

    @staticmethod
    def part_method(part_state) -> str:
        """The method of a part's state (its config names it)."""
        return config_from_json(json.loads(part_state["meta"])["config"]).method

    @classmethod
    def part_classes(cls, state) -> dict:
        """``{"evict": (class, method), "quant": (class, method)}`` of a saved state (saved.py checks each
        part as a cache of its own method); ``ValueError`` unless ``quant`` is a quantization method."""
        name = cls.part_method(state["quant"])
        if name not in quantizer_methods():
            raise ValueError(f"its quantizer {name!r} is not an mlx_lm-protocol quantization method")
        return {"evict": (cls.evict_class, cls.method_name), "quant": (implemented_class(name), name)}


_CLASSES: dict[type, type] = {}


def composed_class(evict_cls: type) -> type:
    """The ``QuantizedEviction`` subclass of ``evict_cls`` (made once, registered with mlx_lm)."""
    if not (isinstance(evict_cls, type) and issubclass(evict_cls, EvictionKVCache)):
        raise QuantizerConfigError("quantize", getattr(evict_cls, "method_name", evict_cls),
                                   "None: only eviction methods (EvictionKVCache) keep their rows quantized")
    if evict_cls not in _CLASSES:
        _CLASSES[evict_cls] = register_with_mlx_lm(type(
            f"Quantized{evict_cls.__name__}", (QuantizedEviction,),
            {"evict_class": evict_cls, "method_name": evict_cls.method_name, "__module__": __name__,
             "__doc__": f"{evict_cls.__name__}, kept rows quantized."}))
    return _CLASSES[evict_cls]


def register_composed() -> None:
    """Make every built eviction method's composed class (saved caches load in a new process)."""
    from .base import EVICTION, all_methods
    for info in all_methods():
        if info.family == EVICTION and isinstance(info.cls, type) and issubclass(info.cls, EvictionKVCache):
            composed_class(info.cls)
