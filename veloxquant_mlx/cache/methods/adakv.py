"""AdaKV-style adaptive per-token bit allocation (mixed precision at a target average bit width).

Within every G-token group (G = ``adakv_group_size``) of every (batch, head), tokens are ranked by an
importance score (``adakv_importance``: ``"norm"`` = ‖k‖₂, ``"norm_variance"`` = key-entry variance ×
(1 + value-entry variance), ``primitives.nonuniform``); the top ``n_hi`` get ``adakv_hi_bit``, the next
``n_mid`` ``adakv_mid_bit``, the rest ``adakv_lo_bit``, with the counts fixed per group so the realized
average is the target (``adakv_target_avg_bits``) up to whole tokens (|error| ≤ (hi − lo) / 2G).

Storage (a ``KIVIKVCache`` subclass: same full-precision residual of < G tokens, same
``update_and_fetch``/``attend``): per tier, keys and values quantized **per token** (channel groups of
gcd(D, 32), float16 scale/bias per group) at the tier's width, in arrays of exactly the tier's rows
(``{k,v}_codes_{hi,mid,lo}``, ...), plus the within-group rank order ``order`` (uint8 per token) that
puts the tiers' rows back in token order. Mixed widths are real: every tier's codes are packed at its
own bit width.

Deviations: keys are quantized per token (per-token bit widths do not combine with KIVI's per-channel
key groups); importance is computed from the block's own keys/values when the group is quantized
(``"attention"`` importance from queries is not implemented and is rejected); ``adakv_update_interval``
and ``adakv_obs_window`` are not used (no re-allocation after a group is stored); keys post-RoPE.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_rows
from ..primitives import groupquant as gq
from ..primitives import nonuniform as sal
from .kivi import KIVIKVCache

TIERS = ("hi", "mid", "lo")
CG = 32  # channel group of the per-token quantization (gcd with the head dim)


@register_with_mlx_lm
@register("adakv")
class AdaKVKVCache(KIVIKVCache):
    """Per-token hi/mid/lo bit widths by importance, at a target average."""
    chunk_invariant = True  # per-group tiers, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = tuple(f"{s}_{a}_{t}" for t in TIERS for s in "kv" for a in ("codes", "scales", "biases")) + (
        "order", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name")

    def _init_layout(self):
        c = self.config
        lo, mid, hi, t = c.adakv_lo_bit, c.adakv_mid_bit, c.adakv_hi_bit, c.adakv_target_avg_bits
        for name, b in (("adakv_lo_bit", lo), ("adakv_mid_bit", mid), ("adakv_hi_bit", hi)):
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
                raise QuantizerConfigError(name, b, "an int in 1..8")
        if not lo < mid < hi:
            raise QuantizerConfigError("adakv_mid_bit", mid, f"strictly between adakv_lo_bit={lo} and adakv_hi_bit={hi}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not lo <= t <= hi:
            raise QuantizerConfigError("adakv_target_avg_bits", t, f"a number in [{lo}, {hi}]")
        G = c.adakv_group_size
        if isinstance(G, bool) or not isinstance(G, int) or not 2 <= G <= 256:
            raise QuantizerConfigError("adakv_group_size", G, "an int in 2..256")
        if c.adakv_importance not in ("norm", "norm_variance"):
            raise QuantizerConfigError("adakv_importance", c.adakv_importance,
                                       "'norm' or 'norm_variance' ('attention' is not implemented)")
        self.group = G
        self.tier_bits = {"hi": hi, "mid": mid, "lo": lo}
        n_hi, n_mid, n_lo = sal.tier_counts(float(t), lo, mid, hi, G)
        self.counts = {"hi": n_hi, "mid": n_mid, "lo": n_lo}
        self.qbits = hi
        self._call = None

    def _uses_qmm(self) -> bool:
        return False

    @property
    def realized_avg_bits(self) -> float:
        """Average code bits per stored element (the allocation, excluding scale/bias overhead)."""
        return sum(self.tier_bits[t] * self.counts[t] for t in TIERS) / self.group

    def _cg(self, d):
        return math.gcd(d, CG)

    # ---------------------------------------------------------------- encode
    def _append_groups(self, kb, vb):
        G = self.group
        B, H, n, D = kb.shape
        Dv = vb.shape[-1]
        g, t0 = n // G, self.n_quant
        imp = sal.token_importance(kb, vb, self.config.adakv_importance).reshape(B, H, g, G)
        order = mx.argsort(-imp, axis=-1)  # token positions by decreasing importance
        ks = mx.take_along_axis(kb.reshape(B, H, g, G, D), order[..., None], axis=3)
        vs = mx.take_along_axis(vb.reshape(B, H, g, G, Dv), order[..., None], axis=3)
        start = 0
        for t in TIERS:
            c, b = self.counts[t], self.tier_bits[t]
            if c:
                r0 = (t0 // G) * c
                for side, x, d in (("k", ks, D), ("v", vs, Dv)):
                    q = gq.quantize(x[:, :, :, start : start + c].reshape(B, H, g * c, d), b, self._cg(d))
                    for a, arr in zip(("codes", "scales", "biases"), q):
                        name = f"{side}_{a}_{t}"
                        setattr(self, name, grow_rows(getattr(self, name), r0, arr))
            start += c
        self.order = grow_rows(self.order, t0, order.reshape(B, H, n).astype(mx.uint8))
        self.n_quant = t0 + n

    # ---------------------------------------------------------------- decode
    def _rows_of(self, side: str, n: int, d: int) -> mx.array:
        G = self.group
        g = n // G
        parts = []
        for t in TIERS:
            c = self.counts[t]
            if c:
                a = [getattr(self, f"{side}_{x}_{t}")[:, :, : g * c] for x in ("codes", "scales", "biases")]
                x = gq.dequantize(*a, self.tier_bits[t], self._cg(d), mx.float32)
                parts.append(x.reshape(x.shape[0], x.shape[1], g, c, d))
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=3)  # [B, H, g, G, d] in rank order
        order = self.order[:, :, :n].astype(mx.int32).reshape(x.shape[0], x.shape[1], g, G)
        inv = mx.argsort(order, axis=-1)
        return mx.take_along_axis(x, inv[..., None], axis=3).reshape(x.shape[0], x.shape[1], n, d)

    def _keys_t(self, n, dtype=mx.float32):
        return self._rows_of("k", n, self.res_k.shape[-1]).swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        return self._rows_of("v", n, self.res_v.shape[-1]).astype(dtype)

    # ---------------------------------------------------------------- accounting
    @property
    def used_nbytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        Dv = self.res_v.shape[-1]
        g = self.n_quant // self.group
        total = B * H * self.n_quant  # order bytes
        for t in TIERS:
            rows, b = g * self.counts[t], self.tier_bits[t]
            for d in (D, Dv):
                cg = self._cg(d)
                total += B * H * rows * (d // cg) * (4 * gq.words_per_group(b, cg) + 4)
        return total + self.res_k.nbytes + self.res_v.nbytes

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """avg_bits·(d + dv)/8 code bytes + 4 bytes per channel group + 1 byte of order, per token per head."""
        return self.realized_avg_bits * (d + dv) / 8 + 4 * (d / self._cg(d) + dv / self._cg(dv)) + 1
