"""KIVI (Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024, arXiv 2402.02750).

Observation (paper, section 3): keys have a few fixed *outlier channels*, values do not; so keys are
quantized **per channel** (the elements of one channel over a group of tokens share a scale and zero
point) and values **per token** (the channels of one token, in groups, share them). Tokens that do
not yet fill a key group stay in a full-precision **residual** buffer. Algorithm 1 of the paper:

* prefill: attention over the prompt in full precision; then the prompt's complete key groups are
  quantized per channel, values per token, the remainder goes to the residual buffers;
* decode: the new token is appended to the residual; when the key residual reaches its length, it is
  quantized (one vectorized step) and appended to the quantized part; attention is
  ``softmax([q·Q(K_g)ᵀ, q·K_rᵀ]) · [Q(V_g); V_r]``, one softmax across both parts.

This implementation (``bit_width_inlier`` = b ∈ {2, 3, 4, 8}, ``KIVIOptions.group_size`` = G) is the
grouped-quantization layout of ``cache/grouped.py`` (storage, attention on the codes, trim, bytes):

* Codes/scales come from ``primitives.groupquant`` (``mx.quantize`` when (b, group) allows it, its
  reference kernel otherwise, e.g. for 16-channel heads).
* The new rows of a call are attended in full precision (as the paper's prefill does) and only stored
  compressed. On the CPU and on Metal attention uses ``mx.quantized_matmul`` on the codes when both
  layouts are MLX's (measured faster than dequantize + float32 matmul on the CPU); MLX's CUDA backend
  has no quantized_matmul kernel for these shapes, so it dequantizes (``attend_path`` overrides the
  choice; both paths are tested on the CPU), except for decode steps (one query row,
  ``attend_path="auto"``, b in {2, 4, 8}), which take the fused kernel of ``cache.kernels.kivi``
  (codes read once, split-K online softmax, merged with the residual and the own row; checked against
  the op path at first use). Measured on an H200 (``veloxquant bench --shape llama-8b
  --random-weights``, 2026-12-01, docs/data/h200_decode_kernels_2026-12-01.json): 0.67x the plain
  cache's decode speed at 8k and 0.58x at 32k (0.38x / 0.34x with the dequantize path).
* ``nbytes`` = bytes of the arrays held (codes, float16 scales/biases, residual buffers, including
  the buffers' spare capacity); ``used_nbytes`` leaves the spare capacity out.

Deviations from the paper (all deliberate):

* Residual length R = G (the paper uses a separate R, e.g. 128, a multiple of G): keys and values
  share one residual of 0..G-1 tokens, and both are quantized when G tokens complete a key group. The
  paper's value residual is a sliding window of exactly R tokens; here values leave the residual with
  their key group, so the newest 0..G-1 tokens (not always the newest R) are in float16.
* The residual is stored in float16 (the paper: the model's full precision). Quantization reads the
  float16 rows too (float16 scales/biases whatever the compute dtype).
* A group completed by a decode step is quantized *after* that step's attention (the step sees those
  G tokens as float16 residual rows plus its own row); the paper quantizes the group first. Prefill
  chunks after the first see the earlier chunks compressed (the paper's prefill is one
  full-precision pass over the prompt).
* Value channel groups are ``gcd(Dv, G)`` wide instead of G when G does not divide the head dim.
* Trim is exact only when it drops residual tokens and/or whole quantized groups (then the state is
  identical to never having seen those tokens); a trim that would cut into a quantized group raises
  ``ValueError`` instead of silently keeping lossy rows.
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys).
* GPU prefill chunks (N > 1, ``attend_path="auto"``) attend through the fused sdpa kernel over the
  lazily dequantized rows instead of the codes (same result; no [N, M] score matrix held). Elsewhere a
  prefill chunk over a stored past is one online softmax over tiles of whole groups
  (``attention.online_softmax_attention``): the paper's one softmax, computed without the [N, M]
  score matrix, so a chunked prefill peaks below the plain cache.

Measured (SmolLM2-135M float32 on the CPU, 480 essay tokens prefilled in one chunk + 32
teacher-forced decode steps, G = 32, vs mlx_lm's plain KVCache): mean next-token KL 0.012 at 4 bits,
0.21 at 2 bits (mlx_lm's per-token QuantizedKVCache, group 32, after the same full-precision prefill:
0.065 / 1.27). Quantizing a call's own rows before its attention instead raises the 2-bit decode KL
to 0.49 (and the prompt's last-token KL from 0 to 2.1). Bytes per token per KV head at D = 64:
80 (4 bits) and 48 (2 bits) plus the 32-row float16 residual, vs 256 for float16.
"""

from __future__ import annotations

from ...base import register
from ...contract import register_with_mlx_lm
from ...grouped import KIVI_BITS, RES_DTYPE, GroupedQuantCache

__all__ = ["KIVIKVCache", "KIVI_BITS", "RES_DTYPE"]


@register_with_mlx_lm
@register("kivi")
class KIVIKVCache(GroupedQuantCache):
    """KIVI: keys per-channel, values per-token, b-bit groups of G, float16 residual of < G tokens."""
    chunk_invariant = True  # groups of G at absolute positions, the rest in the residual
    exact_trim = False  # raises ValueError when the trimmed rows completed a quantized group
    batchable = True  # merge -> KIVIBatchKVCache (kivi_batch.py); variants keep raising BatchingNotSupported

    @classmethod
    def _merge_batch(cls, caches):
        from .kivi_batch import KIVIBatchKVCache

        return KIVIBatchKVCache.from_caches(caches)
