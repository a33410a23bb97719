"""The method registry: each method's name, family, protocol, paper and class (``@register("name")``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

QUANTIZATION, EVICTION, CROSS_LAYER = "quantization", "eviction", "cross_layer"
MLX_LM, STANDALONE = "mlx_lm", "standalone"

# name: (family, protocol, paper)
_METHOD_TABLE = {
    "turboquant_prod": (QUANTIZATION, STANDALONE, "TurboQuant (arXiv 2504.19874)"),
    "turboquant_mse": (QUANTIZATION, STANDALONE, "TurboQuant (arXiv 2504.19874)"),
    "turboquant_rvq": (QUANTIZATION, MLX_LM, "TurboQuant (arXiv 2504.19874) + residual VQ"),
    "polar": (QUANTIZATION, STANDALONE, "PolarQuant (arXiv 2502.02617)"),
    "qjl": (QUANTIZATION, STANDALONE, "QJL (arXiv 2406.03482)"),
    "vecinfer": (QUANTIZATION, MLX_LM, "VecInfer (arXiv 2510.06175)"),
    "spectral": (QUANTIZATION, STANDALONE,
                 "SpectralQuant (Dynamis Labs; no canonical paper, no arXiv id) + QJL (arXiv 2406.03482)"),
    "kivi": (QUANTIZATION, MLX_LM, "KIVI (arXiv 2402.02750)"),
    "kivi_sink": (QUANTIZATION, MLX_LM, "KIVI (arXiv 2402.02750) + attention sinks (StreamingLLM, arXiv 2309.17453)"),
    "svdq": (CROSS_LAYER, MLX_LM, "SVDq (arXiv 2502.15304)"),
    "kitty": (QUANTIZATION, MLX_LM, "Kitty: mixed channel precision (arXiv 2511.18643)"),
    "adakv": (QUANTIZATION, MLX_LM, "MiKV: importance-aware mixed-precision tokens (arXiv 2402.18096)"),
    "xquant": (CROSS_LAYER, MLX_LM, "XQuant: cross-layer shared codes (arXiv 2510.11236)"),
    "kvquant": (QUANTIZATION, MLX_LM, "KVQuant (arXiv 2401.18079)"),
    "palu": (CROSS_LAYER, MLX_LM, "Palu (arXiv 2407.21118)"),
    "cachegen": (QUANTIZATION, MLX_LM, "CacheGen (arXiv 2310.07240)"),
    "minicache": (CROSS_LAYER, MLX_LM, "MiniCache (arXiv 2405.14366)"),
    "gear": (QUANTIZATION, MLX_LM, "GEAR (arXiv 2403.05527)"),
    "zipcache": (QUANTIZATION, MLX_LM, "ZipCache (arXiv 2405.14256)"),
    "snapkv": (EVICTION, MLX_LM, "SnapKV (arXiv 2404.14469)"),
    "streaming_llm": (EVICTION, MLX_LM, "StreamingLLM (arXiv 2309.17453)"),
    "h2o": (EVICTION, MLX_LM, "H2O (arXiv 2306.14048)"),
    "tova": (EVICTION, MLX_LM, "TOVA (arXiv 2401.06104)"),
    "pyramidkv": (EVICTION, MLX_LM, "PyramidKV (arXiv 2406.02069)"),
    "squeeze": (EVICTION, MLX_LM, "SqueezeAttention (arXiv 2404.04793)"),
    "chunkkv": (EVICTION, MLX_LM, "ChunkKV (arXiv 2502.00299)"),
    "cam": (EVICTION, MLX_LM, "CaM (ICML 2024, PMLR 235; no arXiv id)"),
    "xkv": (CROSS_LAYER, MLX_LM, "xKV (arXiv 2503.18893)"),
    "nsnquant": (QUANTIZATION, MLX_LM, "NSNQuant (arXiv 2505.18231)"),
    "knorm": (EVICTION, MLX_LM, "L2-norm eviction (arXiv 2406.11430)"),
    "skvq": (QUANTIZATION, MLX_LM, "SKVQ (arXiv 2405.06219)"),
    "qfilters": (EVICTION, MLX_LM, "Q-Filters (arXiv 2503.02812)"),
    "keyformer": (EVICTION, MLX_LM, "Keyformer (arXiv 2403.09054)"),
    "morphkv": (EVICTION, MLX_LM, "MorphKV: Dialogue Without Limits (ICML 2025, arXiv 2503.00979)"),
    "kvzip": (EVICTION, MLX_LM, "KVzip (arXiv 2505.23416)"),
    "kvtc": (CROSS_LAYER, MLX_LM, "KVTC: KV cache transform coding (arXiv 2511.01815)"),
    "curdkv": (EVICTION, MLX_LM, "CurDKV: CUR leverage-score selection (arXiv 2509.15038)"),
    "nestedkv": (EVICTION, MLX_LM, "NestedKV (arXiv 2605.26678, abstract only; formulas: library design)"),
    "amc": (QUANTIZATION, MLX_LM, "AMC: saliency-tiered precision (no canonical paper: library design)"),
    "a2ats": (QUANTIZATION, MLX_LM, "A2ATS (arXiv 2502.12665)"),
    "anchorkv": (QUANTIZATION, MLX_LM, "AnchorKV (no canonical paper: library design after AnTKV, arXiv 2506.19505)"),
    "rocketkv": (EVICTION, MLX_LM, "RocketKV (arXiv 2502.14051)"),
    "age_tiered": (QUANTIZATION, MLX_LM,
                   "age-tiered re-quantization (no canonical paper: library design on KIVI, arXiv 2402.02750)"),
    "waterfill": (QUANTIZATION, MLX_LM, "query-weighted key channel bits (no canonical paper: library design from "
                                        "KVQuant arXiv 2401.18079, Kitty arXiv 2511.18643, QuaRot arXiv 2404.00456)"),
}

METHOD_NAMES = tuple(_METHOD_TABLE)

# per-vector API (append_key / append_value / attend / memory_bytes / reset), not mlx_lm's
STANDALONE_METHODS = frozenset(n for n, (_, p, _) in _METHOD_TABLE.items() if p == STANDALONE)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    family: str
    protocol: str
    paper: str
    cls: Optional[type] = None

    @property
    def implemented(self) -> bool:
        return self.cls is not None


_CLASSES: dict[str, type] = {}


def register(name: str):
    """Class decorator: make ``cls`` the implementation of method ``name``."""
    if name not in _METHOD_TABLE:
        raise KeyError(f"unknown method {name!r}; add it to _METHOD_TABLE first")

    def decorate(cls):
        _CLASSES[name] = cls
        cls.method_name = name
        return cls
    return decorate


def add_method(name: str, family: str, options: Optional[type] = None, paper: str = "no paper"):
    """Add an mlx_lm-protocol method (a plug-in) and its options class for ``@register`` and ``KVCacheConfig``
    (``METHOD_NAMES``, the spec's list, unchanged); returns a function removing it again."""
    from .options import OPTIONS_BY_METHOD
    if name in _METHOD_TABLE:
        raise KeyError(f"method {name!r} exists")
    if family not in (QUANTIZATION, EVICTION, CROSS_LAYER):
        raise ValueError(f"unknown family {family!r}")
    if options is not None and options.METHOD != name:
        raise ValueError(f"{options.__name__} is declared for method {options.METHOD!r}, not {name!r}")
    _METHOD_TABLE[name] = (family, MLX_LM, paper)
    if options is not None:
        OPTIONS_BY_METHOD[name] = options

    def remove() -> None:
        _METHOD_TABLE.pop(name, None)
        _CLASSES.pop(name, None)
        OPTIONS_BY_METHOD.pop(name, None)
    return remove


def method_info(name: str) -> MethodInfo:
    from . import methods  # noqa: F401  (importing registers every built method)
    family, protocol, paper = _METHOD_TABLE[name]
    return MethodInfo(name, family, protocol, paper, _CLASSES.get(name))


def all_methods() -> list[MethodInfo]:
    return [method_info(n) for n in METHOD_NAMES]


def implemented_class(method: str) -> type:
    """The class of ``method``; ``NotImplementedError`` for a registered but unbuilt one."""
    info = method_info(method)
    if not info.implemented:
        raise NotImplementedError(f"method {method!r} ({info.paper}) is registered but not implemented yet; "
                                  "`veloxquant methods` lists the implemented ones")
    return info.cls
