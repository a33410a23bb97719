"""Construction: ``KVCacheFactory.create`` (one cache), ``KVCacheBuilder`` (fluent, validated) and
``KVCacheBuilder.for_model`` (one cache per layer of an mlx_lm model)."""

from __future__ import annotations

import functools

from mlx_lm.models import cache as mlx_cache

from . import dispatch
from .artifacts import ArtifactStore
from .base import METHOD_NAMES, STANDALONE_METHODS, implemented_class
from .composed import composed_class, layers_of, quant_config
from .config import KVCacheConfig, validate_for_model
from .errors import QuantizerConfigError
from .observers import QuantizationObserver, notify
from .options import _is_int
from .rotating import RING_CLASSES
from .standalone import SlidingWindowKVCache


def _cache_class(config):
    """The method's class, or its quantized-eviction form when its options set ``quantize``."""
    cls = implemented_class(config.method)
    return cls if config.option("quantize") is None else composed_class(cls)


class KVCacheFactory:
    """Builds one cache from a ``KVCacheConfig``."""

    @staticmethod
    def create(config: KVCacheConfig):
        if not isinstance(config, KVCacheConfig):
            raise QuantizerConfigError("config", type(config).__name__, "a KVCacheConfig")
        if isinstance(config.bit_width_inlier, (list, tuple)):
            raise QuantizerConfigError("bit_width_inlier", config.bit_width_inlier, "an int for "
                                       "KVCacheFactory.create (a per-layer list needs KVCacheBuilder.for_model)")
        cache = _cache_class(config)(config)
        if config.sliding_window is not None:
            _check_no_window(config)
            cache = SlidingWindowKVCache(cache, config.sliding_window)
        notify(config.observers, "created", config.method, cache=type(cache).__name__)
        return cache


def _check_no_window(config) -> None:
    """Refuse ``sliding_window`` for an mlx_lm-protocol method (only the standalone caches wrap in a window)."""
    if config.sliding_window is not None and config.method not in STANDALONE_METHODS:
        raise QuantizerConfigError("sliding_window", config.sliding_window, "None for mlx_lm-protocol methods "
                                   "(use method='streaming_llm' for a windowed cache)")


def language_model(model):
    """The text model inside a VLM-style wrapper (``model.language_model``), else ``model``."""
    return getattr(model, "language_model", model)


def _layers(model):
    lm = language_model(model)
    for path in ("layers", "model.layers", "transformer.h", "transformer.layers"):
        try:
            return list(functools.reduce(getattr, path.split("."), lm))
        except AttributeError:
            continue
    raise QuantizerConfigError("model", type(model).__name__, "an mlx_lm model with a .layers list")


def _attention(layer):
    return next((getattr(layer, n) for n in ("self_attn", "attention", "attn") if hasattr(layer, n)), None)


def _head_dim(attn, fallback: int) -> int:
    """The attention module's head dimension (``fallback`` without one)."""
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int):
        return hd
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    k_proj = getattr(attn, "k_proj", None)
    if n_kv and k_proj is not None and hasattr(k_proj, "weight"):
        return int(k_proj.weight.shape[0]) // int(n_kv)
    return fallback


class KVCacheBuilder:
    """Fluent, validated construction of a ``KVCacheConfig`` and its cache."""

    def __init__(self):
        self._fields: dict = {}

    def _set(self, **kw) -> "KVCacheBuilder":
        self._fields.update(kw)
        return self

    def with_method(self, method: str):
        if method not in METHOD_NAMES:
            raise QuantizerConfigError("method", method, f"one of {', '.join(METHOD_NAMES)}")
        return self._set(method=method)

    def with_head_dim(self, d: int):
        if not _is_int(d) or d < 2 or d & (d - 1):
            raise QuantizerConfigError("head_dim", d, "a power of 2 >= 2")
        return self._set(head_dim=d)

    def with_bit_width(self, inlier, outlier=None):
        return self._set(bit_width_inlier=inlier, bit_width_outlier=outlier)

    def with_jl_dim(self, m: int):
        """The JL sketch width m (QJL, TurboQuant-prod): any int >= 1. The spec's "must be <= head_dim" is not
        enforced: it contradicts its own advice (the estimator's variance falls as 1/m; m = 4 * head_dim for quality),
        and QJL's paper uses m > d."""
        return self._set(jl_dim=m)

    def with_n_outlier_channels(self, n: int):
        return self._set(n_outlier_channels=n)

    def with_n_calib_tokens(self, n: int):
        return self._set(n_calib_tokens=n)

    def with_vectorized_attend(self, enabled: bool = True):
        return self._set(enable_vectorized_attend=enabled)

    def with_outlier_two_stream(self, enabled: bool = True):
        return self._set(enable_outlier_two_stream=enabled)

    def with_fused_query_dot(self, enabled: bool = True):
        return self._set(enable_fused_query_dot=enabled)

    def with_seed(self, seed: int):
        return self._set(seed=seed)

    def with_precision(self, dtype):
        return self._set(dtype=dtype)

    def with_capacity(self, max_tokens: int):
        if not _is_int(max_tokens) or max_tokens < 1:
            raise QuantizerConfigError("capacity", max_tokens, "a positive int")
        return self._set(capacity=max_tokens)

    def with_artifact_store(self, store: ArtifactStore):
        if not isinstance(store, ArtifactStore):
            raise QuantizerConfigError("store", store, "an ArtifactStore")
        return self._set(store=store)

    def with_observer(self, observer: QuantizationObserver):
        if not isinstance(observer, QuantizationObserver):
            raise QuantizerConfigError("observers", observer, "a QuantizationObserver")
        return self._set(observers=self._fields.get("observers", []) + [observer])

    def with_sliding_window(self, window_size: int):
        return self._set(sliding_window=window_size)

    def with_options(self, options):
        return self._set(options=options)

    def config(self) -> KVCacheConfig:
        return KVCacheConfig(**self._fields)

    def build(self):
        return KVCacheFactory.create(self.config())

    @staticmethod
    def for_model(model, config: KVCacheConfig, install_dispatch: bool = True) -> list:
        """One cache per layer of ``model`` (its ``language_model`` for VLM wrappers): ``KVCache`` layers get
        ``config.method``'s cache (``head_dim`` from the layer, one ``bit_width_inlier`` entry each when a list),
        sliding-window layers the method's ring (``rotating.RING_CLASSES``) or mlx_lm's, others (state-space,
        ``CacheList``) the model's cache; MLA and K/V-less models are refused. Cross-layer methods build through
        ``build_layers``; ``bind_attention`` gets the layer's attention; the dispatch point and ``io_hooks``
        reports are installed unless ``install_dispatch=False``."""
        if not isinstance(config, KVCacheConfig):
            raise QuantizerConfigError("config", type(config).__name__, "a KVCacheConfig")
        if config.method in STANDALONE_METHODS:
            raise QuantizerConfigError("method", config.method, "an mlx_lm-protocol method: standalone methods "
                                       f"({', '.join(sorted(STANDALONE_METHODS))}) have no mlx_lm KVCache "
                                       "serving contract")
        _check_no_window(config)  # for_model builds no window: refused, not ignored
        cls = _cache_class(config)
        defaults = mlx_cache.make_prompt_cache(model)
        layers = _layers(model)
        if len(defaults) != len(layers):
            raise QuantizerConfigError("model", type(model).__name__,
                                       f"a model whose make_cache() returns one cache per layer ({len(layers)})")
        _check_kv_layers(model, defaults, layers)
        slots = [i for i, c in enumerate(defaults) if type(c) is mlx_cache.KVCache]
        ring_config = (lambda c: c) if config.option("quantize") is None else quant_config  # a quantizer's ring
        ring_cls = RING_CLASSES.get(ring_config(config).method)
        rings = [i for i, c in enumerate(defaults) if ring_cls and type(c) is mlx_cache.RotatingKVCache]
        bits, n = config.bit_width_inlier, len(slots) + len(rings)
        per_layer = isinstance(bits, (list, tuple))
        if per_layer and len(bits) != n:
            raise QuantizerConfigError("bit_width_inlier", list(bits), f"a list of {n} ints (one per compressed "
                                       "attention layer: full KV caches" + (" and sliding windows)" if rings else ")"))
        configs = {i: config.replace(head_dim=_head_dim(_attention(layers[i]), config.head_dim),
                                     **({"bit_width_inlier": int(bits[j])} if per_layer else {}))
                   for j, i in enumerate(sorted(slots + rings))}
        layer_configs = [configs[i] for i in slots]
        if layer_configs:
            validate_for_model(config, min(c.head_dim for c in configs.values()), len(layer_configs))
        built = layers_of(cls, layer_configs)
        built += [ring_cls(ring_config(configs[i]), defaults[i].max_size, defaults[i].keep) for i in rings]
        caches = list(defaults)
        for i, cache in zip(slots + rings, built):
            caches[i] = cache
            if hasattr(cache, "bind_attention"):  # caches that read the layer itself (e.g. its RoPE)
                cache.bind_attention(_attention(layers[i]))
            if install_dispatch:  # caches that watch hidden states: {"attention" | "layer": their method}
                for part, method in getattr(cache, "io_hooks", {}).items():
                    module = layers[i] if part == "layer" else _attention(layers[i])
                    if module is not None:
                        dispatch.report_io(module, method)
        if install_dispatch:
            dispatch.install()
        notify(config.observers, "created", config.method, layers=len(slots + rings))
        return caches


def _check_kv_layers(model, defaults, layers) -> None:
    """Refuse models whose caches hold no per-head K/V rows: MLA latents, or state-space layers only."""
    mla = next((a for a in map(_attention, layers) if a is not None and hasattr(a, "kv_lora_rank")), None)
    if mla is not None:
        raise QuantizerConfigError("model", type(model).__name__, (
            f"a model with per-head K/V caches: {type(mla).__name__} is multi-head latent attention (MLA, "
            "kv_lora_rank), whose cache holds a shared latent (DeepSeek-V3) or keys and values of different "
            "widths rebuilt from one (V2), which no method here is built for; use mlx_lm's own cache (method 'none')"))
    if not any(type(c) in (mlx_cache.KVCache, mlx_cache.RotatingKVCache) for c in defaults):
        kinds = ", ".join(sorted({type(c).__name__ for c in defaults}))
        raise QuantizerConfigError("model", type(model).__name__, (
            f"a model with at least one attention layer with a K/V cache: its caches are {kinds} "
            "(state-space layers hold no K/V rows); use mlx_lm's own cache (method 'none')"))
