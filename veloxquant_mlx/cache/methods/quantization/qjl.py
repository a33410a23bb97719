"""QJL standalone single-head cache ("qjl"; Zandieh, Daliri, Han; arXiv 2406.03482): keys as 1-bit quantized
Johnson–Lindenstrauss sketches.

A key is the bit-packed signs of ``S k`` (``S`` a seeded ``m x d`` Gaussian, ``m = jl_dim`` or ``head_dim``;
``config.store`` key ``qjl.sketch.m<m>.d<d>.seed<seed>``) and ``||k||``; queries stay exact: the paper's unbiased
estimator (``primitives.sketch``; for Gaussian ``q, k`` its correlation with ``q·k`` is ``sqrt(1 / (1 + pi/2 *
d/m))``: ~0.62 at ``m = d``). Values: one min/max group per token at ``bit_width_inlier`` bits. d = m = 128, b = 2:
54 bytes a token (fp16 K+V: 512). The signs take 1 bit each (the API reference's QJLKVCache held one int8 per sign,
8x the key bytes).

Deviations from the paper: (1) no outlier-channel split; (2) the key norm is float16 (relative score error at
most 2^-11); (3) values use one min/max group per token, not group-wise quantization; (4) the sketch is a dense
float32 matmul, scores come from the unpacked signs (no fused kernel).

Shared behaviour: ``standalone_util.StandaloneCache``. A key norm, value entries or a value row's range beyond
float16 raise ``CacheInputError``.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...errors import CacheInputError
from ...primitives import groupquant as gq
from ...primitives.bitpack import packed_words
from ...primitives.rowstore import RowStore
from ...primitives.sketch import gaussian_jl, qjl_dequantize, qjl_inner_product, qjl_pack
from ...standalone_util import FP16_MAX, StandaloneCache, as_block, check_norm16, from_store, jl_width, qjl_signs


@register("qjl")
class QJLKVCache(StandaloneCache):
    """QJL: keys as ``jl_dim`` sign bits of a Gaussian sketch + float16 norm; min/max-coded values."""

    def __init__(self, config):
        initial = self._setup(config)
        d, b, seed = self.head_dim, self.bit_width_inlier, self.seed
        self.jl_dim = m = jl_width(config, d)
        self.sketch = from_store(self.store, f"qjl.sketch.m{m}.d{d}.seed{seed}", lambda: gaussian_jl(m, d, seed),
                                 (m, d))
        self._keys = RowStore({"signs": ((packed_words(m, 1),), mx.uint32), "norm": ((), mx.float16)}, initial,
                              self.capacity)
        self._values = RowStore({"vcodes": ((gq.words_per_group(b, d),), mx.uint32), "vscale": ((), mx.float16),
                                 "vmin": ((), mx.float16)}, initial, self.capacity)

    def _state_arrays(self) -> list:
        return [self.sketch]  # the m x d float32 JL matrix

    def append_key(self, k) -> None:
        k = as_block(k, self.head_dim, "key")[0]
        if k.shape[0] == 0:
            return
        check_norm16(k, "key")
        self._keys.append({"signs": qjl_pack(self.sketch, k),
                           "norm": mx.sqrt(mx.sum(k * k, axis=1)).astype(mx.float16)})

    def _signs(self, n: int) -> mx.array:
        """``(n, m)`` 0/1 sign bits of the ``n`` oldest keys (1: ``S k >= 0``)."""
        return qjl_signs(self._keys, "signs", n, self.jl_dim)

    def _scores(self, q: mx.array, n: int) -> mx.array:
        return qjl_inner_product(q, self._signs(n), self._keys.view("norm")[:n], self.sketch)

    def reconstruct_keys(self) -> mx.array:
        """``(n_keys, d)`` vectors ``sqrt(pi/2)/m ||k|| S^T sign(S k)``: their inner product with any
        query is the score estimate (unbiased for ``<q, k>``, not an MSE reconstruction)."""
        n = self._keys.n
        return qjl_dequantize(self._signs(n), self._keys.view("norm")[:n], self.sketch)

    def append_value(self, v) -> None:
        v = as_block(v, self.head_dim, "value")[0]
        if v.shape[0] == 0:
            return
        # one group = the whole row, its scale and minimum kept in float16
        if mx.max(mx.abs(v)).item() > FP16_MAX or mx.max(mx.max(v, axis=1) - mx.min(v, axis=1)).item() > FP16_MAX:
            raise CacheInputError(f"value entries or their range exceed the float16 range ({FP16_MAX})")
        codes, scale, lo = gq.quantize(v, self.bit_width_inlier, self.head_dim, reference=True)
        self._values.append({"vcodes": codes, "vscale": scale[:, 0], "vmin": lo[:, 0]})

    def _decoded_values(self, n: int) -> mx.array:
        if not n:
            return mx.zeros((0, self.head_dim))
        scale, lo = self._values.view("vscale")[:n, None], self._values.view("vmin")[:n, None]
        return gq.dequantize(self._values.view("vcodes")[:n], scale, lo, self.bit_width_inlier, self.head_dim)

    def reconstruct_values(self) -> mx.array:
        """``(n_values, d)`` float32 decoded values ``min + code * scale``."""
        return self._decoded_values(self._values.n)

    def _attend_values(self, w: mx.array, n: int) -> mx.array:
        return w @ self._decoded_values(n)
