"""Per-method options: the one declaration of every per-method setting.

``KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=256))``; a cache reads ``config.options``. A
field declares its default and what it accepts (``budget: int = tokens(512)``; ``Optional`` admits None).
From that come its :class:`Rule` (checks, error text, ``veloxquant methods``' "allowed") and, for the spec's
methods, its flat ``KVCacheConfig`` field ``<flat_prefix>_<name>`` (or its ``alias``). Option-only fields
(``OPTION_ONLY``) are checked when the options object is built, the others by the config under their flat
name. To add a method with a setting: ``class FooOptions(MethodOptions, method="foo")`` with
``budget: int = tokens(64)``; the spec's methods are declared in the table form (:func:`options_class`).
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Callable, ClassVar, Optional, dataclass_transform

from .errors import QuantizerConfigError

__all__ = ["MethodOptions", "EvictionOptions", "Rule", "ALL_OPTIONS", "OPTIONS_BY_METHOD", "FLAT_FIELD_OPTIONS",
           "COMMON_FIELDS", "SHARED_FIELDS", "DERIVED_FIELDS", "method_fields"]  # + each class

#: Upper bounds of integer settings: above any model this library runs, low enough that an absurd value fails
#: here instead of in an allocation or a 32-bit index deep inside a cache.
MAX_TOKENS = 1 << 20  # budgets, windows, sinks, residuals, calibration lengths, context caps
MAX_DIM = 4096  # channel counts: head dims, ranks, sub-vector and sketch widths
MAX_GROUP = 1024  # quantization groups (channels or tokens per scale)
MAX_LAYERS = 1024  # layer groups and layer counts
MAX_SEED = 2**31 - 1
MAX_ITERS = 10_000
MAX_FLOAT = 1e6  # rope bases, temperatures, strengths: far above any real value, below float16's overflow


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    """What one setting accepts (kind and ``Optional`` from its annotation, range or choices from its
    declaration); ``check`` raises ``QuantizerConfigError`` naming the field, the value and ``allowed``."""

    kind: str  # "int", "float", "bool", "choice", "ints" (a non-empty tuple of ints), "any"
    optional: bool = False
    lo: float = 0
    hi: float = 0
    lo_open: bool = False
    choices: tuple = ()
    words: str = ""  # ``allowed`` in other words than the range's
    bound: str = ""  # "head_dim" or "layers": ``validate_for_model`` also bounds it by the model's

    @property
    def allowed(self) -> str:
        lo, hi, k = self.lo, self.hi, self.kind
        text = self.words or {
            "choice": "one of " + ", ".join(map(repr, self.choices)), "bool": "True or False",
            "int": f"an int in {lo}..{hi}", "ints": f"a non-empty tuple of ints in {lo}..{hi}",
            "float": f"a number in {'(' if self.lo_open else '['}{lo:g}, {hi:g}]"}.get(k, "any value")
        return text + (" or None" if self.optional and "None" not in text and k != "any" else "")

    def accepts(self, v) -> bool:
        lo, hi, k = self.lo, self.hi, self.kind
        if v is None and self.optional:
            return True
        if k == "choice":
            return isinstance(v, str) and v in self.choices
        if k == "bool":
            return isinstance(v, bool)
        if k == "int":
            return _is_int(v) and lo <= v <= hi
        if k == "float":
            ok = _is_int(v) or isinstance(v, float) and math.isfinite(v)  # an int too large for a float is out of range
            return ok and (v > lo if self.lo_open else v >= lo) and v <= hi
        if k == "ints":
            return isinstance(v, (tuple, list)) and 0 < len(v) <= 64 and all(_is_int(b) and lo <= b <= hi for b in v)
        return True

    def check(self, name: str, value) -> None:
        if not self.accepts(value):
            raise QuantizerConfigError(name, value, self.allowed)


_KINDS = (("bool", "bool"), ("tuple", "ints"), ("float", "float"), ("int", "int"))


def rule_of(f, owner: str = "KVCacheConfig") -> Rule:
    """The :class:`Rule` of dataclass field ``f``; a number field must declare its range."""
    spec, t = f.metadata.get("rule", {}), str(f.type).replace("typing.", "")
    kind = "choice" if spec.get("choices") else next((k for s, k in _KINDS if s in t), "any")
    if kind in ("int", "float", "ints") and "hi" not in spec:
        raise TypeError(f"{owner}.{f.name}: declare what it accepts, e.g. tokens({f.default!r})")
    return Rule(kind, t.startswith("Optional"), **spec)


_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", tuple: "tuple"}


def setting(default, lo=None, hi=None, *, alias: Optional[str] = None, option_only: bool = False,
            optional: bool = False, annotation: Optional[str] = None, **rule) -> Any:
    """A field with its default, the range (``lo``..``hi``) or ``choices`` it accepts (refined by ``Rule``'s
    other keywords) and its flat alias where not ``<flat_prefix>_<name>``. ``annotation`` (else the type of the
    default or ``lo``; ``Optional`` for a None default or ``optional``) types it in :func:`options_class`."""
    if hi is not None:
        rule.update(lo=lo, hi=hi)
    t = annotation or _TYPE_NAMES.get(type(lo if default is None else default), "Any")
    t = f"Optional[{t}]" if (default is None or optional) and t != "Any" else t
    return field(default=default, metadata={"rule": rule, "alias": alias, "option_only": option_only, "type": t})


def one_of(*choices, **kw) -> Any:
    """A string among ``choices``; the first is the default."""
    return setting(choices[0], choices=choices, **kw)


tokens = partial(setting, lo=1, hi=MAX_TOKENS)  # budgets, windows, sinks (lo=0), residuals, context caps
dims = partial(setting, lo=1, hi=MAX_DIM)  # head dims, ranks, sketch and sub-vector widths
groups = partial(setting, lo=1, hi=MAX_GROUP)  # quantization groups: channels or tokens per scale
layers = partial(setting, lo=1, hi=MAX_LAYERS)  # layer groups (bound="layers": at most the model's), head groups
bitwidth = partial(setting, lo=1, hi=8)
rng_seed = partial(setting, lo=0, hi=MAX_SEED)
unit = partial(setting, lo=0.0, hi=1.0)  # fractions, probabilities, weights
nonneg = partial(setting, lo=0.0, hi=MAX_FLOAT)  # temperatures, strengths, exponents
rope = partial(setting, lo=1.0, hi=1e9, lo_open=True, words="a number > 1 and <= 1e9")  # RoPE base frequencies


@dataclass_transform(field_specifiers=(field, setting, one_of))
class MethodOptions:
    """Base of the options dataclasses: ``class SnapKVOptions(MethodOptions, method="snapkv", flat_prefix="snap",
    evicts=True)`` becomes a dataclass; ``evicts`` adds the option-only ``decode_evict`` (does the budget also
    hold while decoding; None: the method's default). Without ``method``, a base of options classes."""

    METHOD: ClassVar[str] = ""
    FIELDS: ClassVar[dict[str, str]] = {}  # option -> its flat KVCacheConfig field
    OPTION_ONLY: ClassVar[tuple[str, ...]] = ()  # options without a flat field
    RULES: ClassVar[dict[str, Rule]] = {}

    def __init_subclass__(cls, method: str = "", flat_prefix: Optional[str] = None, evicts: bool = False, **kw):
        super().__init_subclass__(**kw)
        if evicts:
            cls.__annotations__["decode_evict"] = "Optional[bool]"
            cls.decode_evict = setting(None, words="None (the method's default), True or False", option_only=True)
            cls.__annotations__["quantize"] = "Any"  # the kept rows' storage (cache/composed.py)
            cls.quantize = setting(None, words=QUANTIZE_WORDS, option_only=True)
        cls.__doc__ = cls.__doc__ or f"Options of ``{method}``."
        dataclass(cls)
        cls.METHOD, cls.RULES = method, {f.name: rule_of(f, cls.__name__) for f in fields(cls)}
        cls.FIELDS = {f.name: f.metadata.get("alias") or "_".join(filter(None, (flat_prefix, f.name)))
                      for f in fields(cls) if flat_prefix is not None and not f.metadata.get("option_only")}
        cls.OPTION_ONLY = tuple(n for n in cls.RULES if n not in cls.FIELDS)

    def __post_init__(self):
        for name in self.OPTION_ONLY:
            self.RULES[name].check(name, getattr(self, name))
        if getattr(self, "quantize", None) is not None:
            check_quantize(self.quantize, self.decode_evict)

    def validate(self) -> None:
        """Raise ``QuantizerConfigError`` for the first invalid field, named by its flat alias if it has one."""
        for name, rule in self.RULES.items():
            rule.check(self.FIELDS.get(name, name), getattr(self, name))
        self.check_relations(lambda n: getattr(self, n))

    @classmethod
    def check_relations(cls, get: Callable[[str], Any]) -> None:
        """Checks between fields (``get(name)`` gives a field's value), after each field's own check."""

    def flat_items(self):
        """(flat field name, value) pairs this options object sets (option-only fields excluded)."""
        return [(flat, getattr(self, name)) for name, flat in self.FIELDS.items()]


QUANTIZE_WORDS = ("None (rows kept at 16 bits), or the quantization method that stores the kept rows: its name "
                  "('waterfill', 'kivi', ...) or its options object (WaterfillOptions(residual_length=16))")


def quantizer_methods() -> list[str]:
    """The methods ``quantize`` accepts: the mlx_lm-protocol quantization methods."""
    from .base import _METHOD_TABLE, MLX_LM, QUANTIZATION
    return [m for m, (fam, proto, _) in _METHOD_TABLE.items() if (fam, proto) == (QUANTIZATION, MLX_LM)]


def check_quantize(value, decode_evict) -> None:
    """``quantize`` names an mlx_lm-protocol quantization method (or is its options); decode-time eviction
    is not available with it (the composed cache evicts at prefill calls)."""
    name = value.METHOD if isinstance(value, MethodOptions) else value
    if name not in quantizer_methods():
        raise QuantizerConfigError("quantize", value, QUANTIZE_WORDS)
    if decode_evict:
        raise QuantizerConfigError("decode_evict", decode_evict,
                                   "None or False with quantize (the quantized cache evicts at prefill calls only)")


class EvictionOptions(MethodOptions):
    """The fields most eviction methods open with: ``budget`` rows kept per head, the first ``n_sink``
    tokens always among them."""

    budget: int = tokens(512)
    n_sink: int = tokens(4, lo=0)


def options_class(name: str, method: str, flat_prefix: str, base: type = MethodOptions, *, evicts: bool = False,
                  doc: Optional[str] = None, relations: Optional[Callable] = None, **declared) -> type:
    """``class name(base, method=, flat_prefix=, evicts=)`` with the fields ``declared`` in order
    (``budget=tokens(512)``; a plain value: a field of its type) and ``relations`` as ``check_relations``."""
    fs = {k: v if isinstance(v, dataclasses.Field) else setting(v) for k, v in declared.items()}
    body = {"__annotations__": {k: f.metadata["type"] for k, f in fs.items()}, **fs, "__module__": __name__,
            "__qualname__": name, "__doc__": doc}
    if relations is not None:
        body["check_relations"] = classmethod(relations)
    return types.new_class(name, (base,), {"method": method, "flat_prefix": flat_prefix, "evicts": evicts},
                           lambda ns: ns.update(body))


def _amc_relations(cls, get):
    if get("k_high") + get("k_mid") > 1.0:
        raise QuantizerConfigError("amc_k_mid", get("k_mid"),
                                   f"amc_k_high + amc_k_mid <= 1 (amc_k_high={get('k_high')})")


def _age_relations(cls, get):
    if get("mid_boundary") < get("recent_boundary"):
        raise QuantizerConfigError("age_mid_boundary", get("mid_boundary"),
                                   f"an int >= age_recent_boundary={get('recent_boundary')}")


_BACKENDS = ("auto", "mlx", "metal", "reference")
# The spec's methods' options, one declaration each (the table form of the class statement above).
SnapKVOptions = options_class(
    "SnapKVOptions", "snapkv", "snap", evicts=True, dtype=one_of("auto", "float16", "bfloat16", "float32"),
    batched_scoring=True, backend=one_of(*_BACKENDS), budget=tokens(512), obs_window=tokens(32),
    n_sink=tokens(4, lo=0))
StreamingLLMOptions = options_class("StreamingLLMOptions", "streaming_llm", "stream", evicts=True,
                                    n_sink=tokens(4, lo=0), window_size=tokens(512))
H2OOptions = options_class("H2OOptions", "h2o", "h2o", EvictionOptions, evicts=True, rope_base=rope(10000.0),
                           grace=tokens(16), decay=setting(0.98, 0.0, 1.0, lo_open=True))
TOVAOptions = options_class("TOVAOptions", "tova", "tova", EvictionOptions, evicts=True, backend=one_of(*_BACKENDS))
PyramidKVOptions = options_class(
    "PyramidKVOptions", "pyramidkv", "pyramid", evicts=True, budget=tokens(512),
    backend=one_of("reference", "mlx", "auto"), n_sink=tokens(4, lo=0), beta=nonneg(2.0))
SqueezeOptions = options_class("SqueezeOptions", "squeeze", "squeeze", EvictionOptions, evicts=True,
                               strength=nonneg(1.0))
ChunkKVOptions = options_class(
    "ChunkKVOptions", "chunkkv", "chunkkv", evicts=True, budget=tokens(512), chunk_size=tokens(8),
    n_sink=tokens(4, lo=0), score=one_of("attn_mass", "key_norm"), reuse_layers=layers(1, bound="layers"))
CaMOptions = options_class("CaMOptions", "cam", "cam", EvictionOptions, evicts=True,
                           merge=one_of("sim_weighted", "mean", "drop"), merge_keys=False, merge_gate=True)
XKVOptions = options_class(
    "XKVOptions", "xkv", "xkv", group_size=layers(2, bound="layers"), rank=dims(None), energy_threshold=unit(0.95),
    latent_bits=bitwidth(4), group_quant_size=groups(32), max_ctx=tokens(8192))
NSNQuantOptions = options_class(
    "NSNQuantOptions", "nsnquant", "nsn", bits=bitwidth(2), residual_length=tokens(64),
    codebook_size=setting(256, 2, 1 << 16), subvector_dim=dims(8, bound="head_dim"), seed=rng_seed(1234),
    max_ctx=tokens(8192))
KNormOptions = options_class("KNormOptions", "knorm", "knorm", EvictionOptions, evicts=True,
                             recent=tokens(0, lo=0), keep=one_of("low", "high"))
SKVQOptions = options_class(
    "SKVQOptions", "skvq", "skvq", bits_key=bitwidth(2), bits_value=bitwidth(2), group_size=groups(32),
    window=tokens(128), n_sink=tokens(5, lo=0), reorder=True, clip_search=True, clip_alpha=nonneg(1.0),
    max_ctx=tokens(None))
QFiltersOptions = options_class(
    "QFiltersOptions", "qfilters", "qfilters", EvictionOptions, evicts=True, recent=tokens(0, lo=0),
    calib_tokens=tokens(128), sign=setting(1, -1, 1), min_retention=unit(0.9, optional=True),
    on_low_retention=one_of("warn", "raise", "ignore", annotation="Literal['warn', 'raise', 'ignore']"))
KeyformerOptions = options_class(
    "KeyformerOptions", "keyformer", "keyformer", EvictionOptions, evicts=True, recent=tokens(0, lo=0),
    tau=nonneg(None), tau_init=nonneg(1.0), tau_end=nonneg(1.0), anneal_steps=tokens(0, lo=0),
    rope_base=rope(10000.0), seed=rng_seed(0))
MorphKVOptions = options_class("MorphKVOptions", "morphkv", "morphkv", EvictionOptions, evicts=True,
                               window=tokens(8))
KVzipOptions = options_class("KVzipOptions", "kvzip", "kvzip", EvictionOptions, evicts=True,
                             probe=one_of("context", "repeat"))
KVTCOptions = options_class("KVTCOptions", "kvtc", "kvtc", bit_budget=tokens(512),
                            bit_choices=setting((0, 1, 2, 3, 4, 6, 8), 0, 16), beta=nonneg(3.5))
CurDKVOptions = options_class("CurDKVOptions", "curdkv", "curdkv", EvictionOptions, evicts=True,
                              rank_cap=dims(16), rope_base=rope(10000.0))
NestedKVOptions = options_class(
    "NestedKVOptions", "nestedkv", "nestedkv", EvictionOptions, evicts=True, window=tokens(64), beta=nonneg(3.0),
    tau=nonneg(0.6), kappa=nonneg(10.0), safeguard_alpha=nonneg(0.2))
AMCOptions = options_class(
    "AMCOptions", "amc", "amc", relations=_amc_relations, k_high=nonneg(0.2), k_mid=nonneg(0.3),
    use_query_saliency=False, query_alpha=nonneg(0.5), adaptive_thresholds=False, threshold_window=tokens(64),
    gamma=nonneg(0.1), calib_variance=setting(None, -MAX_FLOAT, MAX_FLOAT, words="a finite number"),
    group_size=groups(32))
A2ATSOptions = options_class(
    "A2ATSOptions", "a2ats", "a2ats", codebook_bits=bitwidth(8, hi=16), sub_dim=dims(8, bound="head_dim"),
    window=tokens(128), b=tokens(2048), use_query_aware=True, beta=nonneg(0.5), retrieval_fraction=unit(0.2),
    rope_base=rope(10000.0), rope_scaling=None, query_h=None, codebook=None)
AnchorKVOptions = options_class(
    "AnchorKVOptions", "anchorkv", "anchorkv", theta=nonneg(0.05), window=tokens(32), rho=unit(0.7),
    anchor_frac=unit(0.0078125), residual_bits=bitwidth(2), seed=rng_seed(42))
RocketKVOptions = options_class(
    "RocketKVOptions", "rocketkv", "rocketkv", evicts=True,
    compression_ratio=setting(8.0, 1.0, 1e4, lo_open=True, words="a number > 1 and <= 10000"),
    page_size=tokens(None), head_topk1=tokens(None), obs_window=tokens(32), n_sink=tokens(4, lo=0))
AgeTieredOptions = options_class(
    "AgeTieredOptions", "age_tiered", "age", relations=_age_relations, recent_boundary=tokens(128),
    mid_boundary=tokens(1024), bits_recent=bitwidth(8), bits_mid=bitwidth(4), bits_old=bitwidth(2),
    group_size=groups(32))
KIVIOptions = options_class("KIVIOptions", "kivi", "kivi", group_size=groups(32))
SVDqOptions = options_class(
    "SVDqOptions", "svdq", "svdq", rank=dims(None), energy_threshold=unit(0.95),
    bit_schedule=setting((8, 4, 2, 1, 1, 0, 0, 0), 0, 16, annotation="tuple[int, ...]"), group_size=groups(32))
KittyOptions = options_class("KittyOptions", "kitty", "kitty", hi_fraction=unit(0.25), hi_bit=bitwidth(4),
                             lo_bit=bitwidth(2), group_size=groups(32))
AdaKVOptions = options_class(
    "AdaKVOptions", "adakv", "adakv", target_avg_bits=nonneg(2.5), lo_bit=bitwidth(2), mid_bit=bitwidth(3),
    hi_bit=bitwidth(4), group_size=groups(32), update_interval=tokens(1),
    importance=one_of("norm_variance", "attention", "norm"), obs_window=tokens(32))
XQuantOptions = options_class(
    "XQuantOptions", "xquant", "xquant", group_size=layers(2, bound="layers"), base_bits=bitwidth(2),
    residual_bits=bitwidth(4), group_quant_size=groups(32), max_ctx=tokens(8192))
KVQuantOptions = options_class(
    "KVQuantOptions", "kvquant", "kvquant", bits=bitwidth(3), outlier_fraction=unit(0.01), group_size=groups(32),
    lloyd_iters=setting(8, 1, MAX_ITERS), refit_interval=tokens(0, lo=0), n_sink=tokens(1, lo=0))
PaluOptions = options_class(
    "PaluOptions", "palu", "palu", rank=dims(None), energy_threshold=unit(0.9), n_head_groups=layers(4),
    hi_bit=bitwidth(4), lo_bit=bitwidth(2), hi_fraction=unit(0.25), group_size=groups(32), quantize_values=True)
CacheGenOptions = options_class(
    "CacheGenOptions", "cachegen", "cachegen", bits=bitwidth(4), group_size=groups(32), use_delta=True,
    per_channel=True, layer_groups=layers(3, bound="layers"))
MiniCacheOptions = options_class(
    "MiniCacheOptions", "minicache", "minicache", start_frac=unit(0.5), group_size=layers(2, bound="layers"),
    retention_threshold=setting(0.9, -1.0, 1.0, words="a cosine in [-1, 1]"), slerp_t=unit(0.5),
    max_ctx=tokens(8192))
GEAROptions = options_class(
    "GEAROptions", "gear", "gear", bits=bitwidth(2), rank=dims(None), energy_threshold=unit(0.9),
    sparse_fraction=unit(0.01), group_size=groups(32), quantize_values=True)
ZipCacheOptions = options_class(
    "ZipCacheOptions", "zipcache", "zipcache", hi_bits=bitwidth(4), lo_bits=bitwidth(2), hi_fraction=unit(0.2),
    group_size=groups(32), quantize_values=True)
SpectralOptions = options_class("SpectralOptions", "spectral", "spectral", key_d_eff=dims(4), val_d_eff=dims(50),
                                apply_qjl=True, model_name="model")
TurboQuantRVQOptions = options_class(
    "TurboQuantRVQOptions", "turboquant_rvq", "", key_sub_dim=dims(4, bound="head_dim"),
    value_sub_dim=dims(8, bound="head_dim"), key_codebook_bits=bitwidth(12, hi=16),
    value_codebook_bits=bitwidth(8, hi=16), residual_length=tokens(128))
KIVISinkOptions = options_class("KIVISinkOptions", "kivi_sink", "kivi", group_size=groups(32),
                                n_sink_tokens=tokens(5, lo=0, alias="n_sink_tokens"))
VecInferOptions = options_class(
    "VecInferOptions", "vecinfer", "", smooth_factors=None, key_codebook=None, value_codebook=None,
    use_metal_kernels=setting(None, annotation="bool"), fused_sdpa=setting(False, optional=True),
    fused_sdpa_max_ctx=tokens(None), fused_sdpa_memory_bound=False)
WaterfillOptions = options_class(
    "WaterfillOptions", "waterfill", "", residual_length=tokens(128),
    doc="Options of ``waterfill`` (its widths are ``bit_width_inlier``, its calibration length ``n_calib_tokens``: "
        "flat fields every method reads).")

#: Every options class above, in declaration order (the spec's method order).
ALL_OPTIONS: tuple[type, ...] = tuple(v for v in list(globals().values())
                                      if isinstance(v, type) and issubclass(v, MethodOptions) and v.METHOD)
__all__ += [c.__name__ for c in ALL_OPTIONS]
OPTIONS_BY_METHOD: dict[str, type] = {o.METHOD: o for o in ALL_OPTIONS}

#: flat field -> options classes that set it (kivi_group_size belongs to KIVI and KIVI-sink)
FLAT_FIELD_OPTIONS: dict[str, list[type]] = {f: [c for c in ALL_OPTIONS if f in c.FIELDS.values()]
                                             for c in ALL_OPTIONS for f in c.FIELDS.values()}

#: Config fields the builder applies to every method (a wrapper, hooks), whatever the method.
COMMON_FIELDS: tuple[str, ...] = ("sliding_window", "store", "observers")

_EVICTION_SHARED = ("dtype",)  # eviction rows are stored at 16 bits unless ``dtype`` overrides
_RVQ_CODEBOOKS = ("key_sub_dim", "value_sub_dim", "key_codebook_bits", "value_codebook_bits")
_TURBOQUANT = ("head_dim", "bit_width_inlier", "bit_width_outlier", "n_outlier_channels", "n_calib_tokens", "seed",
               "dtype", "capacity")

#: Per method, the flat fields outside its options that its cache reads (``head_dim`` only for the standalone
#: ones; the spec's ``enable_*`` flags are read by none). ``tests/test_config.py`` records every config read
#: of each method and checks this table both ways.
SHARED_FIELDS: dict[str, tuple[str, ...]] = {
    **{c.METHOD: _EVICTION_SHARED for c in ALL_OPTIONS if "decode_evict" in c.RULES},  # the eviction methods
    "turboquant_prod": _TURBOQUANT + ("jl_dim",),  # the QJL residual's sketch width (the MSE variant has none)
    "turboquant_mse": _TURBOQUANT,
    "polar": ("head_dim", "bit_width_inlier", "seed", "dtype", "capacity"),
    "qjl": ("head_dim", "bit_width_inlier", "jl_dim", "seed", "dtype", "capacity"),
    "spectral": ("head_dim", "bit_width_inlier", "jl_dim", "n_calib_tokens", "seed", "dtype", "capacity"),
    "turboquant_rvq": ("seed", "dtype"),
    "waterfill": ("bit_width_inlier", "n_calib_tokens", "seed", "dtype"),
    "vecinfer": _RVQ_CODEBOOKS + ("seed",),
    "kivi": ("bit_width_inlier",),
    "kivi_sink": ("bit_width_inlier",),
    "svdq": ("bit_width_inlier",),  # its groups are svdq_group_size
    "kvtc": ("kivi_group_size",),
    "cam": ("seed",) + _EVICTION_SHARED,
    "a2ats": ("seed",),
}

#: Fields the library writes per layer when it builds a model's caches; never user settings.
DERIVED_FIELDS: tuple[str, ...] = ("cachegen_resolved_bits", "pyramid_resolved_budget", "squeeze_resolved_budget")


def method_fields(method: str) -> dict[str, str]:
    """Every setting name ``method`` accepts (option names, flat aliases, :data:`SHARED_FIELDS`,
    :data:`COMMON_FIELDS`) -> the flat field it sets (an option-only field: its own name). A shared field
    keeps a name an option also has (snapkv's ``dtype``; the option is ``snap_dtype``)."""
    o = OPTIONS_BY_METHOD.get(method)
    own = {**o.FIELDS, **{n: n for n in o.OPTION_ONLY}, **{f: f for f in o.FIELDS.values()}} if o else {}
    return {**own, **{f: f for f in SHARED_FIELDS.get(method, ()) + COMMON_FIELDS}}
