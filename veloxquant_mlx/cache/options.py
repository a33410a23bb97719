"""Per-method options: one small dataclass per method that has parameters.

Pass one as ``KVCacheConfig(method=..., options=SnapKVOptions(budget=256))``. Each field maps to a flat
``KVCacheConfig`` field (``FIELDS`` gives the mapping); the config copies the values across when it is
built, so caches read one place. Defaults equal the flat fields' defaults.

Option-only fields (``OPTION_ONLY``; e.g. the eviction methods' ``decode_evict``) have no flat field, so
that ``KVCacheConfig`` keeps exactly the spec's signature: a cache reads them with
``config.option(name)``, they are validated when the options object is built (:data:`OPTION_CHECKS`),
and ``--set NAME=VALUE`` reaches them under their own name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Optional

from .errors import QuantizerConfigError


def _optional_bool(field: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise QuantizerConfigError(field, value, "None (the method's default), True or False")


#: Option-only field -> (validator(field, value), allowed values in words for ``veloxquant methods``).
OPTION_CHECKS: dict[str, tuple] = {
    "decode_evict": (_optional_bool, "None (the method's default), True or False"),
}

# the option-only fields of every eviction method: whether its budget also holds while decoding
_EVICTION_ONLY: tuple[str, ...] = ("decode_evict",)


class MethodOptions:
    """Base of every options dataclass: ``METHOD`` names the method, ``FIELDS`` maps option -> flat field,
    ``OPTION_ONLY`` lists the options that have no flat field (read with ``KVCacheConfig.option``)."""

    METHOD: ClassVar[str] = ""
    FIELDS: ClassVar[dict[str, str]] = {}
    OPTION_ONLY: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for name in self.OPTION_ONLY:
            OPTION_CHECKS[name][0](name, getattr(self, name))

    def flat_items(self):
        """(flat field name, value) pairs this options object sets (option-only fields excluded)."""
        return [(self.FIELDS[f.name], getattr(self, f.name)) for f in fields(self) if f.name not in self.OPTION_ONLY]


@dataclass
class SnapKVOptions(MethodOptions):
    """Options of ``snapkv``."""

    METHOD: ClassVar[str] = "snapkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"dtype": "snap_dtype", "batched_scoring": "snap_batched_scoring", "backend": "snap_backend", "budget": "snap_budget", "obs_window": "snap_obs_window", "n_sink": "snap_n_sink"}

    dtype: str = 'auto'
    batched_scoring: bool = True
    backend: str = 'auto'
    budget: int = 512
    obs_window: int = 32
    n_sink: int = 4
    decode_evict: Optional[bool] = None


@dataclass
class StreamingLLMOptions(MethodOptions):
    """Options of ``streaming_llm``."""

    METHOD: ClassVar[str] = "streaming_llm"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"n_sink": "stream_n_sink", "window_size": "stream_window_size"}

    n_sink: int = 4
    window_size: int = 512
    decode_evict: Optional[bool] = None


@dataclass
class H2OOptions(MethodOptions):
    """Options of ``h2o``."""

    METHOD: ClassVar[str] = "h2o"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "h2o_budget", "n_sink": "h2o_n_sink", "rope_base": "h2o_rope_base", "grace": "h2o_grace", "decay": "h2o_decay"}

    budget: int = 512
    n_sink: int = 4
    rope_base: float = 10000.0
    grace: int = 16
    decay: float = 0.98
    decode_evict: Optional[bool] = None


@dataclass
class TOVAOptions(MethodOptions):
    """Options of ``tova``."""

    METHOD: ClassVar[str] = "tova"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "tova_budget", "n_sink": "tova_n_sink", "backend": "tova_backend"}

    budget: int = 512
    n_sink: int = 4
    backend: str = 'auto'
    decode_evict: Optional[bool] = None


@dataclass
class PyramidKVOptions(MethodOptions):
    """Options of ``pyramidkv``."""

    METHOD: ClassVar[str] = "pyramidkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "pyramid_budget", "backend": "pyramid_backend", "n_sink": "pyramid_n_sink", "beta": "pyramid_beta"}

    budget: int = 512
    backend: str = 'reference'
    n_sink: int = 4
    beta: float = 2.0
    decode_evict: Optional[bool] = None


@dataclass
class SqueezeOptions(MethodOptions):
    """Options of ``squeeze``."""

    METHOD: ClassVar[str] = "squeeze"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "squeeze_budget", "n_sink": "squeeze_n_sink", "strength": "squeeze_strength"}

    budget: int = 512
    n_sink: int = 4
    strength: float = 1.0
    decode_evict: Optional[bool] = None


@dataclass
class ChunkKVOptions(MethodOptions):
    """Options of ``chunkkv``."""

    METHOD: ClassVar[str] = "chunkkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "chunkkv_budget", "chunk_size": "chunkkv_chunk_size", "n_sink": "chunkkv_n_sink", "score": "chunkkv_score", "reuse_layers": "chunkkv_reuse_layers"}

    budget: int = 512
    chunk_size: int = 8
    n_sink: int = 4
    score: str = 'attn_mass'
    reuse_layers: int = 1
    decode_evict: Optional[bool] = None


@dataclass
class CaMOptions(MethodOptions):
    """Options of ``cam``."""

    METHOD: ClassVar[str] = "cam"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "cam_budget", "n_sink": "cam_n_sink", "merge": "cam_merge", "merge_keys": "cam_merge_keys", "merge_gate": "cam_merge_gate"}

    budget: int = 512
    n_sink: int = 4
    merge: str = 'sim_weighted'
    merge_keys: bool = False
    merge_gate: bool = True
    decode_evict: Optional[bool] = None


@dataclass
class XKVOptions(MethodOptions):
    """Options of ``xkv``."""

    METHOD: ClassVar[str] = "xkv"
    FIELDS: ClassVar[dict[str, str]] = {"group_size": "xkv_group_size", "rank": "xkv_rank", "energy_threshold": "xkv_energy_threshold", "latent_bits": "xkv_latent_bits", "group_quant_size": "xkv_group_quant_size", "max_ctx": "xkv_max_ctx"}

    group_size: int = 2
    rank: Optional[int] = None
    energy_threshold: float = 0.95
    latent_bits: int = 4
    group_quant_size: int = 32
    max_ctx: int = 8192


@dataclass
class NSNQuantOptions(MethodOptions):
    """Options of ``nsnquant``."""

    METHOD: ClassVar[str] = "nsnquant"
    FIELDS: ClassVar[dict[str, str]] = {"bits": "nsn_bits", "residual_length": "nsn_residual_length", "codebook_size": "nsn_codebook_size", "subvector_dim": "nsn_subvector_dim", "seed": "nsn_seed", "max_ctx": "nsn_max_ctx"}

    bits: int = 2
    residual_length: int = 64
    codebook_size: int = 256
    subvector_dim: int = 8
    seed: int = 1234
    max_ctx: int = 8192


@dataclass
class KNormOptions(MethodOptions):
    """Options of ``knorm``."""

    METHOD: ClassVar[str] = "knorm"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "knorm_budget", "n_sink": "knorm_n_sink", "recent": "knorm_recent", "keep": "knorm_keep"}

    budget: int = 512
    n_sink: int = 4
    recent: int = 0
    keep: str = 'low'
    decode_evict: Optional[bool] = None


@dataclass
class SKVQOptions(MethodOptions):
    """Options of ``skvq``."""

    METHOD: ClassVar[str] = "skvq"
    FIELDS: ClassVar[dict[str, str]] = {"bits_key": "skvq_bits_key", "bits_value": "skvq_bits_value", "group_size": "skvq_group_size", "window": "skvq_window", "n_sink": "skvq_n_sink", "reorder": "skvq_reorder", "clip_search": "skvq_clip_search", "clip_alpha": "skvq_clip_alpha", "max_ctx": "skvq_max_ctx"}

    bits_key: int = 2
    bits_value: int = 2
    group_size: int = 32
    window: int = 128
    n_sink: int = 5
    reorder: bool = True
    clip_search: bool = True
    clip_alpha: float = 1.0
    max_ctx: Optional[int] = None


@dataclass
class QFiltersOptions(MethodOptions):
    """Options of ``qfilters``."""

    METHOD: ClassVar[str] = "qfilters"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "qfilters_budget", "n_sink": "qfilters_n_sink", "recent": "qfilters_recent", "calib_tokens": "qfilters_calib_tokens", "sign": "qfilters_sign", "min_retention": "qfilters_min_retention", "on_low_retention": "qfilters_on_low_retention"}

    budget: int = 512
    n_sink: int = 4
    recent: int = 0
    calib_tokens: int = 128
    sign: int = 1
    min_retention: Optional[float] = 0.9
    on_low_retention: Literal['warn', 'raise', 'ignore'] = 'warn'
    decode_evict: Optional[bool] = None


@dataclass
class KeyformerOptions(MethodOptions):
    """Options of ``keyformer``."""

    METHOD: ClassVar[str] = "keyformer"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "keyformer_budget", "n_sink": "keyformer_n_sink", "recent": "keyformer_recent", "tau": "keyformer_tau", "tau_init": "keyformer_tau_init", "tau_end": "keyformer_tau_end", "anneal_steps": "keyformer_anneal_steps", "rope_base": "keyformer_rope_base", "seed": "keyformer_seed"}

    budget: int = 512
    n_sink: int = 4
    recent: int = 0
    tau: Optional[float] = None
    tau_init: float = 1.0
    tau_end: float = 1.0
    anneal_steps: int = 0
    rope_base: float = 10000.0
    seed: int = 0
    decode_evict: Optional[bool] = None


@dataclass
class MorphKVOptions(MethodOptions):
    """Options of ``morphkv``."""

    METHOD: ClassVar[str] = "morphkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "morphkv_budget", "n_sink": "morphkv_n_sink", "window": "morphkv_window"}

    budget: int = 512
    n_sink: int = 4
    window: int = 8
    decode_evict: Optional[bool] = None


@dataclass
class KVzipOptions(MethodOptions):
    """Options of ``kvzip``."""

    METHOD: ClassVar[str] = "kvzip"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "kvzip_budget", "n_sink": "kvzip_n_sink", "probe": "kvzip_probe"}

    budget: int = 512
    n_sink: int = 4
    probe: str = 'context'
    decode_evict: Optional[bool] = None


@dataclass
class KVTCOptions(MethodOptions):
    """Options of ``kvtc``."""

    METHOD: ClassVar[str] = "kvtc"
    FIELDS: ClassVar[dict[str, str]] = {"bit_budget": "kvtc_bit_budget", "bit_choices": "kvtc_bit_choices", "beta": "kvtc_beta"}

    bit_budget: int = 512
    bit_choices: tuple = (0, 1, 2, 3, 4, 6, 8)
    beta: float = 3.5


@dataclass
class CurDKVOptions(MethodOptions):
    """Options of ``curdkv``."""

    METHOD: ClassVar[str] = "curdkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "curdkv_budget", "n_sink": "curdkv_n_sink", "rank_cap": "curdkv_rank_cap", "rope_base": "curdkv_rope_base"}

    budget: int = 512
    n_sink: int = 4
    rank_cap: int = 16
    rope_base: float = 10000.0
    decode_evict: Optional[bool] = None


@dataclass
class NestedKVOptions(MethodOptions):
    """Options of ``nestedkv``."""

    METHOD: ClassVar[str] = "nestedkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"budget": "nestedkv_budget", "n_sink": "nestedkv_n_sink", "window": "nestedkv_window", "beta": "nestedkv_beta", "tau": "nestedkv_tau", "kappa": "nestedkv_kappa", "safeguard_alpha": "nestedkv_safeguard_alpha"}

    budget: int = 512
    n_sink: int = 4
    window: int = 64
    beta: float = 3.0
    tau: float = 0.6
    kappa: float = 10.0
    safeguard_alpha: float = 0.2
    decode_evict: Optional[bool] = None


@dataclass
class AMCOptions(MethodOptions):
    """Options of ``amc``."""

    METHOD: ClassVar[str] = "amc"
    FIELDS: ClassVar[dict[str, str]] = {"k_high": "amc_k_high", "k_mid": "amc_k_mid", "use_query_saliency": "amc_use_query_saliency", "query_alpha": "amc_query_alpha", "adaptive_thresholds": "amc_adaptive_thresholds", "threshold_window": "amc_threshold_window", "gamma": "amc_gamma", "calib_variance": "amc_calib_variance", "group_size": "amc_group_size"}

    k_high: float = 0.2
    k_mid: float = 0.3
    use_query_saliency: bool = False
    query_alpha: float = 0.5
    adaptive_thresholds: bool = False
    threshold_window: int = 64
    gamma: float = 0.1
    calib_variance: Optional[float] = None
    group_size: int = 32


@dataclass
class A2ATSOptions(MethodOptions):
    """Options of ``a2ats``."""

    METHOD: ClassVar[str] = "a2ats"
    FIELDS: ClassVar[dict[str, str]] = {"codebook_bits": "a2ats_codebook_bits", "sub_dim": "a2ats_sub_dim", "window": "a2ats_window", "b": "a2ats_b", "use_query_aware": "a2ats_use_query_aware", "beta": "a2ats_beta", "retrieval_fraction": "a2ats_retrieval_fraction", "rope_base": "a2ats_rope_base", "rope_scaling": "a2ats_rope_scaling", "query_h": "a2ats_query_h", "codebook": "a2ats_codebook"}

    codebook_bits: int = 8
    sub_dim: int = 8
    window: int = 128
    b: int = 2048
    use_query_aware: bool = True
    beta: float = 0.5
    retrieval_fraction: float = 0.2
    rope_base: float = 10000.0
    rope_scaling: Any = None
    query_h: Any = None
    codebook: Any = None


@dataclass
class AnchorKVOptions(MethodOptions):
    """Options of ``anchorkv``."""

    METHOD: ClassVar[str] = "anchorkv"
    FIELDS: ClassVar[dict[str, str]] = {"theta": "anchorkv_theta", "window": "anchorkv_window", "rho": "anchorkv_rho", "anchor_frac": "anchorkv_anchor_frac", "residual_bits": "anchorkv_residual_bits", "seed": "anchorkv_seed"}

    theta: float = 0.05
    window: int = 32
    rho: float = 0.7
    anchor_frac: float = 0.0078125
    residual_bits: int = 2
    seed: int = 42


@dataclass
class RocketKVOptions(MethodOptions):
    """Options of ``rocketkv``."""

    METHOD: ClassVar[str] = "rocketkv"
    OPTION_ONLY: ClassVar[tuple[str, ...]] = _EVICTION_ONLY
    FIELDS: ClassVar[dict[str, str]] = {"compression_ratio": "rocketkv_compression_ratio", "page_size": "rocketkv_page_size", "head_topk1": "rocketkv_head_topk1", "obs_window": "rocketkv_obs_window", "n_sink": "rocketkv_n_sink"}

    compression_ratio: float = 8.0
    page_size: Optional[int] = None
    head_topk1: Optional[int] = None
    obs_window: int = 32
    n_sink: int = 4
    decode_evict: Optional[bool] = None


@dataclass
class AgeTieredOptions(MethodOptions):
    """Options of ``age_tiered``."""

    METHOD: ClassVar[str] = "age_tiered"
    FIELDS: ClassVar[dict[str, str]] = {"recent_boundary": "age_recent_boundary", "mid_boundary": "age_mid_boundary", "bits_recent": "age_bits_recent", "bits_mid": "age_bits_mid", "bits_old": "age_bits_old", "group_size": "age_group_size"}

    recent_boundary: int = 128
    mid_boundary: int = 1024
    bits_recent: int = 8
    bits_mid: int = 4
    bits_old: int = 2
    group_size: int = 32


@dataclass
class KIVIOptions(MethodOptions):
    """Options of ``kivi``."""

    METHOD: ClassVar[str] = "kivi"
    FIELDS: ClassVar[dict[str, str]] = {"group_size": "kivi_group_size"}

    group_size: int = 32


@dataclass
class SVDqOptions(MethodOptions):
    """Options of ``svdq``."""

    METHOD: ClassVar[str] = "svdq"
    FIELDS: ClassVar[dict[str, str]] = {"rank": "svdq_rank", "energy_threshold": "svdq_energy_threshold", "bit_schedule": "svdq_bit_schedule", "group_size": "svdq_group_size"}

    rank: Optional[int] = None
    energy_threshold: float = 0.95
    bit_schedule: tuple = (8, 4, 2, 1, 1, 0, 0, 0)
    group_size: int = 32


@dataclass
class KittyOptions(MethodOptions):
    """Options of ``kitty``."""

    METHOD: ClassVar[str] = "kitty"
    FIELDS: ClassVar[dict[str, str]] = {"hi_fraction": "kitty_hi_fraction", "hi_bit": "kitty_hi_bit", "lo_bit": "kitty_lo_bit", "group_size": "kitty_group_size"}

    hi_fraction: float = 0.25
    hi_bit: int = 4
    lo_bit: int = 2
    group_size: int = 32


@dataclass
class AdaKVOptions(MethodOptions):
    """Options of ``adakv``."""

    METHOD: ClassVar[str] = "adakv"
    FIELDS: ClassVar[dict[str, str]] = {"target_avg_bits": "adakv_target_avg_bits", "lo_bit": "adakv_lo_bit", "mid_bit": "adakv_mid_bit", "hi_bit": "adakv_hi_bit", "group_size": "adakv_group_size", "update_interval": "adakv_update_interval", "importance": "adakv_importance", "obs_window": "adakv_obs_window"}

    target_avg_bits: float = 2.5
    lo_bit: int = 2
    mid_bit: int = 3
    hi_bit: int = 4
    group_size: int = 32
    update_interval: int = 1
    importance: str = 'norm_variance'
    obs_window: int = 32


@dataclass
class XQuantOptions(MethodOptions):
    """Options of ``xquant``."""

    METHOD: ClassVar[str] = "xquant"
    FIELDS: ClassVar[dict[str, str]] = {"group_size": "xquant_group_size", "base_bits": "xquant_base_bits", "residual_bits": "xquant_residual_bits", "group_quant_size": "xquant_group_quant_size", "max_ctx": "xquant_max_ctx"}

    group_size: int = 2
    base_bits: int = 2
    residual_bits: int = 4
    group_quant_size: int = 32
    max_ctx: int = 8192


@dataclass
class KVQuantOptions(MethodOptions):
    """Options of ``kvquant``."""

    METHOD: ClassVar[str] = "kvquant"
    FIELDS: ClassVar[dict[str, str]] = {"bits": "kvquant_bits", "outlier_fraction": "kvquant_outlier_fraction", "group_size": "kvquant_group_size", "lloyd_iters": "kvquant_lloyd_iters", "refit_interval": "kvquant_refit_interval", "n_sink": "kvquant_n_sink"}

    bits: int = 3
    outlier_fraction: float = 0.01
    group_size: int = 32
    lloyd_iters: int = 8
    refit_interval: int = 0
    n_sink: int = 1


@dataclass
class PaluOptions(MethodOptions):
    """Options of ``palu``."""

    METHOD: ClassVar[str] = "palu"
    FIELDS: ClassVar[dict[str, str]] = {"rank": "palu_rank", "energy_threshold": "palu_energy_threshold", "n_head_groups": "palu_n_head_groups", "hi_bit": "palu_hi_bit", "lo_bit": "palu_lo_bit", "hi_fraction": "palu_hi_fraction", "group_size": "palu_group_size", "quantize_values": "palu_quantize_values"}

    rank: Optional[int] = None
    energy_threshold: float = 0.9
    n_head_groups: int = 4
    hi_bit: int = 4
    lo_bit: int = 2
    hi_fraction: float = 0.25
    group_size: int = 32
    quantize_values: bool = True


@dataclass
class CacheGenOptions(MethodOptions):
    """Options of ``cachegen``."""

    METHOD: ClassVar[str] = "cachegen"
    FIELDS: ClassVar[dict[str, str]] = {"bits": "cachegen_bits", "group_size": "cachegen_group_size", "use_delta": "cachegen_use_delta", "per_channel": "cachegen_per_channel", "layer_groups": "cachegen_layer_groups"}

    bits: int = 4
    group_size: int = 32
    use_delta: bool = True
    per_channel: bool = True
    layer_groups: int = 3


@dataclass
class MiniCacheOptions(MethodOptions):
    """Options of ``minicache``."""

    METHOD: ClassVar[str] = "minicache"
    FIELDS: ClassVar[dict[str, str]] = {"start_frac": "minicache_start_frac", "group_size": "minicache_group_size", "retention_threshold": "minicache_retention_threshold", "slerp_t": "minicache_slerp_t", "max_ctx": "minicache_max_ctx"}

    start_frac: float = 0.5
    group_size: int = 2
    retention_threshold: float = 0.9
    slerp_t: float = 0.5
    max_ctx: int = 8192


@dataclass
class GEAROptions(MethodOptions):
    """Options of ``gear``."""

    METHOD: ClassVar[str] = "gear"
    FIELDS: ClassVar[dict[str, str]] = {"bits": "gear_bits", "rank": "gear_rank", "energy_threshold": "gear_energy_threshold", "sparse_fraction": "gear_sparse_fraction", "group_size": "gear_group_size", "quantize_values": "gear_quantize_values"}

    bits: int = 2
    rank: Optional[int] = None
    energy_threshold: float = 0.9
    sparse_fraction: float = 0.01
    group_size: int = 32
    quantize_values: bool = True


@dataclass
class ZipCacheOptions(MethodOptions):
    """Options of ``zipcache``."""

    METHOD: ClassVar[str] = "zipcache"
    FIELDS: ClassVar[dict[str, str]] = {"hi_bits": "zipcache_hi_bits", "lo_bits": "zipcache_lo_bits", "hi_fraction": "zipcache_hi_fraction", "group_size": "zipcache_group_size", "quantize_values": "zipcache_quantize_values"}

    hi_bits: int = 4
    lo_bits: int = 2
    hi_fraction: float = 0.2
    group_size: int = 32
    quantize_values: bool = True


@dataclass
class SpectralOptions(MethodOptions):
    """Options of ``spectral``."""

    METHOD: ClassVar[str] = "spectral"
    FIELDS: ClassVar[dict[str, str]] = {"key_d_eff": "spectral_key_d_eff", "val_d_eff": "spectral_val_d_eff", "apply_qjl": "spectral_apply_qjl", "model_name": "spectral_model_name"}

    key_d_eff: int = 4
    val_d_eff: int = 50
    apply_qjl: bool = True
    model_name: str = 'model'


@dataclass
class TurboQuantRVQOptions(MethodOptions):
    """Options of ``turboquant_rvq``."""

    METHOD: ClassVar[str] = "turboquant_rvq"
    FIELDS: ClassVar[dict[str, str]] = {"key_sub_dim": "key_sub_dim", "value_sub_dim": "value_sub_dim", "key_codebook_bits": "key_codebook_bits", "value_codebook_bits": "value_codebook_bits", "residual_length": "residual_length"}

    key_sub_dim: int = 4
    value_sub_dim: int = 8
    key_codebook_bits: int = 12
    value_codebook_bits: int = 8
    residual_length: int = 128


@dataclass
class KIVISinkOptions(MethodOptions):
    """Options of ``kivi_sink``."""

    METHOD: ClassVar[str] = "kivi_sink"
    FIELDS: ClassVar[dict[str, str]] = {"group_size": "kivi_group_size", "n_sink_tokens": "n_sink_tokens"}

    group_size: int = 32
    n_sink_tokens: int = 5


@dataclass
class VecInferOptions(MethodOptions):
    """Options of ``vecinfer``."""

    METHOD: ClassVar[str] = "vecinfer"
    FIELDS: ClassVar[dict[str, str]] = {"smooth_factors": "smooth_factors", "key_codebook": "key_codebook", "value_codebook": "value_codebook", "use_metal_kernels": "use_metal_kernels", "fused_sdpa": "fused_sdpa", "fused_sdpa_max_ctx": "fused_sdpa_max_ctx", "fused_sdpa_memory_bound": "fused_sdpa_memory_bound"}

    smooth_factors: Any = None
    key_codebook: Any = None
    value_codebook: Any = None
    use_metal_kernels: Optional[bool] = None
    fused_sdpa: Optional[bool] = False
    fused_sdpa_max_ctx: Optional[int] = None
    fused_sdpa_memory_bound: bool = False


@dataclass
class WaterfillOptions(MethodOptions):
    """Options of ``waterfill`` (its widths are ``bit_width_inlier``, its calibration length
    ``n_calib_tokens``: flat fields every method reads)."""

    METHOD: ClassVar[str] = "waterfill"
    FIELDS: ClassVar[dict[str, str]] = {"residual_length": "residual_length"}

    residual_length: int = 128


ALL_OPTIONS: tuple[type, ...] = (SnapKVOptions, StreamingLLMOptions, H2OOptions, TOVAOptions, PyramidKVOptions, SqueezeOptions, ChunkKVOptions, CaMOptions, XKVOptions, NSNQuantOptions, KNormOptions, SKVQOptions, QFiltersOptions, KeyformerOptions, MorphKVOptions, KVzipOptions, KVTCOptions, CurDKVOptions, NestedKVOptions, AMCOptions, A2ATSOptions, AnchorKVOptions, RocketKVOptions, AgeTieredOptions, KIVIOptions, SVDqOptions, KittyOptions, AdaKVOptions, XQuantOptions, KVQuantOptions, PaluOptions, CacheGenOptions, MiniCacheOptions, GEAROptions, ZipCacheOptions, SpectralOptions, TurboQuantRVQOptions, KIVISinkOptions, VecInferOptions, WaterfillOptions)
OPTIONS_BY_METHOD: dict[str, type] = {o.METHOD: o for o in ALL_OPTIONS}

# flat field -> options classes that set it (kivi_group_size belongs to KIVI and KIVI-sink)
FLAT_FIELD_OPTIONS: dict[str, list[type]] = {}
for _cls in ALL_OPTIONS:
    for _flat in _cls.FIELDS.values():
        FLAT_FIELD_OPTIONS.setdefault(_flat, []).append(_cls)

# --------------------------------------------------------------------------- which fields a method reads

#: Config fields the builder applies to every method (a wrapper, hooks), whatever the method.
COMMON_FIELDS: tuple[str, ...] = ("sliding_window", "store", "observers")

_EVICTION_SHARED = ("dtype",)  # eviction rows are stored at 16 bits unless ``dtype`` overrides
_RVQ_CODEBOOKS = ("key_sub_dim", "value_sub_dim", "key_codebook_bits", "value_codebook_bits")
_TURBOQUANT = ("head_dim", "bit_width_inlier", "bit_width_outlier", "n_outlier_channels", "n_calib_tokens", "seed",
               "dtype", "capacity")

#: Per method, the flat fields outside its own options class that its cache reads (``head_dim`` of an
#: mlx_lm-protocol method comes from the model, so it is listed only for the standalone ones). The spec's
#: ``enable_vectorized_attend``, ``enable_outlier_two_stream`` and ``enable_fused_query_dot`` are read by no
#: method, so no method accepts them. ``tests/test_config.py`` records every config read of each method
#: (a tiny model for the mlx_lm ones, appended rows and a query for the standalone ones) and checks this
#: table both ways: nothing listed here goes unread, nothing read is missing.
SHARED_FIELDS: dict[str, tuple[str, ...]] = {
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
    "svdq": ("bit_width_inlier", "kivi_group_size"),
    "kvtc": ("kivi_group_size",),
    "cam": ("seed",) + _EVICTION_SHARED,
    "a2ats": ("seed",),
    **{m: _EVICTION_SHARED for m in ("snapkv", "streaming_llm", "h2o", "tova", "pyramidkv", "squeeze", "chunkkv",
                                     "knorm", "qfilters", "keyformer", "morphkv", "kvzip", "curdkv", "nestedkv",
                                     "rocketkv")},
}

#: Fields the library writes per layer when it builds a model's caches; never user settings.
DERIVED_FIELDS: tuple[str, ...] = ("cachegen_resolved_bits", "pyramid_resolved_budget", "squeeze_resolved_budget")


def method_fields(method: str) -> dict[str, str]:
    """Every setting name ``method`` accepts -> the flat ``KVCacheConfig`` field it sets.

    The names are its options' own names (``budget``), their flat aliases (``snap_budget``), the shared
    fields it reads (:data:`SHARED_FIELDS`) and :data:`COMMON_FIELDS`. An option-only field (``OPTION_ONLY``,
    no flat field) maps to its own name, which is not a ``KVCacheConfig`` field. Where an option's own name is also a
    shared field the method reads (snapkv's ``dtype``), the shared field keeps the name and the option is
    reached through its flat alias (``snap_dtype``).
    """
    opts = OPTIONS_BY_METHOD.get(method)
    out: dict[str, str] = dict(opts.FIELDS) if opts is not None else {}
    out.update({name: name for name in (opts.OPTION_ONLY if opts is not None else ())})
    for flat in (opts.FIELDS.values() if opts is not None else ()):
        out[flat] = flat
    for flat in SHARED_FIELDS.get(method, ()) + COMMON_FIELDS:
        out[flat] = flat
    return out
