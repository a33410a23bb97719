"""KV cache transform coding (KVTC; Staniszewski, Łańcucki, "KV Cache Transform Coding for Compact
Storage in LLM Inference", arXiv 2511.01815): classic transform coding applied to the KV cache —
a PCA decorrelating transform, an adaptive quantizer whose bits per component come from a
dynamic-programming rate allocation, (entropy coding).

This implementation (``kvtc_bit_budget`` R bits per token vector, ``kvtc_bit_choices``,
``kvtc_beta`` β, token group G = ``kivi_group_size``):

* Token vector = one token's keys (resp. values) of *all* KV heads of the layer concatenated
  (F = H·D components); keys and values are coded separately, each under the budget R.
* Transform: PCA (mean-centered eigenbasis) fitted at prefill, once per prompt, on the first block of
  whole token groups, per batch element (``lowrank_fit.fit_basis``).
* Rate allocation: on the fit block, the squared error of every component at every bit width in
  ``kvtc_bit_choices`` is *measured* with the actual quantizer (0 bits = the component's energy), and
  ``lowrank_fit.dp_allocate`` solves min Σ_c D_c(b_c) + λ Σ_c R(b_c) subject to Σ_c R(b_c) <= R,
  exactly (dynamic programming over the budget in steps of 1/G bit). The rate counts the side
  information honestly: R(b) = b + 32/G bits for b > 0 (a float16 scale and bias per component per G
  tokens), R(0) = 0. β sets the rate-distortion slope λ = 10^-β in units of the *average component's*
  energy (distortion normalised by the block energy, λ = 10^-β / F): a bit is spent only if it
  removes at least 10^-β of an average component's energy. β = 3.5 spends (nearly) the whole budget
  and only refuses bits for components that are pure noise; small β (e.g. 1) trades budget for
  nothing where the spectrum is flat. (Normalising by the total energy instead left 10-45% of the
  budget unspent on SmolLM2 at β = 3.5 and cost quality.)
* Short chats (``DeferredStart``): rows stay float16 until the compressed form -- bases bounded by
  the budget (at most R / (cheapest width's rate) components) plus R bits per token and side -- is
  smaller than the float16 rows (``start_rows``, a multiple of G; e.g. 256 rows on SmolLM2 at the
  defaults). The fit block is the complete groups stored then. A budget that never pays (R >= 16 bits
  per component) never compresses.
* Components with b > 0 are stored per channel over groups of G tokens (``groupquant`` codes packed
  in uint32 words); b = 0 components are dropped. Attention folds the inverse transform into the query
  and output sides (``LowRankKVCache``); newest < G tokens stay float16 (KIVI residual).

Deviations: the paper calibrates the PCA offline on a calibration set, over the keys (resp. values)
of *all layers and heads* concatenated with the positional rotation removed, keeps the 4 oldest
(sink) and 128 newest tokens uncompressed, and entropy-codes the quantized symbols (DEFLATE); here
the transform is per layer (across its heads), on post-RoPE rows (mlx_lm hands the cache rotated
keys), and is fitted on the prompt's first block; there is no
entropy coding (fixed-width codes, so the budget is met by the stored bytes themselves); the
quantizer is per-component min/max over G-token groups rather than a fixed per-component scale; only
the newest < G tokens stay uncompressed (KIVI residual; no sink protection). The float16 basis
(F x kept components per layer, K and V) is a per-prompt fixed cost counted in ``nbytes``: at 543
tokens on SmolLM2 (F = 192) it is most of the bytes; it amortises over long contexts. A first block of n < F rows spans at
most n - 1 centered directions: the others get a prior distortion (the weakest observed component's
energy) in the allocation, so later tokens' energy there is still coded when the budget allows.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import lowrank_fit as lr
from ..deferred_start import DeferredStart
from .svdq import LowRankKVCache


def side_bits(group: int) -> float:
    """Side information per kept component per token: float16 scale + bias per ``group`` tokens."""
    return 32.0 / group


@register_with_mlx_lm
@register("kvtc")
class KVTCKVCache(DeferredStart, LowRankKVCache):
    """KVTC: PCA transform + DP bit allocation under a per-token bit budget, keys and values."""
    chunk_invariant = False  # PCA basis and bit allocation fitted on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    center = True
    latent_values = True

    def _init_layout(self):
        o = self.config.options  # validation checked the types, the budget and kivi_group_size
        ch = o.bit_choices
        if any(not 0 <= b <= 8 for b in ch) or 0 not in ch or len(set(ch)) != len(ch) or len(ch) < 2:
            raise QuantizerConfigError("kvtc_bit_choices", ch, "distinct ints in 0..8 including 0 and one > 0")
        if not o.beta > 0:
            raise QuantizerConfigError("kvtc_beta", o.beta, "a positive finite float (lambda = 10**-beta; large beta = pure budget DP)")
        self.group = self.config.kivi_group_size
        self.choices = tuple(sorted(int(b) for b in ch))
        self.qbits = max(self.choices)
        self._call = None

    def _n_groups(self, n_heads: int) -> int:
        return 1

    def _compressed_cost(self, H, D, Dv):
        """At most: float16 bases (F x r, r <= the budget over the cheapest kept width) and means of
        both sides, and the budget's bits per token per side (``DeferredStart``)."""
        R = self.config.options.bit_budget
        r_max = R // min(self.rate(b) for b in self.choices if b)
        fixed = sum((F * min(F, r_max) + F) * 2 for F in (H * D, H * Dv))
        return fixed, 2 * R / 8

    def rate(self, b: int) -> float:
        return b + side_bits(self.group) if b else 0.0

    def distortion_table(self, z: mx.array) -> np.ndarray:
        """Squared error [F, K] of each component at each choice, normalised by the block energy:
        measured with the actual quantizer on the fit block. Components with no energy in the block
        (a block of n rows spans at most n - 1 centered directions) get a prior instead of 0: the
        weakest observed component's energy times the quantizer's average relative distortion at
        each width, so later tokens' energy in those directions is not dropped for free."""
        d = np.asarray(lr.measure_distortion(z, self.choices, self.group)).astype(np.float64)
        e0 = d[:, self.choices.index(0)]
        total = max(e0.sum(), 1e-30)
        null = e0 <= 1e-7 * total
        if null.any() and not null.all():
            seen = d[~null]
            rel = seen.sum(axis=0) / seen[:, self.choices.index(0)].sum()  # [K], 1 at 0 bits
            d[null] = e0[~null].min() * rel[None]
        return d / total

    def allocate(self, dist: np.ndarray) -> list:
        o = self.config.options
        lam = 10.0 ** (-float(o.beta)) / dist.shape[0]  # per average component
        return lr.dp_allocate(dist, self.choices, [self.rate(b) for b in self.choices],
                              float(o.bit_budget), lam=lam, unit=1.0 / self.group)

    def _choose_bits(self, which, z, energy):
        return self.allocate(self.distortion_table(z))

    def bits_per_token(self, which: str = "k") -> float:
        """Allocated rate of one token vector (codes + side information), <= kvtc_bit_budget."""
        return sum(self.rate(b) for b in getattr(self, f"{which}_bits") or ())
