"""AMC: saliency-tiered mixed precision (the library's "AMC: saliency-tiered precision" entry; no paper text was
available to check against, so this follows the method's description: a few salient tokens at high precision,
more at medium, the rest at low).

On KIVI's residual (G = ``amc_group_size``) a group's tokens are ranked by key L2 norm (large-norm keys dominate
the logits): the top ``round(amc_k_high * G)`` get 8 bits, the next ``round((amc_k_high + amc_k_mid) * G) - n_hi``
4 bits, the rest 2 (defaults: 3.75 bits per element). Keys share KIVI's per-channel group ranges, coded at each
token's width (per-token 2-bit keys: KL 0.30 vs 0.085 shared); values per token in channel groups of gcd(Dv, 32);
``order`` (uint8) restores token order (``RankTiers``, shared with adakv).

Not implemented (rejected with ``QuantizerConfigError``): ``amc_use_query_saliency=True`` (groups are quantized in
``update_and_fetch``, without queries, and codes must not depend on whether the dispatch point is installed);
``amc_adaptive_thresholds=True`` (``amc_threshold_window``, ``amc_gamma``) and ``amc_calib_variance`` (tier sizes
are fixed per group). Keys are quantized after RoPE. A CPU decode step reads each tier's codes in one pass of the
latent kernel (``native/latent_cpu.cpp``, keys as rows on the group's shared ranges, values KIVI's rows: ``_cpu_part``),
the tiers' partials joined in one softmax (a softmax does not depend on the rows' order, so ``order`` is not read);
AdaKV's tiers take the same path (``RankTiers._cpu_part``).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import bitpack
from ...primitives import groupquant as gq
from ...primitives import nonuniform as sal
from ...primitives.buffers import grow_columns, grow_rows
from ...window import Partials, join_partials
from .kivi import KIVIKVCache, SideRows

TIERS = ("hi", "mid", "lo")
TIER_BITS = {"hi": 8, "mid": 4, "lo": 2}
CG = 32  # channel group of the per-token quantization (gcd with the head dim)


def range_code(x: mx.array, mn: mx.array, rng: mx.array, bits: int) -> mx.array:
    """``bits``-bit codes of ``x`` on ``[mn, mn + rng]`` (``mn``/``rng`` broadcast, float16-rounded)."""
    f32 = mx.float32
    return gq.affine_codes(x.astype(f32), mn.astype(f32), rng.astype(f32) / float((1 << bits) - 1), bits)


def range_decode(codes: mx.array, mn: mx.array, rng: mx.array, bits: int) -> mx.array:
    """float32 values of ``bits``-bit ``codes`` on ``[mn, mn + rng]`` (``mn``/``rng`` broadcast)."""
    return codes.astype(mx.float32) * (rng.astype(mx.float32) / float((1 << bits) - 1)) + mn.astype(mx.float32)


class RankTiers(SideRows):
    """Per-token tiers by within-group rank (amc, adakv): ``counts`` rows of each G-token group per tier
    at ``tier_bits``, stored in rank order with the rank order of every row (``order``, uint8), which
    ``_decode`` undoes (its subclasses decode each tier's rows, ``_in_token_order`` reorders them)."""

    def _tiers(self):
        """(tier, rows per group, bits, first rank) of each non-empty tier: three tiers, not a loop over tokens."""
        start = 0
        for t in TIERS:
            if self.counts[t]:
                yield t, self.counts[t], self.tier_bits[t], start
            start += self.counts[t]

    def _cg(self, d: int) -> int:
        return math.gcd(d, CG)

    @property
    def code_bits(self) -> float:
        """Code bits per stored element from the tier mix (scale/bias overhead excluded)."""
        return sum(self.tier_bits[t] * self.counts[t] for t in TIERS) / self.group

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """Per token per head: codes, key min/range per channel per group, value side info, 1 byte of order."""
        return self.code_bits * (d + dv) / 8 + 4 * d / self.group + 4 * dv / self._cg(dv) + 1

    def _in_token_order(self, parts: list, n: int, d: int) -> mx.array:
        """Tier rows ``[B, H, g, c_t, d]`` (in rank order) -> rows ``[B, H, n, d]`` in token order."""
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=3)
        B, H = x.shape[:2]
        order = self.order[:, :, :n].astype(mx.int32).reshape(B, H, n // self.group, self.group)
        return mx.take_along_axis(x, mx.argsort(order, axis=-1)[..., None], axis=3).reshape(B, H, n, d)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: the latent kernel, a call per tier

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Tiers the latent kernel reads: 1-8-bit codes, value groups of whole words, head dims up to 256, up to 32
        query heads a KV head."""
        cg = self._cg(dv)
        return (native.available() and all((cg * b) % 32 == 0 for _, _, b, _ in self._tiers())
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` tokens' partials for scaled float32 queries ``qf``: each tier's rows in one kernel call
        (keys decoded on their group's channel ranges, ``k_rows_per_group`` = the tier's rows a group; values
        KIVI's rows), joined in one softmax (a softmax does not depend on the rows' order: ``order`` is not read)."""
        g, d, dv = n // self.group, qf.shape[-1], self.res_v.shape[-1]
        parts = []
        for t, c, b, start in self._tiers():
            (k_codes, k_ranges, k_mins, v_codes, v_scales, v_biases), layout = self._cpu_tier(t, c, start)
            m, l, acc = native.module().latent_decode(  # noqa: E741
                qf, None, g * c, 1, k_codes, k_ranges, k_mins, None, [b] * d, v_codes, v_scales, v_biases, None,
                v_row_bits=b, v_row_group=self._cg(dv), dv=dv, k_rows_per_group=c, **layout)
            parts.append(Partials(m, l, acc))
        return join_partials(parts)

    def _cpu_tier(self, t: str, c: int, start: int) -> tuple:
        """Tier ``t``'s arrays for the latent kernel -- key codes, key ranges and minima, value codes and their side
        arrays -- and the ``latent_decode`` layout options that read them in place."""
        raise NotImplementedError

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        """Order bytes, the key ranges and each tier's codes (``_tier_nbytes``); the base adds the residual."""
        g = self.n_quant // self.group
        codes = sum(self._tier_nbytes(B * H * g * c, b, D, dv) for _, c, b, _ in self._tiers())
        return B * H * (self.n_quant + g * D * 4) + codes


@register_with_mlx_lm
@register("amc")
class AMCKVCache(RankTiers, KIVIKVCache):
    """Per-token 8 / 4 / 2-bit tiers by key-norm saliency, tier fractions amc_k_high / amc_k_mid."""
    chunk_invariant = True  # per-group tiers, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = tuple(f"k_codes_{t}" for t in TIERS) + ("k_mins", "k_ranges") + tuple(
        f"v_{a}_{t}" for t in TIERS for a in ("codes", "scales", "biases")) + ("order", "res_k", "res_v")
    dequant_only = "its codes are not MLX's affine layout"

    def _init_layout(self):
        o = self.config.options
        self.group = o.group_size
        self.tier_bits = dict(TIER_BITS)
        n_hi = round(o.k_high * self.group)  # cumulative rounding: the counts sum to G
        n_mid = round((o.k_high + o.k_mid) * self.group) - n_hi
        self.counts = {"hi": n_hi, "mid": n_mid, "lo": self.group - n_hi - n_mid}
        self.qbits = TIER_BITS["hi"]

    assigned_avg_bits = RankTiers.code_bits

    def _append_groups(self, kb, vb):
        G = self.group
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        g, t0 = n // G, self.n_quant
        order = mx.argsort(-sal.token_importance(kb, vb, "norm").reshape(B, H, g, G), axis=-1)  # by saliency
        kf = kb.astype(mx.float32).reshape(B, H, g, G, D)
        kmin = kf.min(axis=3).astype(mx.float16)  # [B, H, g, D] per channel per group
        krange = (kf.max(axis=3) - kf.min(axis=3)).astype(mx.float16)
        self.order = grow_rows(self.order, t0, order.reshape(B, H, n).astype(mx.uint8))
        cap = self.order.shape[2] // G  # per-group arrays follow the token arrays' capacity
        self.k_mins = grow_columns(self.k_mins, t0 // G, kmin.swapaxes(-1, -2), cap)  # [B, H, D, groups]
        self.k_ranges = grow_columns(self.k_ranges, t0 // G, krange.swapaxes(-1, -2), cap)
        ks = mx.take_along_axis(kf, order[..., None], axis=3)  # rank order
        vs = mx.take_along_axis(vb.reshape(B, H, g, G, Dv), order[..., None], axis=3)
        for t, c, b, start in self._tiers():
            kq = range_code(ks[:, :, :, start : start + c], kmin[:, :, :, None], krange[:, :, :, None], b)
            vq = gq.quantize(vs[:, :, :, start : start + c].reshape(B, H, g * c, Dv), b, self._cg(Dv))
            for name, arr in zip(("k_codes", "v_codes", "v_scales", "v_biases"),
                                 (bitpack.pack_bits(kq, b).reshape(B, H, g * c, -1), *vq)):
                setattr(self, f"{name}_{t}", grow_rows(getattr(self, f"{name}_{t}"), (t0 // G) * c, arr))
        self.n_quant = t0 + n

    def _decode(self, side: str, n: int, dtype) -> mx.array:
        g, d = n // self.group, getattr(self, f"res_{side}").shape[-1]
        parts = []
        for t, c, b, _ in self._tiers():
            if side == "k":
                codes = getattr(self, f"k_codes_{t}")[:, :, : g * c]
                B, H = codes.shape[:2]
                q = bitpack.unpack_bits(codes, b, d).reshape(B, H, g, c, d)
                mn, rng = (a[..., :g].swapaxes(-1, -2)[:, :, :, None] for a in (self.k_mins, self.k_ranges))
                x = range_decode(q, mn, rng, b)
            else:
                a = [getattr(self, f"v_{x}_{t}")[:, :, : g * c] for x in ("codes", "scales", "biases")]
                x = gq.dequantize(*a, b, self._cg(d), mx.float32)
            parts.append(x.reshape(x.shape[0], x.shape[1], g, c, d))
        return self._in_token_order(parts, n, d).astype(dtype)

    def _cpu_tier(self, t: str, c: int, start: int) -> tuple:
        return (getattr(self, f"k_codes_{t}"), self.k_ranges, self.k_mins,
                *(getattr(self, f"v_{a}_{t}") for a in ("codes", "scales", "biases"))), {}

    def tier_of_tokens(self) -> mx.array:
        """Tier index (0 = 8 bits, 1 = 4 bits, 2 = 2 bits) of every quantized token [B, H, n_quant]."""
        G, n = self.group, self.n_quant
        B, H = self.order.shape[:2]
        bounds = mx.array([self.counts["hi"], self.counts["hi"] + self.counts["mid"]])
        rank_tier = (mx.arange(G)[:, None] >= bounds).sum(-1)  # tier of each rank
        order = self.order[:, :, :n].astype(mx.int32).reshape(B, H, n // G, G)
        tiers = mx.put_along_axis(mx.zeros(order.shape, dtype=mx.int32), order,
                                  mx.broadcast_to(rank_tier.astype(mx.int32), order.shape), axis=-1)
        return tiers.reshape(B, H, n)

    def _tier_nbytes(self, rows: int, b: int, D: int, Dv: int) -> int:
        """Bytes of ``rows`` tier rows at ``b`` bits: key codes, value codes and float16 scale/bias."""
        cg = self._cg(Dv)
        return rows * (4 * bitpack.packed_words(D, b) + (Dv // cg) * (4 * gq.words_per_group(b, cg) + 4))
