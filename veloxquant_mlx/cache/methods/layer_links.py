"""What the cross-layer groups (chunkkv, minicache, xkv, xquant) share: relinking a group after
``load_prompt_cache`` (layers load in order, so a group's owner comes before its readers; ``_LOADED`` keeps
the shared objects by group uuid, weakly) and (minicache, xkv) the float16 window waiting for the group.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from ..contract import CompressedKVCache
from ..primitives.buffers import dtype_name, grow_rows
from .quantization.kivi import RES_DTYPE

_LOADED = weakref.WeakValueDictionary()


def relink(key: str, owner: bool, make, what: str):
    """The owner registers a fresh ``make()`` under ``key``; a reader gets it, else ``ValueError``."""
    if owner:
        shared = _LOADED[key] = make()
        return shared
    shared = _LOADED.get(key)
    if shared is None:
        raise ValueError(f"{what} of group {key} must be loaded first")
    return shared


def relinking_state():
    """The contract's ``state`` property, then ``_relink_loaded()`` when set."""

    def fset(self, v):
        CompressedKVCache.state.fset(self, v)
        self._relink_loaded()
    return property(CompressedKVCache.state.fget, fset)


class GroupWindow:
    """Mixin before ``KIVIKVCache``: a call's rows wait in a float16 window (``res_k``/``res_v``, ``n_res``
    rows after ``n_quant`` compressed) until the group compresses whole blocks; subclasses give
    ``_compressed_bytes``."""

    def _append_window(self, keys, values) -> int:
        """Append this call's rows to the window; returns the rows that fill whole blocks."""
        self.dtype_name = dtype_name(keys.dtype)
        r0 = self.n_res
        past = (self.res_k[:, :, :r0], self.res_v[:, :, :r0]) if r0 else (None, None)
        self._call = (self.n_quant, r0, *past, keys, values)
        self.res_k = grow_rows(self.res_k, r0, keys.astype(RES_DTYPE))
        self.res_v = grow_rows(self.res_v, r0, values.astype(RES_DTYPE))
        self.n_res = r0 + keys.shape[2]
        return self.n_res // self.group * self.group

    def _advance(self, m: int) -> None:
        """Drop the window's first ``m`` rows (now compressed)."""
        rest = self.n_res - m
        for kind in ("k", "v"):
            buf = getattr(self, f"res_{kind}")
            setattr(self, f"res_{kind}", grow_rows(None, 0, buf[:, :, m : self.n_res]) if rest else
                    mx.zeros((*buf.shape[:2], self.group, buf.shape[-1]), RES_DTYPE))
        self.n_quant += m
        self.n_res = rest

    def _part_bytes(self, kind: str) -> int:
        """Filled bytes of one side: the window and ``_compressed_bytes``."""
        res = getattr(self, f"res_{kind}")
        if res is None:
            return 0
        B, H, _, D = res.shape
        return B * H * self.n_res * D * 2 + self._compressed_bytes(kind, B, H, D)

    used_nbytes = property(lambda self: self._part_bytes("k") + self._part_bytes("v"),
                           doc="Bytes of the filled parts of the arrays held (spare capacity left out).")
    compressed_key_bytes = property(lambda self: self._part_bytes("k"))
    compressed_value_bytes = property(lambda self: self._part_bytes("v"))
