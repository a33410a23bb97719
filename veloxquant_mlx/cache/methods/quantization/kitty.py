"""Kitty: mixed channel precision for KIVI-style keys (Xia et al., "Kitty: Accurate and Efficient 2-bit KV
Cache Quantization with Dynamic Channel-wise Precision Boost", arXiv 2511.18643).

Observation (paper): 2-bit per-channel key quantization (KIVI) loses accuracy because a few key
channels carry most of the magnitude; keeping a small fraction of key channels at 4 bits ("channel-wise
precision boost") recovers near-4-bit accuracy at close to 2-bit memory. The paper stores each
mixed-precision key page as two uniform tensors (the boosted channels and the rest).

This implementation (a ``KIVIKVCache`` subclass: float16 residual of < G tokens, one-softmax attention
over [quantized part, full-precision part], see ``kivi.py``):

* Calibration: on the first block of tokens that is quantized (the first complete key groups: the
  prompt's, in practice), each KV head ranks its key channels by mean absolute value over the block's
  tokens (and batch rows); the ``kitty_hi_fraction`` * D (rounded, at least 1 when the fraction is
  > 0) largest are the head's *hi* channels, kept for the cache's lifetime (``k_perm`` [H, D]: hi
  channels first, then lo, each ascending; ``k_inv`` its inverse permutation).
* Keys, per channel in groups of ``kitty_group_size`` = G tokens (KIVI): the hi channels' rows of
  K^T at ``kitty_hi_bit`` bits (``kh_codes``/``kh_scales``/``kh_biases``), the others at
  ``kitty_lo_bit`` bits (``kl_*``): two uniform tensors, as in the paper.
* Values per token (KIVI), at ``kitty_lo_bit`` bits, channel groups of gcd(Dv, G).
* Bytes per token per KV head: keys ``(Dh*hi + Dl*lo)/8 + 4*D/G``, values ``lo*Dv/8 + 4*Dv/gcd(Dv,G)``
  (+ the G-row float16 residual and the 2 int32 [H, D] permutations, a constant).

Deviations from the paper:

* Static channel selection from the calibration block (the paper ranks channels per page,
  dynamically, by sensitivity); magnitude (mean |k|) is the ranking score.
* No full-precision initial tokens (the paper keeps them; ``kivi_sink`` does that for plain KIVI).
* Attention dequantizes and multiplies (``_uses_qmm`` is False: the hi/lo split is not one MLX
  ``quantized_matmul`` layout).
* KIVI's deviations (residual length = G, float16 residual, quantize after the step's attention).

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 511 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs mlx_lm's plain cache; kv_bytes = bytes held / fp16 cache):
defaults (25% of key channels at 4 bits, the rest and values at 2, G = 32): KL 0.062 (top-1 0.94),
kv_bytes 0.259; plain KIVI 2 bits: 0.206, 0.241.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_rows
from ...primitives import groupquant as gq
from .kivi import KIVIKVCache
from ...primitives.buffers import grow_columns


@register_with_mlx_lm
@register("kitty")
class KittyKVCache(KIVIKVCache):
    """KIVI layout with the most important key channels at ``kitty_hi_bit`` and the rest at ``kitty_lo_bit``."""
    chunk_invariant = False  # hi/lo key channels ranked on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("kh_codes", "kh_scales", "kh_biases", "kl_codes", "kl_scales", "kl_biases",
                    "v_codes", "v_scales", "v_biases", "res_k", "res_v", "k_perm", "k_inv")

    def _init_layout(self):
        o = self.config.options  # validation checked the widths (1..8), the fraction and the group
        if o.hi_bit < o.lo_bit:
            raise QuantizerConfigError("kitty_hi_bit", o.hi_bit, f"an int >= kitty_lo_bit={o.lo_bit}")
        self.hi_bit, self.lo_bit, self.hi_fraction = o.hi_bit, o.lo_bit, float(o.hi_fraction)
        self.group = o.group_size
        self.qbits = self.lo_bit  # values (KIVI's per-token path) use the low width
        self._call = None

    def n_hi(self, d: int) -> int:
        """Hi channels for head dim ``d``: round(fraction * d), at least 1 if the fraction is > 0."""
        if self.hi_fraction <= 0:
            return 0
        return min(d, max(1, round(self.hi_fraction * d)))

    dequant_only = "two key widths"

    # ---------------------------------------------------------------- storage
    def _calibrate(self, kb: mx.array) -> None:
        D = kb.shape[-1]
        mag = mx.abs(kb.astype(mx.float32)).mean(axis=(0, 2))  # [H, D]
        nh = self.n_hi(D)
        order = mx.argsort(-mag, axis=-1)  # channels, largest magnitude first
        hi_mask = mx.zeros(mag.shape, dtype=mx.bool_)
        if nh:
            hi_mask = mx.put_along_axis(hi_mask, order[:, :nh], mx.array(True), axis=-1)
        ch = mx.arange(D)[None]
        # hi channels first, then lo, each ascending (unique sort keys)
        self.k_perm = mx.argsort(mx.where(hi_mask, ch, ch + D), axis=-1).astype(mx.int32)
        self.k_inv = mx.argsort(self.k_perm, axis=-1).astype(mx.int32)

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        G = self.group
        t0, n = self.n_quant, kb.shape[2]
        if self.k_perm is None:
            self._calibrate(kb)
        D = kb.shape[-1]
        nh = self.n_hi(D)
        kt = kb.swapaxes(-1, -2)  # [B, H, D, n]
        perm = mx.broadcast_to(self.k_perm[None, :, :, None], kt.shape)
        kt = mx.take_along_axis(kt, perm, axis=2)  # hi rows first
        vq = gq.quantize(vb, self.lo_bit, self.value_group(vb.shape[-1]))
        self.v_codes = grow_rows(self.v_codes, t0, vq.codes)
        self.v_scales = grow_rows(self.v_scales, t0, vq.scales)
        self.v_biases = grow_rows(self.v_biases, t0, vq.biases)
        cap = self.v_codes.shape[2] // G
        g0 = t0 // G
        for pre, rows, bits in (("kh", kt[:, :, :nh], self.hi_bit), ("kl", kt[:, :, nh:], self.lo_bit)):
            if rows.shape[2] == 0:
                continue
            q = gq.quantize(rows, bits, G)
            w = gq.words_per_group(bits, G)
            setattr(self, f"{pre}_codes", grow_columns(getattr(self, f"{pre}_codes"), g0 * w, q.codes, cap * w))
            setattr(self, f"{pre}_scales", grow_columns(getattr(self, f"{pre}_scales"), g0, q.scales, cap))
            setattr(self, f"{pre}_biases", grow_columns(getattr(self, f"{pre}_biases"), g0, q.biases, cap))
        self.n_quant = t0 + n

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        g = n // self.group
        parts = []
        for pre, bits in (("kh", self.hi_bit), ("kl", self.lo_bit)):
            codes = getattr(self, f"{pre}_codes")
            if codes is None:
                continue
            w = gq.words_per_group(bits, self.group)
            parts.append(gq.dequantize(codes[..., : g * w], getattr(self, f"{pre}_scales")[..., :g],
                                       getattr(self, f"{pre}_biases")[..., :g], bits, self.group, dtype))
        kt = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)  # permuted rows
        inv = mx.broadcast_to(self.k_inv[None, :, :, None], kt.shape)
        return mx.take_along_axis(kt, inv, axis=2)

    def key_channel_bits(self) -> mx.array:
        """[H, D] bits of every key channel (in the original channel order)."""
        D = self.k_perm.shape[-1]
        nh = self.n_hi(D)
        return mx.where(self.k_inv < nh, self.hi_bit, self.lo_bit)

    # ---------------------------------------------------------------- accounting
    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        """Hi/lo key codes, low-width value codes and the channel order; the base adds the residual."""
        G = self.group
        nh = self.n_hi(D)
        groups = self.n_quant // G
        key = B * H * groups * (nh * (4 * gq.words_per_group(self.hi_bit, G) + 4)
                                + (D - nh) * (4 * gq.words_per_group(self.lo_bit, G) + 4))
        gv = self.value_group(dv)
        value = B * H * self.n_quant * (dv // gv) * (4 * gq.words_per_group(self.lo_bit, gv) + 4)
        perm = 0 if self.k_perm is None else self.k_perm.nbytes + self.k_inv.nbytes
        return key + value + perm

    def theoretical_bytes_per_token(self, d: int, dv: int) -> float:
        """Bytes per token per KV head of the quantized part (codes at their bit widths + fp16 scales/biases)."""
        nh = self.n_hi(d)
        key = (nh * self.hi_bit + (d - nh) * self.lo_bit) / 8 + 4 * d / self.group
        gv = self.value_group(dv)
        return key + self.lo_bit * dv / 8 + 4 * dv / gv
