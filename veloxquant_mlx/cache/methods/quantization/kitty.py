"""Kitty: mixed channel precision for KIVI-style keys (Xia et al., "Kitty: Accurate and Efficient 2-bit KV Cache
Quantization with Dynamic Channel-wise Precision Boost", arXiv 2511.18643): a few key channels carry most of the
magnitude, so boosting a small fraction of them to 4 bits recovers near-4-bit accuracy at close to 2-bit memory.

On KIVI's layout: on the first quantized block each KV head ranks its key channels by mean |k|; the
``round(kitty_hi_fraction * D)`` largest (at least 1 for a fraction > 0) are its *hi* channels for the cache's
lifetime (``k_perm`` [H, D]: hi first, then lo, each ascending; ``k_inv`` its inverse). Keys per channel over
G = ``kitty_group_size`` tokens: hi rows of K^T at ``kitty_hi_bit`` bits (``kh_*``), the rest at
``kitty_lo_bit`` (``kl_*``), two uniform tensors as the paper's pages; values per token at ``kitty_lo_bit``.

Deviations from the paper: static channel selection by magnitude from the first block (the paper ranks per page
by sensitivity); no full-precision initial tokens (``kivi_sink`` does that for KIVI); attention dequantizes
(the hi/lo split is not one ``quantized_matmul`` layout), except a CPU decode step, which reads the codes in KIVI's CPU
kernel (the hi channels as its second key store, at 2, 4 or 8 bits); KIVI's own deviations.
"""

from __future__ import annotations

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import groupquant as gq
from ...window import Partials
from .kivi import KIVIKVCache
from .skvq import permute_channels


@register_with_mlx_lm
@register("kitty")
class KittyKVCache(KIVIKVCache):
    """KIVI layout with the most important key channels at ``kitty_hi_bit`` and the rest at ``kitty_lo_bit``."""
    chunk_invariant = False  # hi/lo key channels ranked on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group
    array_fields = ("kh_codes", "kh_scales", "kh_biases", "kl_codes", "kl_scales", "kl_biases",
                    "v_codes", "v_scales", "v_biases", "res_k", "res_v", "k_perm", "k_inv")
    scalar_fields = KIVIKVCache.scalar_fields + ("calib_end",)
    calib_end = 0  # encoded tokens the channel ranking was made from (0: none ranked)
    calib_field, refit_fields = "calib_end", ("k_perm", "k_inv")  # emptied codes: rank again, as a fresh cache
    dequant_only = "two key widths"

    def _init_layout(self):
        o = self.config.options
        self.hi_bit, self.lo_bit, self.hi_fraction, self.group = o.hi_bit, o.lo_bit, float(o.hi_fraction), o.group_size
        self.qbits = self.lo_bit  # values (KIVI's per-token path) use the low width

    def n_hi(self, d: int) -> int:
        return 0 if self.hi_fraction <= 0 else min(d, max(1, round(self.hi_fraction * d)))

    def _calibrate(self, kb: mx.array) -> None:
        D = kb.shape[-1]
        mag = mx.abs(kb.astype(mx.float32)).mean(axis=(0, 2))  # [H, D]
        rank = mx.argsort(mx.argsort(-mag, axis=-1), axis=-1)  # 0 = largest magnitude
        hi_mask = rank < self.n_hi(D)
        ch = mx.arange(D)[None]
        # hi channels first, then lo, each ascending (unique sort keys)
        self.k_perm = mx.argsort(mx.where(hi_mask, ch, ch + D), axis=-1).astype(mx.int32)
        self.k_inv = mx.argsort(self.k_perm, axis=-1).astype(mx.int32)

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        G, t0, n = self.group, self.n_quant, kb.shape[2]
        if self.k_perm is None:
            self._calibrate(kb)
            self.calib_end = t0 + n
        nh = self.n_hi(kb.shape[-1])
        kt = kb.swapaxes(-1, -2)  # [B, H, D, n]
        perm = mx.broadcast_to(self.k_perm[None, :, :, None], kt.shape)
        kt = mx.take_along_axis(kt, perm, axis=2)  # hi rows first
        keys = [(pre, gq.quantize(rows, bits, G), gq.words_per_group(bits, G))
                for pre, rows, bits in (("kh", kt[:, :, :nh], self.hi_bit), ("kl", kt[:, :, nh:], self.lo_bit))
                if rows.shape[2]]
        self._append_codes(t0, None, gq.quantize(vb, self.lo_bit, self.value_group(vb.shape[-1])), keys=keys)
        self.n_quant = t0 + n

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        G, g = self.group, n // self.group
        parts = []
        for p, b in (("kh", self.hi_bit), ("kl", self.lo_bit)):
            if getattr(self, f"{p}_codes") is not None:  # None: no channel at that width
                per = (gq.words_per_group(b, G), 1, 1)
                q = (getattr(self, f"{p}_{a}")[..., : g * w] for a, w in zip(("codes", "scales", "biases"), per))
                parts.append(gq.dequantize(*q, b, G, dtype))
        kt = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)  # permuted rows
        inv = mx.broadcast_to(self.k_inv[None, :, :, None], kt.shape)
        return mx.take_along_axis(kt, inv, axis=2)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel with the hi channels as a second key store

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        return self.hi_bit in (2, 4, 8) and self.n_hi(d) < d and super()._cpu_codes_fit(d, dv, rep)

    def _cpu_part(self, qf, n: int, counts=()):
        """The first ``n`` quantized tokens by KIVI's CPU kernel: the low-width key store as its keys, the hi store as
        the kernel's second key store, the queries' channels in the same hi-then-lo order (``k_perm``: a channel
        permutation shared by queries and keys leaves the scores unchanged)."""
        qp = permute_channels(qf, self.k_perm)
        dv = self.res_v.shape[-1]
        hi = [] if self.kh_codes is None else [self.kh_codes, self.kh_scales, self.kh_biases]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            qp, self.kl_codes, self.kl_scales, self.kl_biases, self.v_codes, self.v_scales, self.v_biases, n,
            self.lo_bit, self.group, self.value_group(dv), dv, hi=hi, hi_bits=self.hi_bit)
        return Partials(m, l, acc)

    def key_channel_bits(self) -> mx.array:
        """[H, D] bits of every key channel (in the original channel order)."""
        return mx.where(self.k_inv < self.n_hi(self.k_perm.shape[-1]), self.hi_bit, self.lo_bit)

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        """Hi/lo key codes, low-width value codes and the channel order; the base adds the residual."""
        G, nh = self.group, self.n_hi(D)
        key = B * H * (self.n_quant // G) * (nh * (4 * gq.words_per_group(self.hi_bit, G) + 4)
                                             + (D - nh) * (4 * gq.words_per_group(self.lo_bit, G) + 4))
        perm = 0 if self.k_perm is None else self.k_perm.nbytes + self.k_inv.nbytes
        return key + self._value_code_nbytes(B, H, dv) + perm

    def theoretical_bytes_per_token(self, d: int, dv: int) -> float:
        """Bytes per token per KV head of the quantized part (codes at their bit widths + fp16 scales/biases)."""
        nh = self.n_hi(d)
        key = (nh * self.hi_bit + (d - nh) * self.lo_bit) / 8 + 4 * d / self.group
        return key + self.lo_bit * dv / 8 + 4 * dv / self.value_group(dv)
