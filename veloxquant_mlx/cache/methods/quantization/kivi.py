"""KIVI (Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024, arXiv 2402.02750).

Keys have a few fixed outlier channels, values do not (paper, section 3): keys are quantized per channel over
groups of G tokens, values per token in channel groups; tokens that do not yet fill a key group stay in a
full-precision residual. Algorithm 1: prefill attends in full precision, then stores the prompt's complete
groups quantized and the rest in the residual; a decode step appends to the residual, quantizes it when it
reaches its length, and attends with one softmax ``softmax([q·Q(K_g)ᵀ, q·K_rᵀ]) · [Q(V_g); V_r]``.

Here (``bit_width_inlier`` = b in {2, 3, 4, 8}, ``KIVIOptions.group_size`` = G) the cache is ``cache/grouped.py``'s
layout (storage, attention on the codes, the CUDA decode kernel ``cache.kernels.kivi``, the CPU one in
``cache/native`` at 2, 4 and 8 bits, trim, bytes), codes from
``primitives.groupquant``; a call's own rows are attended in full precision and only stored compressed. Decode
speed: docs/RESULTS.md ("Speed and memory"). ``nbytes``: the arrays held, spare capacity included
(``used_nbytes``: without).

Deviations from the paper (all deliberate):

* Residual length R = G (the paper: a separate R, a multiple of G): keys and values share one residual of
  0..G-1 tokens and leave it together, so the newest 0..G-1 values (not always the newest R) are float16.
* The residual is float16 (the paper: the model's precision), and quantization reads the float16 rows
  (float16 scales/biases whatever the compute dtype).
* A group completed by a decode step is quantized after that step's attention (the paper: before); prefill
  chunks after the first see the earlier chunks compressed (the paper: one full-precision pass).
* Value channel groups are ``gcd(Dv, G)`` wide when G does not divide the head dim.
* Trim is exact only for residual tokens and/or whole groups; one that would cut into a group raises
  ``ValueError`` instead of silently keeping lossy rows.
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys).
* Prefill chunks over a stored past attend the rows dequantized once per layer (MLX's fused attention; on the CPU
  in tiles of query rows, ``attention.dense_attention``), so a chunked prefill peaks below the plain cache; with
  ``attend_path="quantized_matmul"`` they are an online softmax over tiles of whole groups of codes.
* A CPU decode step through the CPU kernel (where built) sums each block of 64 tokens' exponentials (a degree-7
  polynomial, relative ~2e-7) into an online softmax in float32: the op path's function to float32 rounding.

Quality: docs/RESULTS.md (mlx_lm's QuantizedKVCache as reference). A call's own rows stay full precision: quantized
before its attention they raised the 2-bit decode KL from 0.21 to 0.49 (SmolLM2-135M, 480 tokens). Bytes per token
per KV head at D = 64: 80 (4 bits), 48 (2 bits) plus the G-row float16 residual, vs 256 for float16.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...grouped import KIVI_BITS, RES_DTYPE, GroupedQuantCache

__all__ = ["KIVIKVCache", "KIVI_BITS", "RES_DTYPE", "SideRows"]


@register_with_mlx_lm
@register("kivi")
class KIVIKVCache(GroupedQuantCache):
    """KIVI: keys per-channel, values per-token, b-bit groups of G, a residual of < G tokens in the rows' 2-byte
    dtype (float16 for float32 rows)."""

    residual_in_row_dtype = True  # this class only (``GroupedQuantCache._residual_dtype``)
    chunk_invariant = True  # groups of G at absolute positions, the rest in the residual
    exact_trim = False  # raises ValueError when the trimmed rows completed a quantized group
    batchable = True  # merge -> KIVIBatchKVCache (kivi_batch.py); variants keep raising BatchingNotSupported

    @classmethod
    def _merge_batch(cls, caches):
        from .kivi_batch import KIVIBatchKVCache
        return KIVIBatchKVCache.from_caches(caches)


class SideRows:
    """Mixin before ``KIVIKVCache``: ``_keys_t`` / ``_values`` of a variant whose ``_decode(side, n, dtype)``
    rebuilds side "k" or "v"'s first ``n`` quantized rows [B, H, n, D]."""

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return self._decode("k", n, dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        return self._decode("v", n, dtype)
