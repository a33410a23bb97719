"""``DeferredStart``: a KIVI-layout cache whose compressed form carries a large per-layer fixed part
(a fitted basis, factors of the weights) keeps its rows in float16 until compressing them pays.

The rule (``contract.SHORT_PROMPT_SLACK_ROWS``: a short chat holds at most its float16 rows plus a small
constant): the first block is compressed once the stored rows reach ``start_rows`` -- the smallest
multiple of the group G at which the compressed form (fixed part + per-token codes) is smaller than the
float16 rows it replaces. Until then every row waits in the float16 residual, grown as rows arrive
(``grow_rows``); from then on the cache is plain KIVI (complete groups compressed, < G rows residual).
The start depends only on the layer's shapes and settings, never on how the rows were split into calls.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..primitives.buffers import grow_rows
from .quantization.kivi import RES_DTYPE

NEVER = 1 << 62  # start when the compressed form is never smaller


class DeferredStart:
    """Mixin before a ``KIVIKVCache`` subclass; the subclass gives ``_compressed_cost``."""

    def _compressed_cost(self, H: int, D: int, Dv: int) -> tuple[float, float]:
        """(fixed bytes, bytes per token) of the compressed form, per batch row, at most."""
        raise NotImplementedError

    def start_rows(self, H: int, D: int, Dv: int) -> int:
        """Stored rows at which the first block is compressed (a multiple of G)."""
        fixed, per_token = self._compressed_cost(H, D, Dv)
        saved = 2 * H * (D + Dv) - per_token  # float16 bytes a compressed token saves
        if saved <= 0:
            return NEVER
        G = self.group
        return max(G, math.ceil(math.ceil(fixed / saved) / G) * G)

    def _store(self, keys, values):
        B, H, N, D = keys.shape
        r0, G = self.n_res, self.group
        if self.n_quant == 0 and r0 + N < self.start_rows(H, D, values.shape[-1]):
            self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
            past = (self.res_k[:, :, :r0], self.res_v[:, :, :r0]) if r0 else (None, None)
            self._call = (0, r0, *past, keys, values)
            self.res_k = grow_rows(self.res_k, r0, keys.astype(RES_DTYPE))
            self.res_v = grow_rows(self.res_v, r0, values.astype(RES_DTYPE))
            self.n_res = r0 + N
            return
        if self.res_k is not None and self.res_k.shape[2] < G:  # KIVI's residual holds G rows
            k, v = (mx.zeros((B, H, G, a.shape[-1]), dtype=RES_DTYPE) for a in (self.res_k, self.res_v))
            if r0:
                k[:, :, :r0], v[:, :, :r0] = self.res_k[:, :, :r0], self.res_v[:, :, :r0]
            self.res_k, self.res_v = k, v
        super()._store(keys, values)
        if self.res_k.shape[2] > G:  # the float16 phase is over: back to one group of residual rows
            self.res_k, self.res_v = mx.contiguous(self.res_k[:, :, :G]), mx.contiguous(self.res_v[:, :, :G])
