"""The server's two prompt-cache stores under one prefix-reuse policy (docs/ARCHITECTURE.md, "Prefix reuse"):
:class:`PromptCacheStore` for compressed requests served one at a time, :class:`SafePromptCache` (mlx_lm's store,
its batch path, keyed per KV settings by the model key). Only ``chunk_invariant`` caches are kept (mlx_lm's
``KVCache`` is); a longer kept sequence is trimmed to the shared prefix only where every layer's trim is exact
(``exact_trim``, or ``trim_exact_or_raises``: a raise means recompute) and complete; else a shorter prefix or
recompute."""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from typing import Optional

from mlx_lm.models import cache as mlx_cache

from .measure import cache_figures

__all__ = ["PromptCacheStore", "SafePromptCache", "reuse_mode"]


def _keepable(caches) -> bool:
    return all(getattr(c, "chunk_invariant", type(c) is mlx_cache.KVCache) for c in caches)


def _trimmable(caches) -> bool:
    return all(getattr(c, "exact_trim", type(c) is mlx_cache.KVCache) or getattr(c, "trim_exact_or_raises", False)
               for c in caches)


def _trim(caches, n: int) -> bool:
    """Trim ``n`` tokens off every layer; False (recompute) when a layer raises or trims less."""
    try:
        return all(c.trim(n) == n for c in caches)
    except ValueError:  # the trim would cut into compressed rows
        return False


def reuse_mode(cls) -> str:
    """How a cached prefix of cache class ``cls`` can be reused (``/v1/kv/stats``)."""
    if not getattr(cls, "chunk_invariant", False):
        return "recompute (state depends on how tokens were split across calls)"
    if getattr(cls, "exact_trim", False):
        return "prefix and trim"
    if getattr(cls, "trim_exact_or_raises", False):
        return "prefix, and trim where it stays in the float16 residual (else recompute)"
    return "prefix only (trim is not exact)"


class PromptCacheStore:
    """LRU store of finished requests' compressed caches, keyed by (KV settings, tokens)."""

    def __init__(self, max_entries: int = 10, max_bytes: Optional[int] = None):
        self.max_entries, self.max_bytes, self._lock = max_entries, max_bytes, threading.Lock()
        self._entries: OrderedDict[tuple, list] = OrderedDict()  # (kv key, tokens) -> caches

    def __len__(self):
        return len(self._entries)

    def fetch(self, kv_key, prompt: list[int]):
        """``(private copy of caches or None, tokens reused, how)``: the kept sequence reusing the most tokens
        (leaving at least one prompt token), a prefix of the prompt or a longer one whose trim is exact."""
        candidates, skipped = [], ""
        with self._lock:
            for (key, tokens), caches in self._entries.items():
                use = min(len(os.path.commonprefix([list(tokens), prompt])), len(prompt) - 1) if key == kv_key else 0
                trim = len(tokens) - use
                if use <= 0:
                    continue
                if trim and not _trimmable(caches):
                    skipped = "; a longer kept sequence was skipped (its trim is not exact)"
                    continue
                candidates.append((use, -trim, (key, tokens)))
            candidates.sort(reverse=True)
            picked = [(use, -neg, k, copy.deepcopy(self._entries[k])) for use, neg, k in candidates[:2]]
        for use, trim, entry_key, caches in picked:
            if not trim or _trim(caches, trim):
                with self._lock:
                    if entry_key in self._entries:
                        self._entries.move_to_end(entry_key)
                return caches, use, ("trimmed" if trim else "prefix") + skipped
        return None, 0, "no reusable cached prefix: recomputed" + skipped

    def insert(self, kv_key, tokens: list[int], caches: list) -> None:
        """Keep ``caches`` (which have seen exactly ``tokens``) if the policy allows, evicting LRU first."""
        if self.max_entries <= 0 or not _keepable(caches):
            return
        with self._lock:
            self._entries[(kv_key, tuple(tokens))] = caches
            self._entries.move_to_end((kv_key, tuple(tokens)))
            while len(self._entries) > self.max_entries or (self.max_bytes is not None and self._entries and sum(
                    int(c.nbytes) for caches in self._entries.values() for c in caches) > self.max_bytes):
                self._entries.popitem(last=False)

    def describe(self, model) -> list[dict]:
        with self._lock:
            items = list(self._entries.items())
        return [{"method": key[0][0], "settings": dict(key[0][1]), **cache_figures(model, caches)}
                for key, caches in items]


class SafePromptCache(mlx_cache.LRUPromptCache):
    """mlx_lm's prompt-cache store under this module's policy: where mlx_lm trims whenever ``is_trimmable``, a
    trim that is not exact, raises or is incomplete means a shorter prefix or a recompute instead."""

    skip_fetch = False  # set per request (kv_cache.reuse = false) by the response generator

    def __init__(self, max_size: int, counters: dict):
        super().__init__(max_size)
        self.counters = counters  # the server's; reused_tokens counts here

    def fetch_nearest_cache(self, model, tokens):
        if self.skip_fetch:
            return None, tokens
        found = self._trie.search(model, tokens)
        if found.exact is not None:
            return self._reused(self._trie.get(found.model, found.exact).prompt_cache, tokens, len(tokens))
        short = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > short:
            longer = self._trie.get(found.model, found.longer).prompt_cache
            if _trimmable(longer):
                caches, prefix = copy.deepcopy(longer), min(len(tokens) - 1, found.common_prefix)
                ok = _trim(caches, len(found.longer) - prefix)
                return self._reused(caches, tokens, prefix, copied=True) if ok else (None, tokens)
        if short > 0:
            return self._reused(self._trie.get(found.model, found.shorter).prompt_cache, tokens, short)
        return None, tokens

    def _reused(self, caches, tokens, n: int, copied: bool = False):
        """A private copy of ``caches`` for the first ``n`` tokens (None unless every layer is at ``n``)."""
        if any(isinstance(getattr(c, "offset", None), int) and c.offset != n for c in caches):
            return None, tokens
        self.counters["reused_tokens"] += n
        return (caches if copied else copy.deepcopy(caches)), tokens[n:]

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        if _keepable(prompt_cache):  # a state that depends on the call split is never reused
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def describe(self, model) -> list[dict]:
        """``/v1/kv/stats`` rows of the kept sequences (the KV settings ride in the model key)."""
        kept = [(key[1] or ("none", ()), caches) for key, _, caches in self.entries()]
        return [{"method": m, "settings": dict(s), "store": "mlx_lm", **cache_figures(model, c)} for (m, s), c in kept]

    def entries(self) -> list:
        """``(model key, tokens, caches)`` of every kept sequence (mlx_lm 0.32's LRU and trie; pinned below 0.33)."""
        out = []
        for lru in list(self._lru._lrus.values()):
            for model, tokens in list(lru):
                try:  # the generation thread may evict it meanwhile (stats run on a handler thread)
                    out.append((model, tokens, self._trie.get(model, tokens).prompt_cache))
                except (KeyError, AttributeError, TypeError):
                    continue
        return out
