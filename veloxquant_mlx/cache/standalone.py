"""``SlidingWindowKVCache``: sliding-window eviction around any standalone cache, which drops its oldest
encoded tokens in place (``drop_oldest``; no full-precision ring buffer): memory stays at the compressed window.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.abstractions import KVCache
from .errors import QuantizerConfigError


class SlidingWindowKVCache(KVCache):
    """Keeps the ``window_size`` most recent (key, value) pairs of ``inner``."""

    def __init__(self, inner: KVCache, window_size: int):
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
            raise QuantizerConfigError("window_size", window_size, "an int >= 1")
        if not callable(getattr(inner, "drop_oldest", None)):
            raise QuantizerConfigError("inner", type(inner).__name__, "a standalone cache with drop_oldest(n)")
        self.inner, self.window_size = inner, window_size
        self._evict()  # an inner cache handed over already filled keeps only its window too

    def append_key(self, k):
        self.inner.append_key(k)
        self._evict()  # a key may complete pairs too (its value appended first)

    def append_value(self, v):
        self.inner.append_value(v)
        self._evict()

    def _evict(self) -> None:
        n = len(self.inner)
        if n > self.window_size:
            self.inner.drop_oldest(n - self.window_size)

    def attend(self, q: mx.array) -> mx.array:
        return self.inner.attend(q)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def reset(self) -> None:
        self.inner.reset()

    def __len__(self):
        return len(self.inner)
