"""``KVCacheConfig``: the one configuration object every cache is built from.

Fields, types and defaults follow the API reference exactly (a test checks them against the spec's
signature). Per-method parameters are best given as an options dataclass (``options=SnapKVOptions(...)``),
whose values populate the flat fields; setting a flat per-method field directly still works but emits a
``DeprecationWarning`` naming its options replacement. Every value is validated here, and a bad one
raises ``QuantizerConfigError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import threading
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args

from .artifacts import ArtifactStore
from .base import METHOD_NAMES
from .errors import QuantizerConfigError
from .options import FLAT_FIELD_OPTIONS, OPTIONS_BY_METHOD, MethodOptions

MethodName = Literal[
    "turboquant_prod", "turboquant_mse", "turboquant_rvq", "polar", "qjl", "vecinfer", "spectral",
    "kivi", "kivi_sink", "svdq", "kitty", "adakv", "xquant", "kvquant", "palu", "cachegen",
    "minicache", "gear", "zipcache", "snapkv", "streaming_llm", "h2o", "tova", "pyramidkv",
    "squeeze", "chunkkv", "cam", "xkv", "nsnquant", "knorm", "skvq", "qfilters", "keyformer",
    "morphkv", "kvzip", "kvtc", "curdkv", "nestedkv", "amc", "a2ats", "anchorkv", "rocketkv",
    "age_tiered",
    "waterfill",  # the library's own 4-bit-class method (not in the reference spec's list)
]
assert get_args(MethodName) == METHOD_NAMES

# String-valued fields and the values they accept.
_CHOICES = {
    "snap_dtype": ("auto", "float16", "bfloat16", "float32"),
    "snap_backend": ("auto", "mlx", "metal", "reference"),
    "tova_backend": ("auto", "mlx", "metal", "reference"),
    "pyramid_backend": ("reference", "mlx", "auto"),
    "chunkkv_score": ("attn_mass", "key_norm"),
    "cam_merge": ("sim_weighted", "mean", "drop"),
    "knorm_keep": ("low", "high"),
    "adakv_importance": ("norm_variance", "attention", "norm"),
    "kvzip_probe": ("context", "repeat"),
    "qfilters_on_low_retention": ("warn", "raise", "ignore"),
}

# Per thread: a server builds per-layer configs (``replace``) on several request threads at once, and a
# process-wide flag saved/restored by interleaved threads could be left on for good.
_quiet = threading.local()


@contextlib.contextmanager
def _quiet_flat_fields():
    old = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = old


@dataclass
class KVCacheConfig:
    """Configuration for a KV cache. See the API reference for every field's meaning."""

    method: MethodName = 'turboquant_rvq'
    head_dim: int = 128
    bit_width_inlier: Union[int, list] = 2
    bit_width_outlier: Optional[int] = None
    jl_dim: Optional[int] = None
    n_outlier_channels: Optional[int] = None
    n_calib_tokens: Optional[int] = None
    enable_vectorized_attend: bool = True
    enable_outlier_two_stream: bool = False
    enable_fused_query_dot: bool = False
    seed: int = 42
    dtype: Any = None
    capacity: Optional[int] = None
    sliding_window: Optional[int] = None
    store: Optional[ArtifactStore] = None
    observers: list = field(default_factory=list)
    options: Optional[object] = None
    key_sub_dim: int = 4
    value_sub_dim: int = 8
    key_codebook_bits: int = 12
    value_codebook_bits: int = 8
    residual_length: int = 128
    kivi_group_size: int = 32
    svdq_rank: Optional[int] = None
    svdq_energy_threshold: float = 0.95
    svdq_bit_schedule: tuple[int, ...] = (8, 4, 2, 1, 1, 0, 0, 0)
    svdq_group_size: int = 32
    kitty_hi_fraction: float = 0.25
    kitty_hi_bit: int = 4
    kitty_lo_bit: int = 2
    kitty_group_size: int = 32
    adakv_target_avg_bits: float = 2.5
    adakv_lo_bit: int = 2
    adakv_mid_bit: int = 3
    adakv_hi_bit: int = 4
    adakv_group_size: int = 32
    adakv_update_interval: int = 1
    adakv_importance: str = 'norm_variance'
    adakv_obs_window: int = 32
    xquant_group_size: int = 2
    xquant_base_bits: int = 2
    xquant_residual_bits: int = 4
    xquant_group_quant_size: int = 32
    xquant_max_ctx: int = 8192
    kvquant_bits: int = 3
    kvquant_outlier_fraction: float = 0.01
    kvquant_group_size: int = 32
    kvquant_lloyd_iters: int = 8
    kvquant_refit_interval: int = 0
    kvquant_n_sink: int = 1
    palu_rank: Optional[int] = None
    palu_energy_threshold: float = 0.9
    palu_n_head_groups: int = 4
    palu_hi_bit: int = 4
    palu_lo_bit: int = 2
    palu_hi_fraction: float = 0.25
    palu_group_size: int = 32
    palu_quantize_values: bool = True
    cachegen_bits: int = 4
    cachegen_group_size: int = 32
    cachegen_use_delta: bool = True
    cachegen_per_channel: bool = True
    cachegen_layer_groups: int = 3
    cachegen_resolved_bits: Optional[int] = None
    minicache_start_frac: float = 0.5
    minicache_group_size: int = 2
    minicache_retention_threshold: float = 0.9
    minicache_slerp_t: float = 0.5
    minicache_max_ctx: int = 8192
    gear_bits: int = 2
    gear_rank: Optional[int] = None
    gear_energy_threshold: float = 0.9
    gear_sparse_fraction: float = 0.01
    gear_group_size: int = 32
    gear_quantize_values: bool = True
    zipcache_hi_bits: int = 4
    zipcache_lo_bits: int = 2
    zipcache_hi_fraction: float = 0.2
    zipcache_group_size: int = 32
    zipcache_quantize_values: bool = True
    snap_dtype: str = 'auto'
    snap_batched_scoring: bool = True
    snap_backend: str = 'auto'
    snap_budget: int = 512
    snap_obs_window: int = 32
    snap_n_sink: int = 4
    stream_n_sink: int = 4
    stream_window_size: int = 512
    h2o_budget: int = 512
    h2o_n_sink: int = 4
    h2o_rope_base: float = 10000.0
    h2o_grace: int = 16
    h2o_decay: float = 0.98
    tova_budget: int = 512
    tova_n_sink: int = 4
    tova_backend: str = 'auto'
    pyramid_budget: int = 512
    pyramid_backend: str = 'reference'
    pyramid_n_sink: int = 4
    pyramid_beta: float = 2.0
    pyramid_resolved_budget: Optional[int] = None
    squeeze_budget: int = 512
    squeeze_n_sink: int = 4
    squeeze_strength: float = 1.0
    squeeze_resolved_budget: Optional[int] = None
    chunkkv_budget: int = 512
    chunkkv_chunk_size: int = 8
    chunkkv_n_sink: int = 4
    chunkkv_score: str = 'attn_mass'
    chunkkv_reuse_layers: int = 1
    cam_budget: int = 512
    cam_n_sink: int = 4
    cam_merge: str = 'sim_weighted'
    cam_merge_keys: bool = False
    cam_merge_gate: bool = True
    xkv_group_size: int = 2
    xkv_rank: Optional[int] = None
    xkv_energy_threshold: float = 0.95
    xkv_latent_bits: int = 4
    xkv_group_quant_size: int = 32
    xkv_max_ctx: int = 8192
    nsn_bits: int = 2
    nsn_residual_length: int = 64
    nsn_codebook_size: int = 256
    nsn_subvector_dim: int = 8
    nsn_seed: int = 1234
    nsn_max_ctx: int = 8192
    knorm_budget: int = 512
    knorm_n_sink: int = 4
    knorm_recent: int = 0
    knorm_keep: str = 'low'
    skvq_bits_key: int = 2
    skvq_bits_value: int = 2
    skvq_group_size: int = 32
    skvq_window: int = 128
    skvq_n_sink: int = 5
    skvq_reorder: bool = True
    skvq_clip_search: bool = True
    skvq_clip_alpha: float = 1.0
    skvq_max_ctx: Optional[int] = None
    qfilters_budget: int = 512
    qfilters_n_sink: int = 4
    qfilters_recent: int = 0
    qfilters_calib_tokens: int = 128
    qfilters_sign: int = 1
    qfilters_min_retention: Optional[float] = 0.9
    qfilters_on_low_retention: Literal['warn', 'raise', 'ignore'] = 'warn'
    keyformer_budget: int = 512
    keyformer_n_sink: int = 4
    keyformer_recent: int = 0
    keyformer_tau: Optional[float] = None
    keyformer_tau_init: float = 1.0
    keyformer_tau_end: float = 1.0
    keyformer_anneal_steps: int = 0
    keyformer_rope_base: float = 10000.0
    keyformer_seed: int = 0
    morphkv_budget: int = 512
    morphkv_n_sink: int = 4
    morphkv_window: int = 8
    kvzip_budget: int = 512
    kvzip_n_sink: int = 4
    kvzip_probe: str = 'context'
    kvtc_bit_budget: int = 512
    kvtc_bit_choices: tuple = (0, 1, 2, 3, 4, 6, 8)
    kvtc_beta: float = 3.5
    curdkv_budget: int = 512
    curdkv_n_sink: int = 4
    curdkv_rank_cap: int = 16
    curdkv_rope_base: float = 10000.0
    nestedkv_budget: int = 512
    nestedkv_n_sink: int = 4
    nestedkv_window: int = 64
    nestedkv_beta: float = 3.0
    nestedkv_tau: float = 0.6
    nestedkv_kappa: float = 10.0
    nestedkv_safeguard_alpha: float = 0.2
    amc_k_high: float = 0.2
    amc_k_mid: float = 0.3
    amc_use_query_saliency: bool = False
    amc_query_alpha: float = 0.5
    amc_adaptive_thresholds: bool = False
    amc_threshold_window: int = 64
    amc_gamma: float = 0.1
    amc_calib_variance: Optional[float] = None
    amc_group_size: int = 32
    a2ats_codebook_bits: int = 8
    a2ats_sub_dim: int = 8
    a2ats_window: int = 128
    a2ats_b: int = 2048
    a2ats_use_query_aware: bool = True
    a2ats_beta: float = 0.5
    a2ats_retrieval_fraction: float = 0.2
    a2ats_rope_base: float = 10000.0
    a2ats_rope_scaling: Any = None
    a2ats_query_h: Any = None
    a2ats_codebook: Any = None
    anchorkv_theta: float = 0.05
    anchorkv_window: int = 32
    anchorkv_rho: float = 0.7
    anchorkv_anchor_frac: float = 0.0078125
    anchorkv_residual_bits: int = 2
    anchorkv_seed: int = 42
    rocketkv_compression_ratio: float = 8.0
    rocketkv_page_size: Optional[int] = None
    rocketkv_head_topk1: Optional[int] = None
    rocketkv_obs_window: int = 32
    rocketkv_n_sink: int = 4
    age_recent_boundary: int = 128
    age_mid_boundary: int = 1024
    age_bits_recent: int = 8
    age_bits_mid: int = 4
    age_bits_old: int = 2
    age_group_size: int = 32
    n_sink_tokens: int = 5
    smooth_factors: Any = None
    key_codebook: Any = None
    value_codebook: Any = None
    spectral_key_d_eff: int = 4
    spectral_val_d_eff: int = 50
    spectral_apply_qjl: bool = True
    spectral_model_name: str = 'model'
    use_metal_kernels: Optional[bool] = None
    fused_sdpa: Optional[bool] = False
    fused_sdpa_max_ctx: Optional[int] = None
    fused_sdpa_memory_bound: bool = False

    def __post_init__(self):
        defaults = _DEFAULTS
        if self.options is not None:
            self._apply_options(defaults)
        elif not getattr(_quiet, "on", False):
            for name, classes in FLAT_FIELD_OPTIONS.items():
                if _differs(getattr(self, name), defaults[name]):
                    cls = next((c for c in classes if c.METHOD == self.method), classes[0])
                    opt = next(o for o, f in cls.FIELDS.items() if f == name)
                    warnings.warn(
                        f"KVCacheConfig.{name} is deprecated as a flat field; pass "
                        f"options={cls.__name__}({opt}=...) instead",
                        DeprecationWarning,
                        stacklevel=3,
                    )
        validate_config(self)
        cls = OPTIONS_BY_METHOD.get(self.method)
        if self.options is None and cls is not None:  # the options object is what a cache reads
            self.options = cls(**{opt: getattr(self, flat) for opt, flat in cls.FIELDS.items()})

    def _apply_options(self, defaults):
        opts = self.options
        if not isinstance(opts, MethodOptions):
            raise QuantizerConfigError(
                "options", opts, "an options dataclass from veloxquant_mlx.cache.options or None"
            )
        expected = OPTIONS_BY_METHOD.get(self.method)
        if type(opts) is not expected:
            allowed = expected.__name__ if expected else "None (this method has no options)"
            raise QuantizerConfigError("options", type(opts).__name__, f"{allowed} for method={self.method!r}")
        for flat, value in opts.flat_items():
            current = getattr(self, flat)
            if _differs(current, defaults[flat]) and _differs(current, value):
                raise QuantizerConfigError(
                    flat, current, f"not to be set both directly and through options (options give {value!r})"
                )
            setattr(self, flat, value)

    def option(self, name: str, default=None):
        """An option-only setting (``OPTION_ONLY`` of the options class, e.g. ``decode_evict``): its value in
        ``options``, or ``default`` when there are no options or they lack ``name``."""
        return getattr(self.options, name, default) if self.options is not None else default

    def replace(self, **changes) -> "KVCacheConfig":
        """A copy with ``changes`` applied (used for per-layer configs; emits no deprecation warnings)."""
        if changes.get("method", self.method) != self.method and "options" not in changes:
            changes["options"] = None  # rebuilt for the new method from the flat fields
        opts = changes.get("options", self.options)
        if opts is not None:  # a changed flat alias changes the options too
            own = {o: changes[f] for o, f in type(opts).FIELDS.items() if f in changes}
            if own:
                changes["options"] = dataclasses.replace(opts, **own)
        with _quiet_flat_fields():
            return dataclasses.replace(self, **changes)


_DEFAULTS = {
    f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    for f in dataclasses.fields(KVCacheConfig)
}


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # arrays and other objects without a plain truth value
        return a is not b


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise QuantizerConfigError(name, value, allowed)


#: Upper bounds of integer fields, by what they count. Large enough for any model this library runs
#: (a million-token context, 4096-wide heads, 1024 layers), small enough that an absurd value fails here
#: instead of in an allocation, a shape or a 32-bit index deep inside a cache.
MAX_TOKENS = 1 << 20  # budgets, windows, sinks, residuals, calibration lengths, context caps
MAX_DIM = 4096  # channel counts: head dims, ranks, sub-vector and sketch widths
MAX_GROUP = 1024  # quantization groups (channels or tokens per scale)
MAX_LAYERS = 1024  # layer groups and layer counts
MAX_SEED = 2**31 - 1
MAX_ITERS = 10_000

_DIM_FIELDS = ("head_dim", "jl_dim", "n_outlier_channels", "key_sub_dim", "value_sub_dim", "nsn_subvector_dim",
               "a2ats_sub_dim", "spectral_key_d_eff", "spectral_val_d_eff", "svdq_rank", "palu_rank", "gear_rank",
               "xkv_rank", "curdkv_rank_cap")
_LAYER_FIELDS = ("xquant_group_size", "xkv_group_size", "minicache_group_size", "cachegen_layer_groups",
                 "chunkkv_reuse_layers", "palu_n_head_groups")


def _int_range(name: str) -> tuple[int, int]:
    """Allowed inclusive range of an int field, from what it counts."""
    if name == "seed" or name.endswith("_seed"):
        return (0, MAX_SEED)
    if name.endswith("_sign"):
        return (-1, 1)
    if "codebook_bits" in name:
        return (1, 16)
    if name == "bit_width_outlier":
        return (1, 8)
    if name.endswith(("_bits", "_bit")) or "_bits_" in name:
        return (1, 8)
    if name == "nsn_codebook_size":
        return (2, 1 << 16)
    if name in _DIM_FIELDS:
        return (0 if name == "n_outlier_channels" else 1, MAX_DIM)
    if name in _LAYER_FIELDS:
        return (1, MAX_LAYERS)
    if name.endswith("_group_size") or name.endswith("group_quant_size"):
        return (1, MAX_GROUP)
    if name.endswith(("_iters",)):
        return (1, MAX_ITERS)
    if name.endswith(("_n_sink", "_recent", "n_sink_tokens", "anneal_steps", "refit_interval")):
        return (0, MAX_TOKENS)
    return (1, MAX_TOKENS)  # token counts: budgets, windows, residuals, calibration, caps, intervals


_UNIT_FLOATS = ("fraction", "_frac", "threshold", "retention", "slerp_t", "_rho", "_beta")
_UNBOUNDED_BETAS = ("pyramid_beta", "kvtc_beta", "nestedkv_beta", "a2ats_beta")
_NONNEG_FLOATS = ("_k_high", "_k_mid", "_theta", "_tau", "_kappa", "_gamma", "_strength", "_beta", "_alpha")
MAX_FLOAT = 1e6  # rope bases, temperatures, strengths: far above any real value, below float16's overflow


def _float_rule(name: str) -> tuple[float, float, bool, str]:
    """``(lo, hi, lo_open, allowed)`` of a float field."""
    if name == "minicache_retention_threshold":  # a cosine similarity
        return (-1.0, 1.0, False, "a cosine in [-1, 1]")
    if any(s in name for s in _UNIT_FLOATS) and name not in _UNBOUNDED_BETAS:
        return (0.0, 1.0, False, "a number in [0, 1]")
    if name.endswith("_decay"):
        return (0.0, 1.0, True, "a number in (0, 1]")
    if name.endswith("rope_base"):
        return (1.0, 1e9, True, "a number > 1 and <= 1e9")
    if name.endswith("compression_ratio"):
        return (1.0, 1e4, True, "a number > 1 and <= 10000")
    if name.endswith(_NONNEG_FLOATS) or "tau_" in name or "query_alpha" in name or name == "adakv_target_avg_bits":
        return (0.0, MAX_FLOAT, False, f"a number in [0, {MAX_FLOAT:g}]")
    return (-MAX_FLOAT, MAX_FLOAT, False, "a finite number")


#: The dtypes a cache may store or compute in.
DTYPE_NAMES = ("float16", "bfloat16", "float32")


def allowed_values(name: str) -> str:
    """What field ``name`` accepts, in the words a ``QuantizerConfigError`` uses."""
    t = _FIELD_TYPES[name]
    none = " or None" if t.startswith("Optional") else ""
    if name in _CHOICES:
        return f"one of {', '.join(map(repr, _CHOICES[name]))}{none}"
    if name == "dtype":
        return f"None or mx.{', mx.'.join(DTYPE_NAMES)}"
    if name == "bit_width_inlier":
        return "an int in 1..8 or a non-empty list of ints in 1..8 (one per layer)"
    if "bool" in t:
        return "True or False" + none
    if "tuple" in t:
        return "a non-empty tuple of ints in 0..16"
    if "float" in t:
        return _float_rule(name)[3] + none
    if "int" in t:
        lo, hi = _int_range(name)
        return f"an int in {lo}..{hi}" + none
    return "any value"


def _check_dtype(v) -> None:
    if v is None:
        return
    import mlx.core as mx

    ok = any(v == getattr(mx, n) for n in DTYPE_NAMES) if isinstance(v, mx.Dtype) else False
    _check(ok, "dtype", v, allowed_values("dtype"))


# Checked before the loop, or objects (arrays, stores, codebooks) the methods check when they use them.
_UNCHECKED = frozenset(("method", "bit_width_inlier", "options", "store", "dtype", "smooth_factors", "key_codebook",
                        "value_codebook", "a2ats_rope_scaling", "a2ats_query_h", "a2ats_codebook"))


def validate_config(cfg: KVCacheConfig) -> None:
    """Raise ``QuantizerConfigError`` for the first invalid field of ``cfg``."""
    _check(cfg.method in METHOD_NAMES, "method", cfg.method, f"one of {', '.join(METHOD_NAMES)}")
    bw = cfg.bit_width_inlier
    if isinstance(bw, (list, tuple)):
        _check(0 < len(bw) <= MAX_LAYERS and all(_is_int(b) and 1 <= b <= 8 for b in bw), "bit_width_inlier", bw,
               allowed_values("bit_width_inlier"))
    else:
        _check(_is_int(bw) and 1 <= bw <= 8, "bit_width_inlier", bw, allowed_values("bit_width_inlier"))
    _check_dtype(cfg.dtype)
    for name, value in _DEFAULTS.items():
        if name in _UNCHECKED:
            continue
        v = getattr(cfg, name)
        if name == "observers":
            _check(isinstance(v, list), name, v, "a list of QuantizationObserver")
            continue
        if v is None and _FIELD_TYPES[name].startswith("Optional"):
            continue
        if name in _CHOICES:
            _check(v in _CHOICES[name], name, v, allowed_values(name))
            continue
        t = _FIELD_TYPES[name]
        if "bool" in t:
            _check(isinstance(v, bool), name, v, allowed_values(name))
        elif "tuple" in t:
            _check(isinstance(v, (tuple, list)) and 0 < len(v) <= 64 and all(_is_int(b) and 0 <= b <= 16 for b in v),
                   name, v, allowed_values(name))
        elif "float" in t:
            lo, hi, lo_open, _ = _float_rule(name)
            _check(_is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi, name, v, allowed_values(name))
        elif "int" in t:
            lo, hi = _int_range(name)
            _check(_is_int(v) and lo <= v <= hi, name, v, allowed_values(name))
    if cfg.n_outlier_channels is not None:
        _check(0 <= cfg.n_outlier_channels < cfg.head_dim, "n_outlier_channels", cfg.n_outlier_channels,
               f"an int in [0, head_dim={cfg.head_dim})")
    _check(cfg.store is None or isinstance(cfg.store, ArtifactStore), "store", cfg.store, "an ArtifactStore or None")
    if cfg.amc_k_high + cfg.amc_k_mid > 1.0:
        raise QuantizerConfigError("amc_k_mid", cfg.amc_k_mid, f"amc_k_high + amc_k_mid <= 1 (amc_k_high={cfg.amc_k_high})")
    if cfg.age_mid_boundary < cfg.age_recent_boundary:
        raise QuantizerConfigError("age_mid_boundary", cfg.age_mid_boundary,
                                   f"an int >= age_recent_boundary={cfg.age_recent_boundary}")


#: Fields whose value counts channels of one head or layers of the model: ``validate_for_model`` checks
#: them against the model that ``KVCacheBuilder.for_model`` builds for.
_HEAD_DIM_BOUND = ("key_sub_dim", "value_sub_dim", "nsn_subvector_dim", "a2ats_sub_dim")
_LAYER_BOUND = ("xquant_group_size", "xkv_group_size", "minicache_group_size", "cachegen_layer_groups",
                "chunkkv_reuse_layers")


def validate_for_model(cfg: KVCacheConfig, head_dim: int, n_layers: int) -> None:
    """Raise ``QuantizerConfigError`` for a field that cannot fit this model: a sub-vector width over the
    head dim, or a layer group set over the count of compressed layers (the defaults are left alone: the
    methods shorten their last group, so a default of 3 on a 2-layer model means "all of them")."""
    for name in _HEAD_DIM_BOUND:
        v = getattr(cfg, name)
        if v is not None and v > head_dim:
            raise QuantizerConfigError(name, v, f"an int in 1..{head_dim} (the model's head_dim)")
    for name in _LAYER_BOUND:
        v = getattr(cfg, name)
        if v > n_layers and v != _DEFAULTS[name]:
            raise QuantizerConfigError(name, v, f"an int in 1..{n_layers} (the model's layer count)")


_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(KVCacheConfig)}
