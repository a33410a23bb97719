"""SVDq (Hong, Li, Zhen, Yu, Liu, Yuan, "SVDq: 1.25-bit and 410x Key Cache Compression for LLM
Attention", arXiv 2502.15304), and ``LowRankKVCache``, the latent-storage base shared with ``palu`` and
``kvtc``.

SVDq, as in the paper: the key matrix ``K`` [T, D] of a head is written in its SVD basis,
``K = (K V) Vᵀ``; the columns of ``K V`` are the *latent channels*, whose magnitudes decay with the
singular values. Latent channels are quantized per channel with a **decreasing bit schedule**: the
most significant channels get the most bits, the tail is dropped (0 bits). Attention uses
``q·Kᵀ = (q V)·(K V)ᵀ``.

This implementation (``svdq_rank`` r or ``svdq_energy_threshold`` e, ``svdq_bit_schedule``
(b_0 >= b_1 >= ... ), ``svdq_group_size`` G):

* **Fit once, at prefill, on the first block**: the first time whole groups of G tokens are stored
  (prefill: every complete group of the first chunk), the right singular vectors ``V`` [D, D] of that
  block's keys are computed per (batch, head) (eigendecomposition of ``KᵀK``, ``lowrank_fit``). The
  rank is ``svdq_rank`` or, when None, the smallest r whose leading components hold at least e of the
  block's key energy (``Σ σ_i²``) in every head. The basis is never refitted per decode step; later
  groups are projected onto it.
* **Bit schedule**: with S schedule entries and D latent channels, channel c gets ``b[c*S // D]``
  (the schedule is spread over the head dimension in S equal segments, as in the paper's
  per-segment allocation); channels >= r get 0 (dropped). Latent channel c of a group of G tokens is
  quantized with one float16 scale and bias (``groupquant``, bit widths 1..8, packed in uint32 words).
* **Values** are not part of SVDq (a key-cache method): they are quantized as KIVI does (per token,
  ``bit_width_inlier`` bits in {2, 3, 4, 8}, channel groups of gcd(D, G)).
* Residual: the newest < G tokens stay float16 (KIVI's residual; this class subclasses
  ``KIVIKVCache``), and a call's own rows are attended in full precision.
* ``attend`` (dispatch point) works on the latent codes: ``s = (q·V_r)·Zᵀ`` with ``Z`` the dequantized
  latents, one softmax over [latent part, full-precision part]; ``update_and_fetch`` returns the
  reconstructed keys ``Z V_rᵀ`` (same numbers up to float32 rounding).
* Bytes per token per head: ``Σ_c (b_c/8 + 4/G)`` over kept channels for keys, KIVI's for values,
  plus the basis ``D·r`` float16 per head per prompt. The group-indexed code buffers keep at most
  1/32 + 1 spare groups (``LowRankKVCache._encode``), so a 40-token chat holds no more than its float16
  rows plus ``contract.SHORT_PROMPT_SLACK_ROWS`` rows per layer (issue #13 item 20).

Deviations: the basis is fitted on the prompt's first block of the cache itself (the paper fits an
SVD of the prefill key cache too, but per sequence over the whole prefill; here later prefill chunks
reuse the first chunk's basis), from the post-RoPE keys mlx_lm hands the cache; the schedule is spread
in segments over D (the paper gives explicit per-channel-block widths); per-channel token groups of
G (KIVI-style min/max) are the quantizer; no sparsity (the paper's ShadowKV combination); values by
KIVI; residual/trim/prefill semantics as in ``KIVIKVCache`` (exact trims only; a trim that empties
the quantized part resets the basis so the next block refits it).
"""

from __future__ import annotations


from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...lowrank import BASIS_DTYPE, LowRankKVCache, _is_int, check_group, check_rank_energy  # noqa: F401 (re-exported)
from ...primitives import lowrank_fit as lr


@register_with_mlx_lm
@register("svdq")
class SVDqKVCache(LowRankKVCache):
    """SVDq: keys as SVD latents with a decreasing per-channel bit schedule; values as KIVI."""
    chunk_invariant = False  # key basis and rank fitted on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_basis", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases",
                    "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "k_bits", "hg", "fit_rank")
    latent_values = False
    fit_rank = 0  # rank picked at the fit (svdq_rank or the energy threshold), before the schedule
    center = False
    k_mean = v_mean = k_raw = v_basis = v_raw = None

    def _init_layout(self):
        super()._init_layout()  # KIVI: bit_width_inlier (values) and the residual
        o = self.config.options
        check_rank_energy("svdq", o.rank, o.energy_threshold)
        sched = o.bit_schedule
        if (not isinstance(sched, (tuple, list)) or not sched or any(not _is_int(b) or not 0 <= b <= 8 for b in sched)
                or list(sched) != sorted(sched, reverse=True) or sched[0] == 0):
            raise QuantizerConfigError("svdq_bit_schedule", sched,
                                       "a non-empty, non-increasing sequence of ints in 0..8 starting above 0")
        check_group("svdq_group_size", o.group_size)
        self.group = int(o.group_size)
        self.schedule = tuple(int(b) for b in sched)

    def _choose_bits(self, which, z, energy):
        F = energy.shape[-1]
        o = self.config.options
        r = o.rank if o.rank is not None else lr.energy_rank(energy, o.energy_threshold)
        r = min(r, F)
        self.fit_rank = int(r)
        S = len(self.schedule)
        return [self.schedule[ch * S // F] if ch < r else 0 for ch in range(F)]
