"""KV cache transform coding (KVTC; Staniszewski, Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM
Inference", arXiv 2511.01815): PCA decorrelation, bits per component from a dynamic-programming rate allocation,
entropy coding. Here a token vector is one token's keys (resp. values) of all KV heads (F = H·D), each side under
``kvtc_bit_budget`` R bits. PCA is fitted once per prompt on the first block of whole G-token groups (G =
``kivi_group_size``); each component's error at each of ``kvtc_bit_choices`` is measured there with the real
quantizer and ``dp_allocate`` solves min Σ D_c(b_c) + λ Σ R(b_c) s.t. Σ R(b_c) <= R, with R(b) = b + 32/G (float16
scale and bias per G tokens), R(0) = 0 and λ = 10^-``kvtc_beta`` / F of the block energy (β = 3.5 spends nearly
all of R; normalising by the total energy left 10-45% unspent on SmolLM2 and cost quality). Rows stay float16
(``DeferredStart``) until bases plus R bits per token are smaller (256 rows on SmolLM2 at the defaults).

Deviations: the paper calibrates the PCA offline over all layers and heads (rotation removed), keeps 4 sink and 128
recent tokens uncompressed and entropy-codes (DEFLATE); here the transform is per layer on post-RoPE rows, fitted
on the first block, with fixed-width codes, per-component min/max over G tokens and only the newest < G tokens
uncompressed. The float16 bases are counted in ``nbytes``. Directions a short first block does not span get a
prior distortion (the weakest observed component's energy), so later tokens' energy there is still coded.
"""

from __future__ import annotations

import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...lowrank import LowRankKVCache
from ...primitives import lowrank_fit as lr
from ..deferred_start import DeferredStart


@register_with_mlx_lm
@register("kvtc")
class KVTCKVCache(DeferredStart, LowRankKVCache):
    """KVTC: PCA transform + DP bit allocation under a per-token bit budget, keys and values."""
    chunk_invariant, exact_trim = False, False  # PCA fit on the first block; raises past a group
    center = True
    latent_values = True

    def _init_layout(self):
        ch = self.config.options.bit_choices
        self.group, self.choices = self.config.kivi_group_size, tuple(sorted(int(b) for b in ch))
        self.qbits = max(self.choices)

    def _n_groups(self, n_heads: int) -> int:
        return 1

    def _compressed_cost(self, H, D, Dv):
        """At most: float16 bases (r <= budget / cheapest rate) and means of both sides; R bits per token."""
        R = self.config.options.bit_budget
        r_max = R // min(self.rate(b) for b in self.choices if b)
        fixed = sum((F * min(F, r_max) + F) * 2 for F in (H * D, H * Dv))
        return fixed, 2 * R / 8

    def rate(self, b: int) -> float:
        return b + 32.0 / self.group if b else 0.0  # side information: float16 scale + bias per G tokens

    def _choose_bits(self, which, z, energy):
        """The DP allocation on the measured squared error [F, K] of each component at each choice,
        normalised by the block energy; components with no energy in the block get a prior: the weakest
        observed component's energy times the quantizer's average relative distortion at each width."""
        d = np.asarray(lr.measure_distortion(z, self.choices, self.group)).astype(np.float64)
        e0 = d[:, self.choices.index(0)]
        total = max(e0.sum(), 1e-30)
        null = e0 <= 1e-7 * total
        if null.any() and not null.all():
            d[null] = e0[~null].min() * (d[~null].sum(axis=0) / e0[~null].sum())[None]  # ratio: 1 at 0 bits
        o = self.config.options
        lam = 10.0 ** (-float(o.beta)) / d.shape[0]  # per average component
        return lr.dp_allocate(d / total, self.choices, [self.rate(b) for b in self.choices],
                              float(o.bit_budget), lam=lam, unit=1.0 / self.group)

    def bits_per_token(self, which: str = "k") -> float:
        """Allocated rate of one token vector (codes + side information), <= kvtc_bit_budget."""
        return sum(self.rate(b) for b in getattr(self, f"{which}_bits") or ())
