"""Relinking the layers of a cross-layer group (minicache, xkv, xquant) after ``load_prompt_cache``.

mlx_lm loads the caches of a prompt cache in layer order, so a group's first layer (the owner of what
the group shares) is loaded before the layers that read it. Each method keeps one registry (weak
values, by group id) of the shared objects loaded most recently.
"""

from __future__ import annotations

import weakref

from ..contract import CompressedKVCache


def registry() -> "weakref.WeakValueDictionary":
    return weakref.WeakValueDictionary()


def relink(links, key: str, owner: bool, make, what: str):
    """The owner registers ``make()`` (fresh: never the originals' links) under ``key``; a reader gets
    it, or a ``ValueError`` naming ``what`` must be loaded first."""
    if owner:
        shared = links[key] = make()
        return shared
    shared = links.get(key)
    if shared is None:
        raise ValueError(f"{what} of group {key} must be loaded first")
    return shared


def relinking_state(relink_loaded):
    """The contract's ``state`` property, with ``relink_loaded(cache)`` run after a state is set."""

    def fset(self, v):
        CompressedKVCache.state.fset(self, v)
        relink_loaded(self)

    return property(CompressedKVCache.state.fget, fset)
