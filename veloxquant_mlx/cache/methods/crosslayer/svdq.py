"""SVDq (Hong, Li, Zhen, Yu, Liu, Yuan, "SVDq: 1.25-bit and 410x Key Cache Compression for LLM Attention", arXiv
2502.15304), on ``LowRankKVCache`` (``cache/lowrank.py``). Keys are stored in their SVD basis, ``K = (K V) Vᵀ``,
the latent channels with a decreasing bit schedule (the tail dropped); attention uses ``(q V)·(K V)ᵀ``. ``V`` is
fitted once per (batch, head) on the first block of whole ``svdq_group_size`` (G) token groups (rank ``svdq_rank``
or the smallest holding ``svdq_energy_threshold`` of the energy in every head); with S entries of
``svdq_bit_schedule`` channel c gets ``b[c*S // D]``, channels past the rank none. Values are KIVI's; the newest <
G tokens stay float16.

Deviations: the basis is fitted on the prompt's first block of post-RoPE keys (the paper: the whole prefill per
sequence); the schedule is spread in S equal segments over D (the paper: explicit per-block widths); per-channel
min/max over G-token groups is the quantizer; no sparsity (the paper's ShadowKV combination); values by KIVI;
KIVI's trims (exact or ``ValueError``; emptying the quantized part resets the basis).
"""

from __future__ import annotations

from ...base import register
from ...contract import register_with_mlx_lm
from ...lowrank import LowRankKVCache
from ...primitives import lowrank_fit as lr


@register_with_mlx_lm
@register("svdq")
class SVDqKVCache(LowRankKVCache):
    """SVDq: keys as SVD latents with a decreasing per-channel bit schedule; values as KIVI."""
    chunk_invariant, exact_trim = False, False  # basis fit on the first block; raises past a group
    array_fields = ("k_basis", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases",
                    "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "k_bits", "hg", "fit_rank", "calib_end")
    latent_values = False
    fit_rank = 0  # rank picked at the fit (svdq_rank or the energy threshold), before the schedule
    center = False
    k_mean = v_mean = k_raw = v_basis = v_raw = None

    def _init_layout(self):
        super()._init_layout()  # KIVI: bit_width_inlier (values) and the residual
        o = self.config.options
        self.group = int(o.group_size)
        self.schedule = tuple(int(b) for b in o.bit_schedule)

    def _choose_bits(self, which, z, energy):
        F, o, S = energy.shape[-1], self.config.options, len(self.schedule)
        r = min(o.rank if o.rank is not None else lr.energy_rank(energy, o.energy_threshold), F)
        self.fit_rank = int(r)
        return [self.schedule[ch * S // F] if ch < r else 0 for ch in range(F)]
