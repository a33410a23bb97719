"""AnchorKV: anchor tokens kept exact, the other tokens coded as low-bit residuals against an anchor.

Paper: none titled "AnchorKV" was found; the closest is AnTKV (Li, Xiao, Wang, Liu, Tang, Lu, Yang, Chen, Chu,
"AnTKV: Anchor Token-Aware Sub-Bit Vector Quantization for KV Cache in Large Language Models", arXiv
2506.19505): ~1% of the most quantization-sensitive tokens stay float16. This implements what the
``anchorkv_*`` fields describe, one step further: the anchors are also references for delta coding.

Per (batch, head, G-token group; G = ``anchorkv_window``), keys and values alike: the A = min(G, max(1,
round(``anchorkv_anchor_frac`` * G))) tokens with the best ``rho * centrality + (1 - rho) * norm`` (each min-max
normalized, seeded 1e-6 tie jitter) are stored exactly (central tokens make good references, high-norm ones are
the most damaging to quantize); any other token codes its residual against its nearest anchor when that narrows
its summed per-channel-group range by more than ``anchorkv_theta``, at ``anchorkv_residual_bits`` bits per token,
with ceil(log2(A + 1)) bits naming its reference.

Deviations / choices: at least one anchor per group (effective fraction max(anchor_frac, 1/G)), since anchors
must be near the tokens coded against them; keys quantized after RoPE, residuals per token (a per-channel min/max
code is invariant to a per-channel offset, so it would gain nothing from an anchor); KIVI's window deviations (a
group completed by a decode step is coded after its attention); trim: KIVI's rule. Attention dequantizes, but for
a CPU decode step: KIVI's CPU kernel reads the residual codes as key and value rows and adds each row's anchor in
the block's products, the anchor rows put back exactly (GEAR's corrections: ``_cpu_part``).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import bitpack
from ...primitives import groupquant as gq
from ...primitives.buffers import grow_rows
from ...primitives.rotation import seeded_rng
from ...window import Partials
from .kivi import KIVIKVCache, SideRows

_TAG_ANCHOR = 0x0A7E_0A01
_PARTS = ("codes", "scales", "biases", "ref", "apos", "anc")  # what anchor_encode returns, per side


@functools.lru_cache(maxsize=32)
def _jitter(G: int, seed: int) -> np.ndarray:
    return (seeded_rng(_TAG_ANCHOR, seed).random(G) * 1e-6).astype(np.float32)


def anchor_encode(x: mx.array, G: int, A: int, bits: int, vg: int, rho: float, theta: float, seed: int):
    """Code ``x [B, H, n, D]`` (n a multiple of G). Returns (codes, scales, biases, ref words [B, H, g, w],
    anchor positions uint8 [B, H, g*A], anchors float16 [B, H, g*A, D])."""
    B, H, n, D = x.shape
    g = n // G
    xb = x.astype(mx.float16).astype(mx.float32).reshape(B, H, g, G, D)
    sq = (xb * xb).sum(-1)  # [B, H, g, G]
    d2 = mx.maximum(sq[..., :, None] + sq[..., None, :] - 2 * (xb @ xb.swapaxes(-1, -2)), 0.0)

    def _unit(s):
        lo, hi = s.min(-1, keepdims=True), s.max(-1, keepdims=True)
        return (s - lo) / mx.maximum(hi - lo, 1e-12)

    score = rho * _unit(-d2.mean(-1)) + (1 - rho) * _unit(mx.sqrt(sq)) + mx.array(_jitter(G, seed))
    apos = mx.argsort(-score, axis=-1)[..., :A]  # [B, H, g, A]
    anc = mx.take_along_axis(xb, apos[..., None], axis=3)  # [B, H, g, A, D] (float16 values)
    da = mx.take_along_axis(d2, mx.broadcast_to(apos[..., None, :], (B, H, g, G, A)), axis=-1)
    near = mx.argmin(da, axis=-1)  # [B, H, g, G]
    onehot = (near[..., None] == mx.arange(A)).astype(mx.float32)  # [B, H, g, G, A]
    r = xb - onehot @ anc

    def _spread(y):  # summed per-channel-group range: proportional to the affine code's error
        y = y.reshape(B, H, g, G, D // vg, vg)
        return (y.max(-1) - y.min(-1)).sum(-1)

    use = _spread(r) < (1.0 - theta) * _spread(xb)
    ref = mx.where(use, near + 1, 0).astype(mx.uint32)
    rows = mx.where(use[..., None], r, xb).reshape(B, H, n, D)
    q = gq.quantize(rows, bits, vg)
    words = bitpack.pack_bits(ref, ref_bits(A))
    return (q.codes, q.scales, q.biases, words, apos.reshape(B, H, g * A).astype(mx.uint8),
            anc.reshape(B, H, g * A, D).astype(mx.float16))


def anchor_decode(codes, scales, biases, ref_words, apos, anc, G: int, A: int, bits: int, vg: int,
                  dtype=mx.float32) -> mx.array:
    """Inverse of :func:`anchor_encode` for ``n = codes.shape[2]`` tokens ([B, H, n, D])."""
    (B, H, n), D = codes.shape[:3], anc.shape[-1]
    g = n // G
    x = gq.dequantize(codes, scales, biases, bits, vg, mx.float32).reshape(B, H, g, G, D)
    ref = bitpack.unpack_bits(ref_words, ref_bits(A), G).astype(mx.int32)  # [B, H, g, G]
    a = anc.astype(mx.float32).reshape(B, H, g, A, D)
    sel = (ref[..., None] == (mx.arange(A) + 1)).astype(mx.float32)  # [B, H, g, G, A]
    x = x + sel @ a
    pos = apos.astype(mx.int32).reshape(B, H, g, A)
    at = (mx.arange(G)[:, None] == pos[..., None, :])  # [B, H, g, G, A]: row is anchor j
    exact = at.astype(mx.float32) @ a
    x = mx.where(at.any(-1)[..., None], exact, x)
    return x.reshape(B, H, n, D).astype(dtype)


def ref_bits(A: int) -> int:
    return max(1, math.ceil(math.log2(A + 1)))


@register_with_mlx_lm
@register("anchorkv")
class AnchorKVCache(SideRows, KIVIKVCache):
    """Exact float16 anchors per G-token group; other tokens b-bit residuals against their nearest anchor."""
    chunk_invariant = True  # per-group anchors, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group
    array_fields = ("k_codes", "k_scales", "k_biases", "k_ref", "k_apos", "k_anc",
                    "v_codes", "v_scales", "v_biases", "v_ref", "v_apos", "v_anc", "res_k", "res_v")
    dequant_only = "anchors + residual codes"

    def _init_layout(self):
        o = self.config.options
        self.group, self.qbits = o.window, o.residual_bits
        self.n_anchors = min(self.group, max(1, round(float(o.anchor_frac) * self.group)))
        self.rho, self.theta, self.seed = float(o.rho), float(o.theta), o.seed

    def _append_groups(self, kb, vb):
        G, A, b = self.group, self.n_anchors, self.qbits
        t0, n = self.n_quant, kb.shape[2]
        g0 = t0 // G
        for p, x in (("k", kb), ("v", vb)):
            coded = anchor_encode(x, G, A, b, self.value_group(x.shape[-1]), self.rho, self.theta, self.seed)
            for name, arr, at in zip(_PARTS, coded, (t0, t0, t0, g0, g0 * A, g0 * A)):
                setattr(self, f"{p}_{name}", grow_rows(getattr(self, f"{p}_{name}"), at, arr))
        self.n_quant = t0 + n

    def _decode(self, p: str, n: int, dtype) -> mx.array:
        G, A = self.group, self.n_anchors
        g = n // G
        parts = [getattr(self, f"{p}_{name}")[:, :, :m] for name, m in zip(_PARTS, (n, n, n, g, g * A, g * A))]
        return anchor_decode(*parts, G, A, self.qbits, self.value_group(parts[-1].shape[-1]), dtype)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel, keys as rows, the anchors as its corrections

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Residual codes KIVI's CPU kernel reads as rows (2, 4 or 8 bits, each channel group whole words), head dims
        up to 256, up to 32 query heads a KV head."""
        b = self.qbits
        return (native.available() and self.attend_path == "auto" and b in (2, 4, 8)
                and (self.value_group(d) * b) % 32 == 0 and (self.value_group(dv) * b) % 32 == 0
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` quantized tokens by KIVI's CPU kernel: the residual codes as key and value rows, each row's
        anchor added in the block's products (A_t the one-hot of its stored reference, B^T the group's anchors) and
        the anchor rows put back exactly (``fix_refs``), as ``anchor_decode`` rebuilds rows."""
        d, dv = qf.shape[-1], self.res_v.shape[-1]
        arrays = [getattr(self, f"{p}_{a}") for p in "kv" for a in ("codes", "scales", "biases")]
        B, H = self.k_anc.shape[:2]
        fixes = [x for p in "kv" for x in (None, getattr(self, f"{p}_anc").reshape(B, H, -1), None, None)]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            qf, *arrays, n, self.qbits, self.value_group(d), self.value_group(dv), dv, key_rows=True, fixes=fixes,
            fix_sizes=[self.n_anchors, 0, 0], fix_group=self.group, fix_ref_bits=ref_bits(self.n_anchors),
            fix_refs=[getattr(self, f"{p}_{a}") for p in "kv" for a in ("ref", "apos")])
        return Partials(m, l, acc)

    def anchor_mask(self) -> mx.array:
        """[B, H, n_quant] bool for keys: True where the token is a (float16-exact) key anchor."""
        G, A = self.group, self.n_anchors
        g = self.n_quant // G
        B, H = self.k_apos.shape[:2]
        pos = self.k_apos[:, :, : g * A].astype(mx.int32).reshape(B, H, g, A)
        return (mx.arange(G)[:, None] == pos[..., None, :]).any(-1).reshape(B, H, g * G)

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        G, A, b = self.group, self.n_anchors, self.qbits
        return sum(b * x / 8 + 4 * x / self.value_group(x) + ref_bits(A) / 8 + A * (2 * x + 1) / G for x in (d, dv))

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        G, A, n, g = self.group, self.n_anchors, self.n_quant, self.n_quant // self.group
        vg = {d: self.value_group(d) for d in (D, dv)}
        return sum(B * H * (n * (d // vg[d]) * (4 * gq.words_per_group(self.qbits, vg[d]) + 4)
                            + g * (bitpack.packed_nbytes(G, ref_bits(A)) + A * (1 + 2 * d))) for d in (D, dv))
