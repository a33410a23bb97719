"""Per-method options, the one declaration of every per-method setting (a cache reads ``config.options``).

A field declares its default and what it accepts (``budget: int = tokens(512)``; ``Optional`` admits None);
from that come its :class:`Rule` (check, error text, "allowed") and, for the spec's methods, its flat
``KVCacheConfig`` field ``<flat_prefix>_<name>`` (or ``alias``). Option-only fields are checked when the
options object is built, the others by the config. A new method: ``class FooOptions(MethodOptions,
method="foo")`` listed in ``ALL_OPTIONS``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Callable, ClassVar, Literal, Optional, dataclass_transform

from .errors import QuantizerConfigError

__all__ = ["MethodOptions", "EvictionOptions", "Rule", "ALL_OPTIONS", "OPTIONS_BY_METHOD", "FLAT_FIELD_OPTIONS",
           "COMMON_FIELDS", "SHARED_FIELDS", "DERIVED_FIELDS", "method_fields"]  # + each class

#: Bounds above any real model, low enough that an absurd value fails here, not in an allocation.
MAX_TOKENS = 1 << 20  # budgets, windows, sinks, residuals, calibration lengths, context caps
MAX_DIM = 4096  # channel counts: head dims, ranks, sub-vector and sketch widths
MAX_GROUP = 1024  # quantization groups (channels or tokens per scale)
MAX_LAYERS = 1024  # layer groups and layer counts
MAX_SEED = 2**31 - 1
MAX_FLOAT = 1e6  # rope bases, temperatures, strengths: far above any real value, below float16's overflow


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    """What one setting accepts (kind and ``Optional`` from its annotation, range or choices declared)."""

    kind: str  # "int", "float", "bool", "choice", "ints" (a non-empty tuple of ints), "any"
    optional: bool = False
    lo: float = 0
    hi: float = 0
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    words: str = ""  # ``allowed`` in other words than the range's
    bound: str = ""  # "head_dim" or "layers": ``validate_for_model`` also bounds it by the model's

    @property
    def allowed(self) -> str:
        lo, hi, k = self.lo, self.hi, self.kind
        ends = ("(" if self.lo_open else "[", ")" if self.hi_open else "]")
        text = self.words or {
            "choice": "one of " + ", ".join(map(repr, self.choices)), "bool": "True or False",
            "int": f"an int in {lo}..{hi}", "ints": f"a non-empty tuple of ints in {lo}..{hi}",
            "float": f"a number in {ends[0]}{lo:g}, {hi:g}{ends[1]}"}.get(k, "any value")
        return text + (" or None" if self.optional and "None" not in text and k != "any" else "")

    def accepts(self, v) -> bool:
        lo, hi, k = self.lo, self.hi, self.kind
        if v is None and self.optional:
            return True
        if k == "choice":
            c = self.choices[0]  # strings, ints (not bools) or bools
            return isinstance(v, type(c)) and isinstance(v, bool) == isinstance(c, bool) and v in self.choices
        if k == "bool":
            return isinstance(v, bool)
        if k == "int":
            return _is_int(v) and lo <= v <= hi
        if k == "float":
            ok = _is_int(v) or isinstance(v, float) and math.isfinite(v)  # an int too large for a float is out of range
            return ok and (v > lo if self.lo_open else v >= lo) and (v < hi if self.hi_open else v <= hi)
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


def setting(default, lo=None, hi=None, *, alias: Optional[str] = None, option_only: bool = False, **rule) -> Any:
    """A field with its default, the range (``lo``..``hi``) or ``choices`` it accepts (refined by ``Rule``'s
    other keywords) and its flat alias where not ``<flat_prefix>_<name>``."""
    if hi is not None:
        rule.update(lo=lo, hi=hi)
    return field(default=default, metadata={"rule": rule, "alias": alias, "option_only": option_only})


def one_of(*choices, **kw) -> Any:
    """A value among ``choices`` (all of one type: strings, ints or bools); the first is the default."""
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
    """Base of the options dataclasses (``class XOptions(MethodOptions, method=..., flat_prefix=...)``);
    ``evicts`` adds the option-only ``decode_evict`` and ``quantize``. Without ``method``, a base."""

    METHOD: ClassVar[str] = ""
    FIELDS: ClassVar[dict[str, str]] = {}  # option -> its flat KVCacheConfig field
    OPTION_ONLY: ClassVar[tuple[str, ...]] = ()  # options without a flat field
    RULES: ClassVar[dict[str, Rule]] = {}
    ORDER: ClassVar[tuple[tuple[str, str, str], ...]] = ()  # (a, op, b): field a (unless None) op field b

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
        q = getattr(self, "quantize", None)  # an mlx_lm-protocol quantization method, or its options
        if q is not None and (q.METHOD if isinstance(q, MethodOptions) else q) not in quantizer_methods():
            raise QuantizerConfigError("quantize", q, QUANTIZE_WORDS)
        if q is not None and self.decode_evict:
            raise QuantizerConfigError("decode_evict", self.decode_evict,
                                       "None or False with quantize (the quantized cache evicts at prefill calls only)")

    def validate(self) -> None:
        """Raise ``QuantizerConfigError`` for the first invalid field (named by its flat alias if any)."""
        for name, rule in self.RULES.items():
            rule.check(self.FIELDS.get(name, name), getattr(self, name))
        self.check_relations(lambda n: getattr(self, n))
        q = getattr(self, "quantize", None)
        if isinstance(q, MethodOptions):  # the quantizer's options, checked with the config, not at its build
            q.validate()

    @classmethod
    def check_relations(cls, get: Callable[[str], Any]) -> None:
        """Checks between fields (``get(name)`` gives a field's value), after each field's own check: ``ORDER``
        here, others in a subclass."""
        for a, op, b in cls.ORDER:
            x, y = get(a), get(b)
            if x is not None and not _COMPARE[op](x, y):
                raise QuantizerConfigError(cls.FIELDS.get(a, a), x, f"a value {op} {cls.FIELDS.get(b, b)}={y}")

    def flat_items(self):
        """(flat field, value) pairs this options object sets."""
        return [(flat, getattr(self, name)) for name, flat in self.FIELDS.items()]


_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
QUANTIZE_WORDS = ("None (rows kept at 16 bits), or the quantization method that stores the kept rows: its name "
                  "('waterfill', 'kivi', ...) or its options object (WaterfillOptions(residual_length=16))")


def quantizer_methods() -> list[str]:
    """The methods ``quantize`` accepts: the mlx_lm-protocol quantization methods."""
    from .base import _METHOD_TABLE, MLX_LM, QUANTIZATION
    return [m for m, (fam, proto, _) in _METHOD_TABLE.items() if (fam, proto) == (QUANTIZATION, MLX_LM)]


class EvictionOptions(MethodOptions):
    """The fields most eviction methods open with: ``budget`` rows kept per head, the first ``n_sink``
    tokens always among them."""

    budget: int = tokens(512)
    n_sink: int = tokens(4, lo=0)


class SnapKVOptions(MethodOptions, method="snapkv", flat_prefix="snap", evicts=True):
    dtype: str = one_of("auto", "float16", "bfloat16", "float32")
    batched_scoring: bool = True
    backend: str = one_of("auto", "mlx", "metal", "reference")
    budget: int = tokens(512)
    obs_window: int = tokens(32)
    n_sink: int = tokens(4, lo=0)


class StreamingLLMOptions(MethodOptions, method="streaming_llm", flat_prefix="stream", evicts=True):
    n_sink: int = tokens(4, lo=0)
    window_size: int = tokens(512)


class H2OOptions(EvictionOptions, method="h2o", flat_prefix="h2o", evicts=True):
    rope_base: float = rope(10000.0)
    grace: int = tokens(16)
    decay: float = setting(0.98, 0.0, 1.0, lo_open=True)


class TOVAOptions(EvictionOptions, method="tova", flat_prefix="tova", evicts=True):
    backend: str = one_of("auto", "mlx", "metal", "reference")


class PyramidKVOptions(MethodOptions, method="pyramidkv", flat_prefix="pyramid", evicts=True):
    budget: int = tokens(512)
    backend: str = one_of("reference", "mlx", "auto")
    n_sink: int = tokens(4, lo=0)
    beta: float = setting(2.0, 1.0, MAX_FLOAT, words="a number >= 1 (budgets decrease with depth; 1 is uniform)")


class SqueezeOptions(EvictionOptions, method="squeeze", flat_prefix="squeeze", evicts=True):
    strength: float = nonneg(1.0)


class ChunkKVOptions(MethodOptions, method="chunkkv", flat_prefix="chunkkv", evicts=True):
    budget: int = tokens(512)
    chunk_size: int = tokens(8)
    n_sink: int = tokens(4, lo=0)
    score: str = one_of("attn_mass", "key_norm")
    reuse_layers: int = layers(1, bound="layers")


class CaMOptions(EvictionOptions, method="cam", flat_prefix="cam", evicts=True):
    merge: str = one_of("sim_weighted", "mean", "drop")
    merge_keys: bool = False
    merge_gate: bool = True


class XKVOptions(MethodOptions, method="xkv", flat_prefix="xkv"):
    group_size: int = layers(2, bound="layers")
    rank: Optional[int] = dims(None)
    energy_threshold: float = unit(0.95, lo_open=True)
    latent_bits: int = bitwidth(4)
    group_quant_size: int = groups(32)
    max_ctx: int = tokens(8192)


class NSNQuantOptions(MethodOptions, method="nsnquant", flat_prefix="nsn"):
    bits: int = bitwidth(2)
    residual_length: int = tokens(64)
    codebook_size: int = one_of(256, *(1 << i for i in range(1, 8)), words="a power of two in 2..256")
    subvector_dim: int = setting(8, choices=tuple(1 << i for i in range(13)), bound="head_dim",
                                 words="a power of two >= 1 (dividing the head dim)")
    seed: int = rng_seed(1234)
    max_ctx: int = tokens(8192)

    @classmethod
    def check_relations(cls, get):
        lc = get("codebook_size").bit_length() - 1
        if get("bits") * get("subvector_dim") % lc:
            raise QuantizerConfigError("nsn_bits", get("bits"), "an int in 1..8 with nsn_bits * nsn_subvector_dim a "
                                       f"multiple of log2(codebook)={lc}")


class KNormOptions(EvictionOptions, method="knorm", flat_prefix="knorm", evicts=True):
    recent: int = tokens(0, lo=0)
    keep: str = one_of("low", "high")


class SKVQOptions(MethodOptions, method="skvq", flat_prefix="skvq"):
    bits_key: int = bitwidth(2)
    bits_value: int = bitwidth(2)
    group_size: int = groups(32)
    window: int = tokens(128)
    n_sink: int = tokens(5, lo=0)
    reorder: bool = True
    clip_search: bool = True
    clip_alpha: float = unit(1.0, lo_open=True)
    max_ctx: Optional[int] = tokens(None)


class QFiltersOptions(EvictionOptions, method="qfilters", flat_prefix="qfilters", evicts=True):
    recent: int = tokens(0, lo=0)
    calib_tokens: int = tokens(128)
    sign: int = one_of(1, -1, words="1 or -1")
    min_retention: Optional[float] = unit(0.9)
    on_low_retention: Literal['warn', 'raise', 'ignore'] = one_of("warn", "raise", "ignore")


class KeyformerOptions(EvictionOptions, method="keyformer", flat_prefix="keyformer", evicts=True):
    recent: int = tokens(0, lo=0)
    tau: Optional[float] = nonneg(None, lo_open=True)  # tau -> 0 is a limit, not a value
    tau_init: float = nonneg(1.0, lo_open=True)
    tau_end: float = nonneg(1.0, lo_open=True)
    anneal_steps: int = tokens(0, lo=0)
    rope_base: float = rope(10000.0)
    seed: int = rng_seed(0)

    @classmethod
    def check_relations(cls, get):
        if get("tau") is None and get("anneal_steps") == 0 and get("tau_end") != get("tau_init"):
            raise QuantizerConfigError("keyformer_anneal_steps", 0,
                                       "an int > 0 when keyformer_tau_end differs from keyformer_tau_init")


class MorphKVOptions(EvictionOptions, method="morphkv", flat_prefix="morphkv", evicts=True):
    window: int = tokens(8)


class KVzipOptions(EvictionOptions, method="kvzip", flat_prefix="kvzip", evicts=True):
    probe: str = one_of("context", "repeat")


class KVTCOptions(MethodOptions, method="kvtc", flat_prefix="kvtc"):
    bit_budget: int = tokens(512)
    bit_choices: tuple = setting((0, 1, 2, 3, 4, 6, 8), 0, 8)
    beta: float = nonneg(3.5, lo_open=True)  # lambda = 10**-beta; a large beta is the pure budget DP

    @classmethod
    def check_relations(cls, get):
        ch = get("bit_choices")
        if 0 not in ch or len(set(ch)) != len(ch) or len(ch) < 2:
            raise QuantizerConfigError("kvtc_bit_choices", ch, "distinct ints in 0..8 including 0 and one > 0")


class CurDKVOptions(EvictionOptions, method="curdkv", flat_prefix="curdkv", evicts=True):
    rank_cap: int = dims(16)
    rope_base: float = rope(10000.0)


class NestedKVOptions(EvictionOptions, method="nestedkv", flat_prefix="nestedkv", evicts=True):
    window: int = tokens(64)
    beta: float = nonneg(3.0)
    tau: float = nonneg(0.6)
    kappa: float = nonneg(10.0)
    safeguard_alpha: float = nonneg(0.2)


class AMCOptions(MethodOptions, method="amc", flat_prefix="amc"):
    k_high: float = unit(0.2)
    k_mid: float = unit(0.3)
    use_query_saliency: bool = one_of(False, words="False (query-blended saliency is not implemented: groups are "
                                                   "quantized in update_and_fetch, which sees no queries)")
    query_alpha: float = unit(0.5)
    adaptive_thresholds: bool = one_of(False, words="False (adaptive thresholds are not implemented; tiers are "
                                                    "fixed fractions)")
    threshold_window: int = tokens(64)
    gamma: float = nonneg(0.1)
    calib_variance: Optional[float] = one_of(None, words="None (not implemented)")
    group_size: int = groups(32, lo=2, hi=256)

    @classmethod
    def check_relations(cls, get):
        if get("k_high") + get("k_mid") > 1.0:
            raise QuantizerConfigError("amc_k_mid", get("k_mid"),
                                       f"amc_k_high + amc_k_mid <= 1 (amc_k_high={get('k_high')})")


class A2ATSOptions(MethodOptions, method="a2ats", flat_prefix="a2ats"):
    codebook_bits: int = bitwidth(8)
    sub_dim: int = dims(8, bound="head_dim")
    window: int = tokens(128)
    b: int = tokens(2048)
    use_query_aware: bool = True
    beta: float = unit(0.5)
    retrieval_fraction: float = unit(0.2, lo_open=True)
    rope_base: float = rope(10000.0)
    rope_scaling: Any = None
    query_h: Any = None
    codebook: Any = None

    @classmethod
    def check_relations(cls, get):
        if get("rope_scaling") is not None and not isinstance(get("rope_scaling"), (dict, int, float)):
            raise QuantizerConfigError("a2ats_rope_scaling", get("rope_scaling"), "None, a number or a dict")


class AnchorKVOptions(MethodOptions, method="anchorkv", flat_prefix="anchorkv"):
    theta: float = unit(0.05, hi_open=True)
    window: int = tokens(32, hi=255)  # anchor positions are stored as uint8
    rho: float = unit(0.7)
    anchor_frac: float = unit(0.0078125, lo_open=True)
    residual_bits: int = bitwidth(2)
    seed: int = rng_seed(42)


class RocketKVOptions(MethodOptions, method="rocketkv", flat_prefix="rocketkv", evicts=True):
    compression_ratio: float = setting(8.0, 1.0, 1e4, lo_open=True, words="a number > 1 and <= 10000")
    page_size: Optional[int] = tokens(None)
    head_topk1: Optional[int] = tokens(None)
    obs_window: int = tokens(32)
    n_sink: int = tokens(4, lo=0)


class AgeTieredOptions(MethodOptions, method="age_tiered", flat_prefix="age"):
    ORDER = (("mid_boundary", ">=", "recent_boundary"), ("bits_mid", ">=", "bits_old"),
             ("bits_mid", "<=", "bits_recent"))
    recent_boundary: int = tokens(128)
    mid_boundary: int = tokens(1024)
    bits_recent: int = bitwidth(8)
    bits_mid: int = bitwidth(4)
    bits_old: int = bitwidth(2)
    group_size: int = groups(32)


class KIVIOptions(MethodOptions, method="kivi", flat_prefix="kivi"):
    group_size: int = groups(32)


class SVDqOptions(MethodOptions, method="svdq", flat_prefix="svdq"):
    rank: Optional[int] = dims(None)
    energy_threshold: float = unit(0.95, lo_open=True)
    bit_schedule: tuple[int, ...] = setting((8, 4, 2, 1, 1, 0, 0, 0), 0, 8)
    group_size: int = groups(32)

    @classmethod
    def check_relations(cls, get):
        s = get("bit_schedule")
        if list(s) != sorted(s, reverse=True) or s[0] == 0:
            raise QuantizerConfigError("svdq_bit_schedule", s,
                                       "a non-empty, non-increasing sequence of ints in 0..8 starting above 0")


class KittyOptions(MethodOptions, method="kitty", flat_prefix="kitty"):
    ORDER = (("hi_bit", ">=", "lo_bit"),)
    hi_fraction: float = unit(0.25)
    hi_bit: int = bitwidth(4)
    lo_bit: int = bitwidth(2)
    group_size: int = groups(32)


class AdaKVOptions(MethodOptions, method="adakv", flat_prefix="adakv"):
    ORDER = (("mid_bit", ">", "lo_bit"), ("mid_bit", "<", "hi_bit"), ("target_avg_bits", ">=", "lo_bit"),
             ("target_avg_bits", "<=", "hi_bit"))
    target_avg_bits: float = nonneg(2.5)
    lo_bit: int = bitwidth(2, hi=6)  # lo_bit < mid_bit < hi_bit
    mid_bit: int = bitwidth(3, lo=2, hi=7)
    hi_bit: int = bitwidth(4, lo=3)
    group_size: int = groups(32, lo=2, hi=256)
    update_interval: int = tokens(1)
    importance: str = one_of("norm_variance", "attention", "norm")
    obs_window: int = tokens(32)


class XQuantOptions(MethodOptions, method="xquant", flat_prefix="xquant"):
    group_size: int = layers(2, bound="layers")
    base_bits: int = one_of(2, 3, 4, 8)  # the codes are KIVI's
    residual_bits: int = setting(4, choices=(2, 3, 4, 8))
    group_quant_size: int = groups(32)
    max_ctx: int = tokens(8192)


class KVQuantOptions(MethodOptions, method="kvquant", flat_prefix="kvquant"):
    ORDER = (("n_sink", "<=", "group_size"),)
    bits: int = bitwidth(3)
    outlier_fraction: float = unit(0.01, hi=0.5, hi_open=True)
    group_size: int = groups(32, lo=2)
    lloyd_iters: int = setting(8, 1, 100)
    refit_interval: int = tokens(0, lo=0)
    n_sink: int = tokens(1, lo=0, hi=MAX_GROUP)  # at most group_size

    @classmethod
    def check_relations(cls, get):
        if get("group_size") % 2:
            raise QuantizerConfigError("kvquant_group_size", get("group_size"), "an even int >= 2")
        super().check_relations(get)


class PaluOptions(MethodOptions, method="palu", flat_prefix="palu"):
    ORDER = (("lo_bit", "<=", "hi_bit"),)
    rank: Optional[int] = dims(None)
    energy_threshold: float = unit(0.9, lo_open=True)
    n_head_groups: int = layers(4)
    hi_bit: int = bitwidth(4)
    lo_bit: int = bitwidth(2)
    hi_fraction: float = unit(0.25)
    group_size: int = groups(32)
    quantize_values: bool = True


class CacheGenOptions(MethodOptions, method="cachegen", flat_prefix="cachegen"):
    bits: int = bitwidth(4)
    group_size: int = groups(32, lo=2)
    use_delta: bool = True
    per_channel: bool = True
    layer_groups: int = layers(3, bound="layers")


class MiniCacheOptions(MethodOptions, method="minicache", flat_prefix="minicache"):
    start_frac: float = unit(0.5)
    group_size: int = setting(2, 2, 2, words="2 (pairs of adjacent layers)")
    retention_threshold: float = setting(0.9, -1.0, 1.0, words="a cosine in [-1, 1]")
    slerp_t: float = unit(0.5)
    max_ctx: int = tokens(8192)


class GEAROptions(MethodOptions, method="gear", flat_prefix="gear"):
    ORDER = (("rank", "<=", "group_size"),)
    bits: int = bitwidth(2)
    rank: Optional[int] = dims(None, hi=MAX_GROUP)  # at most group_size
    energy_threshold: float = unit(0.9, lo_open=True)
    sparse_fraction: float = unit(0.01, hi=0.5, hi_open=True)
    group_size: int = groups(32, lo=2)
    quantize_values: bool = True


class ZipCacheOptions(MethodOptions, method="zipcache", flat_prefix="zipcache"):
    ORDER = (("hi_bits", ">=", "lo_bits"),)
    hi_bits: int = bitwidth(4)
    lo_bits: int = bitwidth(2)
    hi_fraction: float = unit(0.2)
    group_size: int = groups(32)
    quantize_values: bool = True


class SpectralOptions(MethodOptions, method="spectral", flat_prefix="spectral"):
    key_d_eff: int = dims(4)
    val_d_eff: int = dims(50)
    apply_qjl: bool = True
    model_name: str = 'model'


class TurboQuantRVQOptions(MethodOptions, method="turboquant_rvq", flat_prefix=""):
    key_sub_dim: int = dims(4, bound="head_dim")
    value_sub_dim: int = dims(8, bound="head_dim")
    key_codebook_bits: int = bitwidth(12, hi=16)
    value_codebook_bits: int = bitwidth(8, hi=16)
    residual_length: int = tokens(128)


class KIVISinkOptions(MethodOptions, method="kivi_sink", flat_prefix="kivi"):
    group_size: int = groups(32)
    n_sink_tokens: int = tokens(5, lo=0, alias="n_sink_tokens")


class VecInferOptions(MethodOptions, method="vecinfer", flat_prefix=""):
    smooth_factors: Any = None
    key_codebook: Any = None
    value_codebook: Any = None
    use_metal_kernels: Optional[bool] = None
    fused_sdpa: Optional[bool] = False
    fused_sdpa_max_ctx: Optional[int] = tokens(None)
    fused_sdpa_memory_bound: bool = False


class WaterfillOptions(MethodOptions, method="waterfill", flat_prefix=""):
    """Options of ``waterfill`` (its widths are ``bit_width_inlier``, its calibration length
    ``n_calib_tokens``: flat fields every method reads)."""

    residual_length: int = tokens(128)


ALL_OPTIONS: tuple[type, ...] = (
    SnapKVOptions, StreamingLLMOptions, H2OOptions, TOVAOptions, PyramidKVOptions, SqueezeOptions, ChunkKVOptions,
    CaMOptions, XKVOptions, NSNQuantOptions, KNormOptions, SKVQOptions, QFiltersOptions, KeyformerOptions,
    MorphKVOptions, KVzipOptions, KVTCOptions, CurDKVOptions, NestedKVOptions, AMCOptions, A2ATSOptions,
    AnchorKVOptions, RocketKVOptions, AgeTieredOptions, KIVIOptions, SVDqOptions, KittyOptions, AdaKVOptions,
    XQuantOptions, KVQuantOptions, PaluOptions, CacheGenOptions, MiniCacheOptions, GEAROptions, ZipCacheOptions,
    SpectralOptions, TurboQuantRVQOptions, KIVISinkOptions, VecInferOptions, WaterfillOptions)
__all__ += [c.__name__ for c in ALL_OPTIONS]
OPTIONS_BY_METHOD: dict[str, type] = {o.METHOD: o for o in ALL_OPTIONS}

#: flat field -> options classes that set it (kivi_group_size: KIVI and KIVI-sink)
FLAT_FIELD_OPTIONS: dict[str, list[type]] = {f: [c for c in ALL_OPTIONS if f in c.FIELDS.values()]
                                             for o in ALL_OPTIONS for f in o.FIELDS.values()}

#: Config fields the builder applies to every method (a wrapper, hooks), whatever the method.
COMMON_FIELDS: tuple[str, ...] = ("sliding_window", "store", "observers")

_EVICTION_SHARED = ("dtype",)  # eviction rows are stored at 16 bits unless ``dtype`` overrides
_RVQ_CODEBOOKS = ("key_sub_dim", "value_sub_dim", "key_codebook_bits", "value_codebook_bits")
_TURBOQUANT = ("head_dim", "bit_width_inlier", "bit_width_outlier", "n_outlier_channels", "n_calib_tokens", "seed",
               "dtype", "capacity")

#: Per method, the flat fields outside its options that its cache reads (``tests/test_config.py`` checks
#: this both ways; the spec's ``enable_*`` flags are read by none).
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
    """Every setting name ``method`` accepts (option names, flat aliases, shared and common fields) -> the
    flat field it sets (option-only: its own name); a shared field wins a name (snapkv's ``dtype``)."""
    o = OPTIONS_BY_METHOD.get(method)
    own = {**o.FIELDS, **{n: n for n in o.OPTION_ONLY}, **{f: f for f in o.FIELDS.values()}} if o else {}
    return {**own, **{f: f for f in SHARED_FIELDS.get(method, ()) + COMMON_FIELDS}}
