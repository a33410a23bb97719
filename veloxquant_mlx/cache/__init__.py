"""KV-cache implementations for every method of VeloxQuant-MLX, and how to build them.

``KVCacheConfig`` configures a cache, ``KVCacheFactory.create`` builds one, ``KVCacheBuilder`` builds
one fluently or, with ``for_model``, one per layer of an mlx_lm model. ``base`` holds the method
registry (``all_methods()``, ``STANDALONE_METHODS``).
"""

from .artifacts import ArtifactStore, InMemoryArtifactStore, NpyDirectoryArtifactStore
from .base import METHOD_NAMES, STANDALONE_METHODS, all_methods, method_info
from .config import KVCacheConfig
from .contract import BatchingNotSupported, CompressedKVCache
from .errors import CacheInputError, QuantizerConfigError, SavedCacheError
from .factory import KVCacheBuilder, KVCacheFactory
from .observers import QuantizationEvent, QuantizationObserver
from .options import *  # noqa: F401,F403  (every <Method>Options dataclass)
from .standalone import SlidingWindowKVCache
from . import methods as _methods  # noqa: F401  (registers the built methods)
from .composed import register_composed as _register_composed

_register_composed()  # Quantized<EvictionClass>: loadable by mlx_lm's load_prompt_cache
from .saved import load_cache, read_cache_info, save_cache
from .methods.quantization.turboquant import TurboQuantKVCache  # the API reference's class of both TurboQuants


def __getattr__(name):
    """Cache classes by name (``veloxquant_mlx.cache.SnapKVKVCache``), from the registry."""
    for info in all_methods():
        if info.cls is not None and info.cls.__name__ == name:
            return info.cls
    raise AttributeError(name)
