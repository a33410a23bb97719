"""VeloxQuant's own per-vector cache API, used by the standalone methods.

A standalone cache stores keys and values for a single attention head, one vector (shape ``(d,)``)
or a block of vectors (shape ``(n, d)``) at a time, and answers a query with ``attend``. It does not
implement mlx_lm's serving contract; ``KVCacheBuilder.for_model`` rejects these methods.
"""

from __future__ import annotations

import abc

import mlx.core as mx


class KVCache(abc.ABC):
    """Abstract single-head cache: append keys and values, attend with a query."""

    @abc.abstractmethod
    def append_key(self, k: mx.array) -> None:
        """Encode and store one key ``(d,)`` or a block of keys ``(n, d)``."""

    @abc.abstractmethod
    def append_value(self, v: mx.array) -> None:
        """Encode and store one value ``(d,)`` or a block of values ``(n, d)``."""

    @abc.abstractmethod
    def attend(self, q: mx.array) -> mx.array:
        """Softmax attention of query ``(d,)`` (or ``(m, d)``) over everything stored."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of the arrays this cache holds (codes, norms, scales), not an estimate."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every stored token; seeded quantizer state (rotations, codebooks) is kept."""

    def __len__(self) -> int:  # number of complete (key, value) pairs stored
        return getattr(self, "n_tokens", 0)
