"""AnchorKV: anchor tokens kept exact, the other tokens coded as low-bit residuals against an anchor.

Paper: no paper titled "AnchorKV" was found (searched: "AnchorKV anchor tokens KV cache quantization
residual"). The closest published work is AnTKV (Li, Xiao, Wang, Liu, Tang, Lu, Yang, Chen, Chu,
"AnTKV: Anchor Token-Aware Sub-Bit Vector Quantization for KV Cache in Large Language Models",
arXiv 2506.19505): keep a small fraction (~1%) of the most quantization-sensitive tokens ("anchor
tokens") in float16 and quantize the rest. This module implements what the configuration fields
(``anchorkv_*``) describe, which goes one step further than AnTKV: the exact anchors also serve as
*references* that the other tokens are coded against (delta coding), so tokens clustered around an
anchor cost their small residual instead of their full range.

Algorithm (a ``KIVIKVCache`` subclass: same float16 window of < G tokens, same ``update_and_fetch``
/ ``attend``, one softmax over [decoded part, full-precision part]); G = ``anchorkv_window``,
b = ``anchorkv_residual_bits``, A = ``n_anchors`` = min(G, max(1, round(anchorkv_anchor_frac * G)))
anchors per G-token group; keys and values are coded independently, each per (batch, head, group):

1. anchor score of token t of the group: ``rho * centrality + (1 - rho) * outlier`` with
   centrality = -(mean squared distance of t to the group's tokens) and outlier = ||x_t||, each
   min-max normalized within the group (``anchorkv_rho``); ties broken by a fixed, seeded
   per-position jitter (``anchorkv_seed``, 1e-6). The A best tokens are the group's anchors, stored
   exactly (float16 ``{k,v}_anc`` [B, H, groups*A, D]) with their positions (uint8 ``{k,v}_apos``).
   Central tokens make good references; high-norm (outlier) tokens are the most damaging to
   quantize, so both make good anchors.
2. every token picks its nearest anchor (L2); its residual r = x - anchor is used only when it is
   worth it: when the summed per-channel-group range of r is below ``(1 - theta) *`` that of x
   (``anchorkv_theta``); otherwise the token is coded directly (reference 0). The reference code
   (0 = none, j + 1 = anchor j) takes ceil(log2(A + 1)) bits per token, bit-packed per group
   (``{k,v}_ref`` uint32).
3. the chosen rows (residual or direct) are quantized per token, b bits, channel groups of
   gcd(D, G), float16 scale/bias per channel group (``primitives.groupquant``).

Decode: x = Q^-1(code) + (its anchor, if any); anchor rows are replaced by their exact float16
values. All vectorized over batch, heads, groups and tokens.

Bytes per token per KV head, for keys (same for values with Dv):
``b*D/8 + 4*D/gcd(D,G) + ceil(log2(A+1))/8 + A*(2*D + 1)/G`` (+ the G-row float16 window);
at the defaults (D = 64, G = 32, b = 2, A = 1): 16 + 8 + 0.125 + 4.03 = 28.2 bytes (float16: 128).

Deviations / choices (deliberate, documented):

* The anchor fraction is applied per G-token group with at least one anchor per group, so the
  effective fraction is max(anchor_frac, 1/G) (1/32 at the defaults, not 1/128): anchors must be near
  the tokens that are coded against them, and a fixed count per group keeps the layout dense.
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys); per-token (not per-channel)
  residual quantization, since a per-channel min/max code is invariant to subtracting a per-channel
  constant and would gain nothing from an anchor.
* KIVI's residual-window deviations apply (window = G: 0..G-1 newest tokens float16; a group
  completed by a decode step is coded after that step's attention).
* Attention dequantizes and multiplies (``_uses_qmm`` is False: anchors + residuals are not MLX's
  affine layout). Trim: exact for residual tokens + whole groups (KIVI's rule), ValueError otherwise.

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 512 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs the uncompressed cache; kv_bytes = bytes held / fp16):
defaults (2 bits, G = 32, 1 anchor per group): KL 0.153 (top-1 0.69), kv_bytes 0.305; 4 anchors per
group (anchor_frac = 0.125): KL 0.090 (top-1 0.88), kv_bytes 0.392; plain KIVI 2 bits: 0.206, 0.241.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_rows
from ...primitives import bitpack
from ...primitives import groupquant as gq
from ...primitives.rotation import seeded_rng
from .kivi import KIVIKVCache

_TAG_ANCHOR = 0x0A7E_0A01


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
    B, H, n = codes.shape[:3]
    g = n // G
    D = anc.shape[-1]
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
class AnchorKVCache(KIVIKVCache):
    """Exact float16 anchors per G-token group; other tokens b-bit residuals against their nearest anchor."""
    chunk_invariant = True  # per-group anchors, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_codes", "k_scales", "k_biases", "k_ref", "k_apos", "k_anc",
                    "v_codes", "v_scales", "v_biases", "v_ref", "v_apos", "v_anc", "res_k", "res_v")

    def _init_layout(self):
        # types and the plain ranges are validated with the config; these are the method's own limits
        o = self.config.options
        if o.window > 255:  # anchor positions are stored as uint8
            raise QuantizerConfigError("anchorkv_window", o.window, "an int in 1..255 (tokens per group)")
        if o.anchor_frac <= 0:
            raise QuantizerConfigError("anchorkv_anchor_frac", o.anchor_frac, "a number in (0, 1]")
        if o.theta >= 1:
            raise QuantizerConfigError("anchorkv_theta", o.theta, "a number in [0, 1)")
        self.group, self.qbits = o.window, o.residual_bits
        self.n_anchors = min(self.group, max(1, round(float(o.anchor_frac) * self.group)))
        self.rho, self.theta, self.seed = float(o.rho), float(o.theta), o.seed
        self._call = None

    dequant_only = "anchors + residual codes"

    # ---------------------------------------------------------------- storage
    def _append_groups(self, kb, vb):
        G, A, b = self.group, self.n_anchors, self.qbits
        t0, n = self.n_quant, kb.shape[2]
        g0 = t0 // G
        for p, x in (("k", kb), ("v", vb)):
            vg = self.value_group(x.shape[-1])
            codes, scales, biases, ref, apos, anc = anchor_encode(x, G, A, b, vg, self.rho, self.theta, self.seed)
            setattr(self, f"{p}_codes", grow_rows(getattr(self, f"{p}_codes"), t0, codes))
            setattr(self, f"{p}_scales", grow_rows(getattr(self, f"{p}_scales"), t0, scales))
            setattr(self, f"{p}_biases", grow_rows(getattr(self, f"{p}_biases"), t0, biases))
            setattr(self, f"{p}_ref", grow_rows(getattr(self, f"{p}_ref"), g0, ref))
            setattr(self, f"{p}_apos", grow_rows(getattr(self, f"{p}_apos"), g0 * A, apos))
            setattr(self, f"{p}_anc", grow_rows(getattr(self, f"{p}_anc"), g0 * A, anc))
        self.n_quant = t0 + n

    def _decode(self, p: str, n: int, dtype) -> mx.array:
        G, A = self.group, self.n_anchors
        g = n // G
        d = getattr(self, f"{p}_anc").shape[-1]
        return anchor_decode(getattr(self, f"{p}_codes")[:, :, :n], getattr(self, f"{p}_scales")[:, :, :n],
                             getattr(self, f"{p}_biases")[:, :, :n], getattr(self, f"{p}_ref")[:, :, :g],
                             getattr(self, f"{p}_apos")[:, :, : g * A], getattr(self, f"{p}_anc")[:, :, : g * A],
                             G, A, self.qbits, self.value_group(d), dtype)

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return self._decode("k", n, dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        return self._decode("v", n, dtype)

    def anchor_mask(self) -> mx.array:
        """[B, H, n_quant] bool for keys: True where the token is a (float16-exact) key anchor."""
        G, A = self.group, self.n_anchors
        g = self.n_quant // G
        B, H = self.k_apos.shape[:2]
        pos = self.k_apos[:, :, : g * A].astype(mx.int32).reshape(B, H, g, A)
        return (mx.arange(G)[:, None] == pos[..., None, :]).any(-1).reshape(B, H, g * G)

    # ---------------------------------------------------------------- accounting
    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """Theoretical bytes per token per KV head of the coded part (K + V)."""
        G, A, b = self.group, self.n_anchors, self.qbits

        def one(dd):
            return b * dd / 8 + 4 * dd / self.value_group(dd) + ref_bits(A) / 8 + A * (2 * dd + 1) / G

        return one(d) + one(dv)

    @property
    def used_nbytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        G, A, b = self.group, self.n_anchors, self.qbits
        n, g = self.n_quant, self.n_quant // G
        total = self.res_k.nbytes + self.res_v.nbytes
        for dd in (D, self.res_v.shape[-1]):
            vg = self.value_group(dd)
            total += B * H * n * (dd // vg) * (4 * gq.words_per_group(b, vg) + 4)
            total += B * H * g * (bitpack.packed_nbytes(G, ref_bits(A)) + A * (1 + 2 * dd))
        return total
