"""Age-tiered KV quantization: tokens are stored at fewer bits as they age, re-quantized incrementally.

No single paper (library design): KIVI's layout (Liu et al., arXiv 2402.02750) with the recency observation
behind sliding-window schemes (e.g. SKVQ's full-precision window, arXiv 2405.06219): attention concentrates on
recent tokens, so older tokens can take coarser codes.

A quantized group is *recent* (``age_bits_recent``) while its newest token's age (T - 1 - p) is below
``age_recent_boundary``, *mid* (``age_bits_mid``) while below ``age_mid_boundary``, then *old*
(``age_bits_old``); crossing a boundary re-quantizes it from its stored codes at the next tier's width. Three
KIVI-layout stores (``k{t}_*`` / ``v{t}_*``; t = 0 old, 1 mid, 2 recent) hold contiguous groups in position order.

Deviations / choices: KIVI's float16 residual of < G tokens; tiers are per group by its newest token (up to G - 1
tokens past a boundary keep the finer width); moving groups copies the bounded recent and mid stores once per
crossing group, never per token; attention dequantizes (three widths), but a CPU decode step reads each tier's
codes in KIVI's CPU kernel (widths of 2, 4 or 8 bits) and joins the three partials; trim is exact for residual rows
only, deeper trims raise ``ValueError`` (re-quantized groups cannot be restored).
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import groupquant as gq
from ...window import join_partials
from .kivi import KIVIKVCache

_ARR = ("codes", "scales", "biases")
_COUNTS = ("n_old", "n_mid", "n_recent")  # groups per tier, t = 0 old, 1 mid, 2 recent


@register_with_mlx_lm
@register("age_tiered")
class AgeTieredKVCache(KIVIKVCache):
    """KIVI layout in three tiers of decreasing bits by token age, re-quantized from the stored codes."""
    chunk_invariant = False  # a prompt group is coded once at its tier's width, a decoded one re-coded tier by tier
    exact_trim = False  # raises ValueError once the trimmed rows completed a group
    array_fields = tuple(f"{kv}{t}_{a}" for t in range(3) for kv in "kv" for a in _ARR) + ("res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name") + _COUNTS
    n_old = n_mid = n_recent = 0
    _T_after = None
    dequant_only = "three code widths"

    def _init_layout(self):
        o = self.config.options
        self.tier_bits = (o.bits_old, o.bits_mid, o.bits_recent)
        self.recent_boundary, self.mid_boundary, self.group = o.recent_boundary, o.mid_boundary, o.group_size
        self.qbits = self.tier_bits[2]

    def _counts(self):
        return [getattr(self, c) for c in _COUNTS]

    def _tier_dense(self, t, m, dtype=mx.float32):
        """(K^T [B, H, D, m*G], V [B, H, m*G, Dv]) of the first ``m`` groups of tier ``t``."""
        G, b = self.group, self.tier_bits[t]
        k = [getattr(self, f"k{t}_{a}")[..., : m * per] for a, per in zip(_ARR, (gq.words_per_group(b, G), 1, 1))]
        v = [getattr(self, f"v{t}_{a}")[:, :, : m * G] for a in _ARR]
        return gq.dequantize(*k, b, G, dtype), gq.dequantize(*v, b, self.value_group(self.res_v.shape[-1]), dtype)

    def _append(self, t, kt, v):
        """Quantize K^T [B, H, D, m*G] and V [B, H, m*G, Dv] at tier ``t``'s width; append to it."""
        G, b = self.group, self.tier_bits[t]
        m = kt.shape[-1] // G
        n0 = self._counts()[t]
        self._append_codes(n0 * G, None, gq.quantize(v, b, self.value_group(v.shape[-1])), vp=f"v{t}",
                           keys=[(f"k{t}", gq.quantize(kt, b, G), gq.words_per_group(b, G))])
        setattr(self, _COUNTS[t], n0 + m)

    def _pop_front(self, t, m):
        """Drop the first ``m`` groups of tier ``t`` (the remaining ones are copied, exact size)."""
        G, n = self.group, self._counts()[t]
        for a, per in zip(_ARR, (gq.words_per_group(self.tier_bits[t], G), 1, 1)):
            # copies: a slice would stay a view of (and keep alive) the whole old buffer
            setattr(self, f"k{t}_{a}", mx.contiguous(getattr(self, f"k{t}_{a}")[..., m * per : n * per]))
            setattr(self, f"v{t}_{a}", mx.contiguous(getattr(self, f"v{t}_{a}")[:, :, m * G : n * G]))
        setattr(self, _COUNTS[t], n - m)

    def _targets(self, T, n_groups):
        """(groups in the old tier, groups not in the recent tier) for T stored tokens."""
        G = self.group
        return tuple(min(max((T - edge) // G, 0), n_groups) for edge in (self.mid_boundary, self.recent_boundary))

    def _rebalance(self, T):
        """Move stored groups down the tiers for T stored tokens, re-quantizing from their codes."""
        old_t, not_recent_t = self._targets(T, sum(self._counts()))
        for t, m in ((2, not_recent_t - (self.n_old + self.n_mid)), (1, old_t - self.n_old)):  # recent -> mid -> old
            if m > 0:
                kt, v = self._tier_dense(t, m)
                self._pop_front(t, m)
                self._append(t - 1, kt, v)

    def _store(self, keys, values):
        self._T_after = self.n_quant + self.n_res + keys.shape[2]
        super()._store(keys, values)
        self._rebalance(self._T_after)

    def _append_groups(self, kb, vb):
        """New groups (float16 rows still available): quantize each directly at its tier's width."""
        G = self.group
        T = self._T_after if self._T_after is not None else self.n_quant + kb.shape[2]
        self._rebalance(T)  # existing groups first: tiers stay in position order
        e, k = sum(self._counts()), kb.shape[2] // G
        old_t, not_recent_t = self._targets(T, e + k)
        kt = kb.swapaxes(-1, -2)
        cuts = [0, max(old_t - e, 0), max(not_recent_t - e, 0), k]
        for t in range(3):
            a, b = cuts[t] * G, cuts[t + 1] * G
            if b > a:
                self._append(t, kt[..., a:b], vb[:, :, a:b])
        self.n_quant += kb.shape[2]

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return mx.concatenate([self._tier_dense(t, m, dtype)[0] for t, m in enumerate(self._counts()) if m],
                              axis=-1)[..., :n]

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        return mx.concatenate([self._tier_dense(t, m, dtype)[1] for t, m in enumerate(self._counts()) if m],
                              axis=2)[:, :, :n]

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel over each tier's store

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        return all(b in (2, 4, 8) for b in self.tier_bits) and super()._cpu_codes_fit(d, dv, rep)

    def _cpu_part(self, qf, n: int, counts=()):
        """The first ``n`` quantized tokens (old, mid, then recent tier: position order) by KIVI's CPU kernel, a
        call per tier, joined."""
        parts = []
        for t, m in enumerate(self._counts()):
            take = min(n, m * self.group)
            if take:
                parts.append(self._cpu_store_part(qf, str(t), self.tier_bits[t], take))
            n -= take
        return join_partials(parts)

    def token_bits(self) -> list[int]:
        """Bits of every stored token in position order (16 for the float16 residual)."""
        bits = [b for t, m in enumerate(self._counts()) for b in [self.tier_bits[t]] * (m * self.group)]
        return bits + [16] * self.n_res

    def _check_trim_rows(self, n: int) -> None:
        """Residual rows only: a trim into the groups cannot restore the widths they aged from."""
        if n > self.n_res:
            raise ValueError(
                f"AgeTieredKVCache: trimming {n} tokens would reach quantized groups (only the {self.n_res} "
                "float16 residual tokens can be dropped exactly: older groups were re-quantized as they aged)")
        super()._check_trim_rows(n)

    def tier_bytes_per_token(self, t: int, d: int, dv: int) -> float:
        """Bytes per token per KV head of tier ``t`` (codes at its width + float16 scales/biases)."""
        G, b = self.group, self.tier_bits[t]
        gv = self.value_group(dv)
        return (d * (4 * gq.words_per_group(b, G) + 4)) / G + (dv // gv) * (4 * gq.words_per_group(b, gv) + 4)

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        return int(sum(B * H * m * self.group * self.tier_bytes_per_token(t, D, dv)
                       for t, m in enumerate(self._counts())))
