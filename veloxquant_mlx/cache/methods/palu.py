"""Palu (Chang, Lin, Lin, Chen, Huang, Hsu, Wu, Wu, Wang, Chen, Chiang, "Palu: Compressing KV-Cache
with Low-Rank Projection", arXiv 2407.21118).

Paper: the key and value projections are factored as ``W ≈ A B`` (SVD); the cache stores the
low-rank *latents* ``h = x A`` instead of K/V, and reconstructs ``K = h B`` on the fly. Group-head
low-rank decomposition (G-LRD) shares one factorization across a group of heads (a middle ground
between per-head M-LRD and all-heads J-LRD). The latents are quantized (low-bit, mixed precision).
Matrix fusion: the reconstruction matrix is folded into the query side, ``q·Kᵀ = (q Bᵀ)·hᵀ``, and for
values into the output side, so full K/V are never rebuilt in attention.

This implementation (``LowRankKVCache`` from ``svdq``; options ``palu_rank`` / ``palu_energy_threshold``,
``palu_n_head_groups``, ``palu_hi_bit`` / ``palu_lo_bit`` / ``palu_hi_fraction``, ``palu_group_size``,
``palu_quantize_values``):

* Head groups: the H KV heads are split into Hg groups of s = H/Hg consecutive heads; Hg is the
  largest divisor of H not above ``palu_n_head_groups`` (e.g. 3 KV heads and 4 requested -> 3 groups
  of one head). A group's token feature is its heads' rows concatenated (F = s·D).
* Projections fitted at prefill, once per prompt, on the first block of whole token groups: the
  principal directions (PCA, mean μ subtracted) of the block's keys, and separately of its values, per
  (batch, head group). Rank r = ``palu_rank`` or the smallest rank holding ``palu_energy_threshold`` of
  the block's (centered) energy in every group (keys and values each get their own rank).
* Latents ``h = (x - μ) P`` [T, r] are stored quantized per latent channel over groups of G tokens
  (float16 scale + bias): the first ``ceil(hi_fraction · r)`` channels (largest energy) at
  ``palu_hi_bit``, the rest at ``palu_lo_bit``; with ``palu_quantize_values=False`` the value latents
  are stored float16.
* ``attend`` folds the reconstruction: scores ``(q W_hᵀ)·hᵀ + q·μ_h`` with ``W_h`` the head's rows of
  the group basis (GQA queries of all heads of a group multiply the group's latents in one matmul);
  output ``(p h_v) W_v,hᵀ + (Σp) μ_v,h``. Equal to reconstruct-then-attend (tested).
* The newest < G tokens stay float16 (KIVI residual), a call's own rows are attended in full
  precision; ``update_and_fetch`` returns the reconstructed rows for the non-dispatch path.

Deviations: Palu factors the projection *weights* offline with calibration data (and Fisher-guided
rank search); here the projections are fitted on the prompt's own cache rows at prefill (no weights,
no calibration set), on post-RoPE keys (Palu reconstructs pre-RoPE keys and applies RoPE in a fused
kernel; mlx_lm hands caches rotated keys), with mean-centering; one rank for all groups of a layer;
the latent quantizer is per-channel min/max over token groups (Palu: per-token quantization after a
Walsh-Hadamard rotation) with the mixed hi/lo split by energy; no Fisher-based rank allocation across
layers. ``projection_bytes`` counts the bases and means actually held, stored float16 (the
system this API comes from kept float32: twice the fixed per-prompt cost for no measurable gain).
"""

from __future__ import annotations

import math

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives import lowrank_fit as lr
from .svdq import LowRankKVCache, _is_int, check_group, check_rank_energy


@register_with_mlx_lm
@register("palu")
class PALUKVCache(LowRankKVCache):
    """Palu: group-head low-rank latents (keys and values), mixed-bit, matrix-fused attention."""
    chunk_invariant = False  # projections and ranks fitted on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    center = True
    latent_values = True

    def _init_layout(self):
        c = self.config
        check_rank_energy("palu", c.palu_rank, c.palu_energy_threshold)
        if not _is_int(c.palu_n_head_groups) or c.palu_n_head_groups < 1:
            raise QuantizerConfigError("palu_n_head_groups", c.palu_n_head_groups, "a positive int")
        for f in ("palu_hi_bit", "palu_lo_bit"):
            b = getattr(c, f)
            if not _is_int(b) or not 1 <= b <= 8:
                raise QuantizerConfigError(f, b, "an int in 1..8")
        if c.palu_lo_bit > c.palu_hi_bit:
            raise QuantizerConfigError("palu_lo_bit", c.palu_lo_bit, f"<= palu_hi_bit ({c.palu_hi_bit})")
        hf = c.palu_hi_fraction
        if isinstance(hf, bool) or not isinstance(hf, (int, float)) or not 0.0 <= hf <= 1.0:
            raise QuantizerConfigError("palu_hi_fraction", hf, "a float in [0, 1]")
        if not isinstance(c.palu_quantize_values, bool):
            raise QuantizerConfigError("palu_quantize_values", c.palu_quantize_values, "a bool")
        check_group("palu_group_size", c.palu_group_size)
        self.group = int(c.palu_group_size)
        self.qbits = int(c.palu_hi_bit)
        self._call = None

    def _n_groups(self, n_heads: int) -> int:
        want = min(self.config.palu_n_head_groups, n_heads)
        return max(d for d in range(1, want + 1) if n_heads % d == 0)

    def _choose_bits(self, which, z, energy):
        c = self.config
        F = energy.shape[-1]
        r = c.palu_rank if c.palu_rank is not None else lr.energy_rank(energy, c.palu_energy_threshold)
        r = min(int(r), F, z.shape[2])  # no more directions than fit rows
        if which == "v" and not c.palu_quantize_values:
            return [lr.FLOAT_BITS] * r + [0] * (F - r)
        n_hi = min(r, math.ceil(r * c.palu_hi_fraction))
        return [c.palu_hi_bit] * n_hi + [c.palu_lo_bit] * (r - n_hi) + [0] * (F - r)

    @property
    def head_groups(self) -> int:
        return self.hg
