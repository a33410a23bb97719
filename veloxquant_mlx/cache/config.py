"""``KVCacheConfig``: the one configuration object every cache is built from.

Its signature is the API reference's (a test checks it): shared fields written out, per-method flat fields
generated from the options classes (:mod:`.options`) in the spec's order. ``options=SnapKVOptions(...)`` fills
the flat fields; setting one directly still works but warns (``DeprecationWarning``); ``config.options`` is
always the method's options object. Every value is checked by its declaration's rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from .artifacts import ArtifactStore
from .base import _METHOD_TABLE, METHOD_NAMES
from .errors import QuantizerConfigError
from .observers import QuantizationObserver
from .options import (ALL_OPTIONS, FLAT_FIELD_OPTIONS, MAX_LAYERS, OPTIONS_BY_METHOD, SHARED_FIELDS, MethodOptions,
                      Rule, bitwidth, dims, method_fields, rng_seed, rule_of, tokens)

MethodName = Literal[METHOD_NAMES]  # the spec's 43 methods, in its order, then the library's own waterfill

#: The spec's order of the flat fields: a method places its options' aliases not placed yet, another name
#: that one alias, a tuple a field declared here (``DERIVED_FIELDS``); options left out come last.
_LAYOUT = (
    "turboquant_rvq", "kivi", "svdq", "kitty", "adakv", "xquant", "kvquant", "palu", "cachegen",
    ("cachegen_resolved_bits", "Optional[int]", bitwidth(None)), "minicache", "gear", "zipcache", "snapkv",
    "streaming_llm", "h2o", "tova", "pyramidkv", ("pyramid_resolved_budget", "Optional[int]", tokens(None)),
    "squeeze", ("squeeze_resolved_budget", "Optional[int]", tokens(None)), "chunkkv", "cam", "xkv", "nsnquant",
    "knorm", "skvq", "qfilters", "keyformer", "morphkv", "kvzip", "kvtc", "curdkv", "nestedkv", "amc", "a2ats",
    "anchorkv", "rocketkv", "age_tiered", "kivi_sink", "smooth_factors", "key_codebook", "value_codebook",
    "spectral", "vecinfer", "waterfill")


def flat_fields(layout) -> list[tuple[str, str, dataclasses.Field]]:
    """``(name, annotation, field)`` of the flat fields ``layout`` places, copied from their options
    declarations (which must agree where classes share one, e.g. ``residual_length``)."""
    out: dict[str, tuple] = {}
    for item in layout:
        if isinstance(item, tuple):
            out.setdefault(item[0], item)
            continue
        cls = OPTIONS_BY_METHOD.get(item, item)  # a method's options class, or one alias of the first owner
        cls, names = (cls, cls.FIELDS.values()) if isinstance(cls, type) else (FLAT_FIELD_OPTIONS[item][0], [item])
        for flat in names:
            f = next(f for f in dataclasses.fields(cls) if cls.FIELDS.get(f.name) == flat)
            old = out.setdefault(flat, (flat, f.type, field(default=f.default, metadata=f.metadata)))
            if (old[1], old[2].default, old[2].metadata.get("rule")) != (f.type, f.default, f.metadata.get("rule")):
                raise TypeError(f"{cls.__name__} declares flat field {flat} unlike an options class before it")
    return list(out.values())


def _with_flat_fields(cls):
    """Append the generated flat fields to ``cls`` before ``@dataclass`` reads its annotations."""
    for name, annotation, f in flat_fields(_LAYOUT + ALL_OPTIONS):
        cls.__annotations__[name] = annotation
        setattr(cls, name, f)
    return cls


_quiet = threading.local()  # per thread: a server builds per-layer configs on several


@contextlib.contextmanager
def _quiet_flat_fields():
    old = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = old


@dataclass
@_with_flat_fields
class KVCacheConfig:
    """Configuration for a KV cache. See the API reference for every field's meaning."""

    method: MethodName = 'turboquant_rvq'
    head_dim: int = dims(128)
    bit_width_inlier: Union[int, list] = 2
    bit_width_outlier: Optional[int] = bitwidth(None)
    jl_dim: Optional[int] = dims(None)
    n_outlier_channels: Optional[int] = dims(None, lo=0)
    n_calib_tokens: Optional[int] = tokens(None)
    enable_vectorized_attend: bool = True
    enable_outlier_two_stream: bool = False
    enable_fused_query_dot: bool = False
    seed: int = rng_seed(42)
    dtype: Any = None
    capacity: Optional[int] = tokens(None)
    sliding_window: Optional[int] = tokens(None)
    store: Optional[ArtifactStore] = None
    observers: list = field(default_factory=list)
    options: Optional[object] = None
    # ... then the per-method flat fields, generated from the options classes (``_LAYOUT``)

    def __post_init__(self):
        if self.options is not None:
            self._apply_options()
        elif not getattr(_quiet, "on", False):
            shared = SHARED_FIELDS.get(self.method, ())  # flat fields this method reads outside its options
            for name, classes in FLAT_FIELD_OPTIONS.items():
                if name not in shared and _differs(getattr(self, name), _DEFAULTS[name]):
                    cls = next((c for c in classes if c.METHOD == self.method), classes[0])
                    opt = next(o for o, f in cls.FIELDS.items() if f == name)
                    warnings.warn(f"KVCacheConfig.{name} is deprecated as a flat field; pass "
                                  f"options={cls.__name__}({opt}=...) instead", DeprecationWarning, stacklevel=3)
        validate_config(self)
        cls = OPTIONS_BY_METHOD.get(self.method)
        if self.options is None and cls is not None:  # the options object is what a cache reads
            self.options = cls(**{opt: getattr(self, flat) for opt, flat in cls.FIELDS.items()})

    def _apply_options(self):
        opts, expected = self.options, OPTIONS_BY_METHOD.get(self.method)
        if not isinstance(opts, MethodOptions):
            allowed = "an options dataclass from veloxquant_mlx.cache.options or None"
            raise QuantizerConfigError("options", opts, allowed)
        if type(opts) is not expected:
            allowed = expected.__name__ if expected else "None (this method has no options)"
            raise QuantizerConfigError("options", type(opts).__name__, f"{allowed} for method={self.method!r}")
        for flat, value in opts.flat_items():
            current = getattr(self, flat)
            if _differs(current, _DEFAULTS[flat]) and _differs(current, value):
                raise QuantizerConfigError(flat, current, "not to be set both directly and through options "
                                                          f"(options give {value!r})")
            setattr(self, flat, value)

    def option(self, name: str, default=None):
        """An option-only setting (``decode_evict``) from ``options``, else ``default``."""
        return getattr(self.options, name, default)  # getattr(None, name, default) is default

    def replace(self, **changes) -> "KVCacheConfig":
        """A copy with ``changes`` applied (per-layer configs; no deprecation warnings)."""
        if changes.get("method", self.method) != self.method and "options" not in changes:
            changes["options"] = None  # rebuilt for the new method from the flat fields
        opts = changes.get("options", self.options)
        opts = opts if isinstance(opts, MethodOptions) else None  # __post_init__ reports any other value
        own = {o: changes[f] for o, f in type(opts).FIELDS.items() if f in changes} if opts is not None else {}
        if own:  # a changed flat alias changes the options too
            changes["options"] = dataclasses.replace(opts, **own)
        if opts is not None and "options" in changes:  # new options replace the old ones' flat values
            for flat, value in changes["options"].flat_items():
                changes.setdefault(flat, value)
        with _quiet_flat_fields():
            return dataclasses.replace(self, **changes)


_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(KVCacheConfig)}
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(KVCacheConfig)}
_OWN_CHECKS = ("method", "bit_width_inlier", "dtype", "store", "observers", "options")  # validate_config's
FIELD_RULES = {f.name: rule_of(f) for f in dataclasses.fields(KVCacheConfig) if f.name not in _OWN_CHECKS}


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # arrays and other objects without a plain truth value
        return a is not b


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise QuantizerConfigError(name, value, allowed)


DTYPE_NAMES = ("float16", "bfloat16", "float32")


def allowed_values(name: str) -> str:
    """What field ``name`` accepts, in the words a ``QuantizerConfigError`` uses."""
    if name == "dtype":
        return f"None or mx.{', mx.'.join(DTYPE_NAMES)}"
    if name == "bit_width_inlier":
        return "an int in 1..8 or a non-empty list of ints in 1..8 (one per layer)"
    return FIELD_RULES[name].allowed if name in FIELD_RULES else "any value"


def validate_config(cfg: KVCacheConfig) -> None:
    """Raise ``QuantizerConfigError`` for the first invalid field of ``cfg``."""
    _check(isinstance(cfg.method, str) and cfg.method in _METHOD_TABLE, "method", cfg.method,
           f"one of {', '.join(METHOD_NAMES)}")
    bw, width = cfg.bit_width_inlier, Rule("int", lo=1, hi=8).accepts  # one width, or one per layer
    _check(0 < len(bw) <= MAX_LAYERS and all(map(width, bw)) if isinstance(bw, (list, tuple)) else width(bw),
           "bit_width_inlier", bw, allowed_values("bit_width_inlier"))
    if cfg.dtype is not None:
        import mlx.core as mx
        _check(isinstance(cfg.dtype, mx.Dtype) and any(cfg.dtype == getattr(mx, n) for n in DTYPE_NAMES), "dtype",
               cfg.dtype, allowed_values("dtype"))
    for name, rule in FIELD_RULES.items():
        rule.check(name, getattr(cfg, name))
    _check(isinstance(cfg.observers, list) and all(isinstance(o, QuantizationObserver) for o in cfg.observers),
           "observers", cfg.observers, "a list of QuantizationObserver")
    if cfg.n_outlier_channels is not None:
        _check(0 <= cfg.n_outlier_channels < cfg.head_dim, "n_outlier_channels", cfg.n_outlier_channels,
               f"an int in [0, head_dim={cfg.head_dim})")
    _check(cfg.store is None or isinstance(cfg.store, ArtifactStore), "store", cfg.store, "an ArtifactStore or None")
    for cls in ALL_OPTIONS:  # every method's flat fields hold valid values, alone and together
        cls.check_relations(lambda o, c=cls: getattr(cfg, c.FIELDS[o]))
    if cfg.options is not None:  # the option-only fields, and all fields of options without flat ones
        cfg.options.validate()


def validate_for_model(cfg: KVCacheConfig, head_dim: int, n_layers: int) -> None:
    """Refuse a sub-vector width over the head dim or a layer group set over the layer count (defaults pass:
    the methods shorten their last group); only the fields the method (and its ``quantize``) reads."""
    q = cfg.option("quantize")
    read = {f for m in (cfg.method, getattr(q, "METHOD", q)) if m for f in method_fields(m).values()}
    own = dict(q.flat_items()) if isinstance(q, MethodOptions) else {}  # the quantizer's options win
    for name, rule in FIELD_RULES.items():
        if name not in read:
            continue
        v = own.get(name, getattr(cfg, name))
        if rule.bound == "head_dim" and v is not None and v > head_dim:
            raise QuantizerConfigError(name, v, f"an int in 1..{head_dim} (the model's head_dim)")
        if rule.bound == "layers" and v > n_layers and v != _DEFAULTS[name]:
            raise QuantizerConfigError(name, v, f"an int in 1..{n_layers} (the model's layer count)")
