"""QJL standalone cache (Zandieh, Daliri, Han; arXiv 2406.03482).

``QJLKVCache`` ("qjl") -- a single-head cache implementing
:class:`veloxquant_mlx.core.abstractions.KVCache` whose keys are 1-bit quantized Johnson–Lindenstrauss
sketches.

Algorithm
    A seeded ``m x d`` matrix ``S`` with i.i.d. N(0, 1) entries (``m = jl_dim``) is drawn once. A key
    ``k`` is stored as the ``m`` sign bits of ``S k`` (bit-packed, 32 per ``uint32`` word) and its norm
    ``||k||`` (float16). A query is *not* quantized: it is projected, ``S q``, and every score is the
    paper's asymmetric estimator

        <q, k>  ~  sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>

    which is unbiased: for one row ``s`` of ``S``, ``E[<s, q> sign(<s, k>)] = sqrt(2/pi) <q, k>/||k||``.
    The estimator is a mean of ``m`` i.i.d. terms, so its variance is exactly

        Var = (pi/2 * ||q||^2 ||k||^2 - <q, k>^2) / m,

    i.e. it falls as ``1/m``. ``jl_dim=None`` means ``m = head_dim``: one sign bit per coordinate, cheap
    but noisy. Quality improves with larger ``m`` (variance ∝ 1/m; bytes per key grow by m/8): for
    independent Gaussian ``q, k`` the correlation of the estimate with the exact ``q·k`` is
    ``sqrt(1 / (1 + pi/2 * d/m))`` to first order -- about 0.62 at ``m = d`` and 0.85 at ``m = 4d``
    (the API reference quotes ~0.64 and ~0.88 at d = 128) -- so raise ``jl_dim`` when attention
    quality matters.

Values are quantized per token with the shared group quantizer (``primitives.groupquant``, one group
= the token's ``d`` entries, its min/max reference kernel): ``b = bit_width_inlier`` bits per
coordinate (1..8), codes bit-packed, float16 scale and minimum. QJL's keys are 1-bit by
construction, so ``bit_width_inlier`` is the value precision. Relative squared error on Gaussian
values at d = 128: 3e-5 at ``b = 8`` (near-lossless), 0.01 at ``b = 4``, 0.25 at the default ``b = 2``
(the aggressive low-bit setting of the KV-quantization literature); ``b = 1`` keeps only min and max.

Storage per token (``d = head_dim``): ``m`` sign bits (padded to whole 32-bit words) + float16 key
norm; values ``b*d`` bits (padded to words) + float16 scale + float16 minimum. ``d = m = 128, b = 8``:
16 + 2 + 128 + 4 = 150 bytes; ``b = 2``: 16 + 2 + 32 + 4 = 54 bytes (fp16 K+V: 512). Signs take one
bit each, not one byte as in the system the API reference was taken from. ``memory_bytes()`` counts
those per-token arrays (with preallocated capacity); the JL matrix is reported by ``state_bytes()``.

Deviations from the paper (all of them, as implemented here):

1. No outlier-channel split: the paper keeps a few high-magnitude key channels of deeper layers in a
   separate, less compressed quantizer; here every channel goes through the same sketch.
2. The key norm is stored in float16 (a relative error of at most 2^-11 on each score, i.e. a
   negligible multiplicative bias).
3. Values use a plain per-token min/max quantizer over the whole head (one scale and minimum per
   token), not a group-wise one.
4. The sketch is a dense Gaussian matrix applied with a float32 matmul; scores are computed from the
   unpacked signs (no fused kernel).

Shared behaviour (inputs, ``attend``, capacity): :class:`~veloxquant_mlx.cache.standalone_util.StandaloneCache`.
A key norm, value entries or a value row's range outside the float16 range raise ``CacheInputError``.
With an ``ArtifactStore`` in ``config.store`` the JL matrix is kept there under
``qjl.sketch.m<m>.d<d>.seed<seed>``.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...errors import CacheInputError
from ...primitives import groupquant as gq
from ...primitives.bitpack import pack_bits, packed_words
from ...primitives.rowstore import RowStore
from ...primitives.sketch import gaussian_jl, qjl_dequantize, qjl_inner_product
from ...standalone_util import FP16_MAX, StandaloneCache, as_block, check_norm16, from_store, jl_width, qjl_signs

__all__ = ["QJLKVCache"]


@register("qjl")
class QJLKVCache(StandaloneCache):
    """QJL (arXiv 2406.03482): keys as ``m = jl_dim`` bit-packed signs of a Gaussian JL projection plus
    the float16 key norm, scored with the unbiased estimator ``sqrt(pi/2)/m ||k|| <S q, sign(S k)>``.
    ``jl_dim=None`` means ``m = head_dim`` (noisy: estimator variance ∝ 1/m, so raise ``jl_dim`` when
    attention quality matters); values per token at ``bit_width_inlier`` bits (min/max). See the
    module docstring for storage and every deviation.
    """

    def __init__(self, config):
        initial = self._setup(config)
        d, b, seed = self.head_dim, self.bit_width_inlier, self.seed
        self.jl_dim = m = jl_width(config, d)
        self.sketch = from_store(
            self.store, f"qjl.sketch.m{m}.d{d}.seed{seed}", lambda: gaussian_jl(m, d, seed), (m, d)
        )
        self._keys = RowStore({"signs": ((packed_words(m, 1),), mx.uint32), "norm": ((), mx.float16)}, initial)
        self._values = RowStore(
            {"vcodes": ((gq.words_per_group(b, d),), mx.uint32), "vscale": ((), mx.float16),
             "vmin": ((), mx.float16)},
            initial,
        )

    def _state_arrays(self) -> list:
        return [self.sketch]  # the m x d float32 JL matrix

    # ---- keys ------------------------------------------------------------------------------------

    def append_key(self, k) -> None:
        k, _ = as_block(k, self.head_dim, "key")
        if k.shape[0] == 0:
            return
        check_norm16(k, "key")
        self._keys.append({
            "signs": pack_bits((k @ self.sketch.T) >= 0, 1),
            "norm": mx.sqrt(mx.sum(k * k, axis=1)).astype(mx.float16),
        })

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

    # ---- values ----------------------------------------------------------------------------------

    def append_value(self, v) -> None:
        v, _ = as_block(v, self.head_dim, "value")
        if v.shape[0] == 0:
            return
        # the shared group quantizer (one group = the whole row) keeps its scale and minimum in float16
        if mx.max(mx.abs(v)).item() > FP16_MAX or mx.max(mx.max(v, axis=1) - mx.min(v, axis=1)).item() > FP16_MAX:
            raise CacheInputError(f"value entries or their range exceed the float16 range ({FP16_MAX})")
        codes, scale, lo = gq.quantize(v, self.bit_width_inlier, self.head_dim, reference=True)
        self._values.append({"vcodes": codes, "vscale": scale[:, 0], "vmin": lo[:, 0]})

    def _decoded_values(self, n: int) -> mx.array:
        scale, lo = self._values.view("vscale")[:n, None], self._values.view("vmin")[:n, None]
        return gq.dequantize(self._values.view("vcodes")[:n], scale, lo, self.bit_width_inlier, self.head_dim)

    def reconstruct_values(self) -> mx.array:
        """``(n_values, d)`` float32 decoded values ``min + code * scale``."""
        return self._decoded_values(self._values.n)

    def _attend_values(self, w: mx.array, n: int) -> mx.array:
        return w @ self._decoded_values(n)
