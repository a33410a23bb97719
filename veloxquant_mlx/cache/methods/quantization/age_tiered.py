"""Age-tiered KV quantization: tokens are stored at fewer bits as they age, re-quantized incrementally.

No single paper: the scheme combines KIVI's layout (Liu et al., arXiv 2402.02750: keys per channel and
values per token, groups of G tokens, full-precision residual) with the recency observation behind
sliding-window / progressive schemes (e.g. SKVQ's full-precision window, arXiv 2405.06219; "more
recent tokens matter more"): attention concentrates on recent tokens, so older tokens can take coarser
codes.

Algorithm (``age_recent_boundary`` = R, ``age_mid_boundary`` = M >= R, ``age_group_size`` = G):

* the age of the token at position p when T tokens are stored is T - 1 - p (the newest has age 0);
* tokens that do not yet fill a key group of G stay in a float16 residual (KIVI);
* a quantized group belongs to the *recent* tier (``age_bits_recent`` bits) while its newest token's
  age is < R, to the *mid* tier (``age_bits_mid``) while it is < M, and to the *old* tier
  (``age_bits_old``) after: every token younger than R is stored at >= the recent bits and every token
  younger than M at >= the mid bits;
* incremental re-quantization: when a stored group crosses a boundary its codes are dequantized and
  re-quantized at the next tier's width: recent -> mid -> old, reading only the stored codes (the
  float16 rows are gone). A group quantized for the first time (prefill) is quantized directly at its
  tier's width from the float16 rows that are still available.
* tiers are three KIVI-layout stores (``k{t}_codes/scales/biases`` per channel, transposed;
  ``v{t}_...`` per token; t = 0 old, 1 mid, 2 recent) holding contiguous runs of groups in position
  order: old, then mid, then recent.
* Bytes per token per KV head in a tier of b bits: ``b*D/8 + 4*D/G`` (keys) + ``b*Dv/8 + 4*Dv/gv``
  (values, gv = gcd(Dv, G)); the cache's bytes follow the tier mix (plus the G-row residual).

Deviations / choices:

* The residual of < G tokens is float16 (not ``age_bits_recent``), as in KIVI.
* Tiers are assigned per group by its newest token, so up to G - 1 tokens past a boundary keep the
  finer width until their group crosses.
* Moving groups between tiers copies the (bounded) recent and mid stores and appends to the old
  one: once per crossing group, never per token.
* Attention dequantizes and multiplies (``_uses_qmm`` False: three widths).
* Trim is exact for residual rows only; deeper trims raise ``ValueError`` (re-quantized groups
  cannot be restored to the codes of a cache that never saw the trimmed tokens).

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 511 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs mlx_lm's plain cache; kv_bytes = bytes held / fp16 cache):
8/4/2 bits, boundaries 128/1024 (no token old yet): KL 0.005 (kv_bytes 0.424); boundaries 64/256:
KL 0.101 (0.343).
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

TIERS = ("old", "mid", "recent")
_ARR = ("codes", "scales", "biases")


@register_with_mlx_lm
@register("age_tiered")
class AgeTieredKVCache(KIVIKVCache):
    """KIVI layout in three tiers of decreasing bits by token age, re-quantized from the stored codes."""
    # a prompt group is quantized once at its tier's width, a decoded one re-quantized tier by tier
    # from its codes
    chunk_invariant = False
    exact_trim = False  # raises ValueError once the trimmed rows completed a group

    array_fields = tuple(f"{kv}{t}_{a}" for t in range(3) for kv in "kv" for a in _ARR) + ("res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "n_old", "n_mid", "n_recent")

    n_old = n_mid = n_recent = 0  # groups per tier
    _T_after = None

    def _init_layout(self):
        o = self.config.options  # validation checked the ranges and recent_boundary <= mid_boundary
        self.tier_bits = (o.bits_old, o.bits_mid, o.bits_recent)
        if not o.bits_old <= o.bits_mid <= o.bits_recent:
            raise QuantizerConfigError("age_bits_mid", o.bits_mid, f"age_bits_old={o.bits_old} <= age_bits_mid <= "
                                                                   f"age_bits_recent={o.bits_recent}")
        self.recent_boundary, self.mid_boundary = o.recent_boundary, o.mid_boundary
        self.group = o.group_size
        self.qbits = self.tier_bits[2]
        self._call = None

    dequant_only = "three code widths"

    # ---------------------------------------------------------------- tier stores
    def _counts(self):
        return [self.n_old, self.n_mid, self.n_recent]

    def _set_count(self, t, n):
        setattr(self, ("n_old", "n_mid", "n_recent")[t], n)

    def _tier_dense(self, t, m, dtype=mx.float32):
        """(K^T [B, H, D, m*G], V [B, H, m*G, Dv]) of the first ``m`` groups of tier ``t``."""
        G, b = self.group, self.tier_bits[t]
        w = gq.words_per_group(b, G)
        k = getattr(self, f"k{t}_codes")
        kt = gq.dequantize(k[..., : m * w], getattr(self, f"k{t}_scales")[..., :m],
                           getattr(self, f"k{t}_biases")[..., :m], b, G, dtype)
        n = m * G
        v = gq.dequantize(getattr(self, f"v{t}_codes")[:, :, :n], getattr(self, f"v{t}_scales")[:, :, :n],
                          getattr(self, f"v{t}_biases")[:, :, :n], b, self.value_group(self.res_v.shape[-1]), dtype)
        return kt, v

    def _append(self, t, kt, v):
        """Quantize K^T [B, H, D, m*G] and V [B, H, m*G, Dv] at tier ``t``'s width; append to it."""
        G, b = self.group, self.tier_bits[t]
        m = kt.shape[-1] // G
        n0 = self._counts()[t]
        kq = gq.quantize(kt, b, G)
        vq = gq.quantize(v, b, self.value_group(v.shape[-1]))
        for a, x in zip(_ARR, vq):
            setattr(self, f"v{t}_{a}", grow_rows(getattr(self, f"v{t}_{a}"), n0 * G, x))
        cap = getattr(self, f"v{t}_codes").shape[2] // G
        w = gq.words_per_group(b, G)
        for a, x, per in zip(_ARR, kq, (w, 1, 1)):
            setattr(self, f"k{t}_{a}", grow_columns(getattr(self, f"k{t}_{a}"), n0 * per, x, cap * per))
        self._set_count(t, n0 + m)

    def _pop_front(self, t, m):
        """Drop the first ``m`` groups of tier ``t`` (the remaining ones are copied, exact size)."""
        G, b = self.group, self.tier_bits[t]
        n = self._counts()[t]
        w = gq.words_per_group(b, G)
        for a, per in zip(_ARR, (w, 1, 1)):
            # copies: a slice would stay a view of (and keep alive) the whole old buffer
            setattr(self, f"k{t}_{a}", mx.contiguous(getattr(self, f"k{t}_{a}")[..., m * per : n * per]))
            setattr(self, f"v{t}_{a}", mx.contiguous(getattr(self, f"v{t}_{a}")[:, :, m * G : n * G]))
        self._set_count(t, n - m)

    def _targets(self, T, n_groups):
        """(groups in the old tier, groups not in the recent tier) for T stored tokens."""
        G = self.group
        not_recent = min(max((T - self.recent_boundary) // G, 0), n_groups)
        old = min(max((T - self.mid_boundary) // G, 0), n_groups)
        return old, not_recent

    def _rebalance(self, T):
        """Move stored groups down the tiers for T stored tokens, re-quantizing from their codes."""
        old_t, not_recent_t = self._targets(T, sum(self._counts()))
        m = not_recent_t - (self.n_old + self.n_mid)
        if m > 0:  # recent -> mid
            kt, v = self._tier_dense(2, m)
            self._pop_front(2, m)
            self._append(1, kt, v)
        m = old_t - self.n_old
        if m > 0:  # mid -> old
            kt, v = self._tier_dense(1, m)
            self._pop_front(1, m)
            self._append(0, kt, v)

    # ---------------------------------------------------------------- storage
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
        parts = [self._tier_dense(t, m, dtype)[0] for t, m in enumerate(self._counts()) if m]
        kt = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return kt[..., :n]

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        parts = [self._tier_dense(t, m, dtype)[1] for t, m in enumerate(self._counts()) if m]
        v = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        return v[:, :, :n]

    def token_bits(self) -> list[int]:
        """Bits of every stored token in position order (16 for the float16 residual)."""
        out = []
        for t, m in enumerate(self._counts()):
            out += [self.tier_bits[t]] * (m * self.group)
        return out + [16] * self.n_res

    def _trim_rows(self, n: int) -> int:
        self._call = None
        if n <= self.n_res:
            self.n_res -= n
            return n
        raise ValueError(
            f"AgeTieredKVCache: trimming {n} tokens would reach quantized groups (only the {self.n_res} "
            "float16 residual tokens can be dropped exactly: older groups were re-quantized as they aged)"
        )

    # ---------------------------------------------------------------- accounting
    def tier_bytes_per_token(self, t: int, d: int, dv: int) -> float:
        """Bytes per token per KV head of tier ``t`` (codes at its width + float16 scales/biases)."""
        G, b = self.group, self.tier_bits[t]
        gv = self.value_group(dv)
        return (d * (4 * gq.words_per_group(b, G) + 4)) / G + (dv // gv) * (4 * gq.words_per_group(b, gv) + 4)

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        """Bytes of the quantized groups, each at its tier's width (the base adds the residual)."""
        return int(sum(B * H * m * self.group * self.tier_bytes_per_token(t, D, dv) for t, m in enumerate(self._counts())))
