"""XQuant (Yang, Yao, Li, Qi, Liu, Zhao, "XQuant: Achieving Ultra-Low Bit KV Cache Quantization with
Cross-Layer Compression", EMNLP 2025, arXiv 2510.11236): adjacent layers share one set of quantized codes.

Paper: the KV caches of adjacent layers are similar, so the layers are paired; the lower layer is
quantized as usual, and for the higher layer of a pair XQuant computes and stores only its own scaling
factors and zero points, and at dequantization reads the *lower layer's* integer codes with them. A pair
then costs one layer's codes plus two layers' scales / zero points (the paper also calibrates the
quantizer's end points data-free, which is not done here).

This implementation (``xquant_group_size`` g layers per group, ``xquant_base_bits`` b,
``xquant_group_quant_size`` G):

* The full-KV layers of a model are split into groups of g consecutive layers by ``build_layers``. The
  first layer of a group (the *base*) is a KIVI cache at b bits: keys per channel and values per token in
  groups of G, float16 scale / zero point per group, float16 residual of < G tokens (``KIVIKVCache``).
* Every other layer of the group (role ``"shared"``) holds **no codes**: when a group of its tokens is
  quantized it reads the base's codes ``c`` of the same tokens and stores only its own float16 scale
  ``s`` and zero point ``z`` per group (the same groups as the base's: per channel over G tokens for
  keys, per token over the value channel groups for values), and reads back ``s * c + z``. ``s, z`` are
  the least-squares fit of its own rows on ``c`` (deviation: the paper takes the higher layer's own
  min / max; the fit is never worse for the given codes and does not depend on the sign convention of
  the base's quantizer). Its own float16 residual of < G tokens is its own.
* Bytes: a shared layer holds its scales / zero points and its residual only, so a pair costs one KIVI
  layer's codes less than two KIVI layers at the same bits (``used_nbytes``; tests/test_xquant.py checks
  the exact figure).
* Lifetime: a coordinator built by ``build_layers`` links the caches of a group for one prompt cache
  (``KVCacheBuilder.for_model`` call): two prompt caches never share state (a fresh group id per call).
  ``save_prompt_cache``/``load_prompt_cache`` relink a group by its id when the base (an earlier layer)
  has been loaded first, which ``load_prompt_cache``'s layer order guarantees; ``deepcopy`` of the cache
  list keeps the links within the copy. mlx_lm runs a shared layer after its base, so the base has
  always quantized (at least) the same tokens.
* Attention: KIVI's ``attend`` (dispatch point) on the dequantized rows (``attend_path = "dequant"``).

Quality depends on how similar adjacent layers are: on synthetic layers that differ by small noise the
shared pair at b bits beats two KIVI layers at b/2 bits (the same bytes), on unrelated layers it loses
(tests/test_xquant.py). SmolLM2's adjacent layers are not that similar: ``veloxquant eval --method xquant
--set xquant:xquant_base_bits=4 --task kld --context 1024`` gives KLD 2.0 at exactly the bytes of KIVI
2-bit (KLD 0.193), the defaults (2-bit shared codes) KLD 2.15 at 0.156x the fp16 bytes (docs/RESULTS.md,
CPU, 2026-12-01): on this model the paper's sharing does not pay.

Deviations: no data-free end-point calibration; least-squares scale / zero point (above);
``xquant_residual_bits`` is validated but not used (a shared layer stores no codes of its own);
``xquant_max_ctx`` is not used (buffers grow). A cache built alone (``KVCacheFactory.create``) is a
base with no partners: KIVI at b bits. Trims are exact only (KIVI's rule) and must be applied to every
layer alike (mlx_lm does).
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_columns, grow_rows
from ...primitives import groupquant as gq
from ..quantization.kivi import KIVI_BITS, RES_DTYPE, KIVIKVCache
from ..layer_links import registry, relink, relinking_state

_BASES = registry()


def _fit_scale_zero(c: mx.array, x: mx.array):
    """Least-squares ``x ~ s * c + z`` along the last axis: float16 ``(s, z)`` [...]."""
    c, x = c.astype(mx.float32), x.astype(mx.float32)
    mc, mx_ = c.mean(axis=-1), x.mean(axis=-1)
    var = (c * c).mean(axis=-1) - mc * mc
    cov = (c * x).mean(axis=-1) - mc * mx_
    s = mx.where(var > 1e-6, cov / mx.where(var > 1e-6, var, 1.0), 0.0).astype(RES_DTYPE)
    z = (mx_ - s.astype(mx.float32) * mc).astype(RES_DTYPE)
    return s, z


@register_with_mlx_lm
@register("xquant")
class XQuantKVCache(KIVIKVCache):
    """XQuant: the base layer of a group stores KIVI codes; the other layers only scales / zero points on them."""
    chunk_invariant = True  # KIVI groups; shared layers fit the base's same group
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    scalar_fields = ("n_quant", "n_res", "dtype_name", "xq_role", "xq_uid")
    attend_path = "dequant"
    xq_role = "base"  # "base" or "shared"
    xq_uid = ""  # group id (one per group per prompt cache)
    base = None  # the group's base cache (shared role)

    def _init_layout(self):
        o = self.config.options  # validation checked the types and ranges; the codes are KIVI's
        for f in ("base_bits", "residual_bits"):
            if getattr(o, f) not in KIVI_BITS:
                raise QuantizerConfigError(f"xquant_{f}", getattr(o, f), "one of 2, 3, 4, 8")
        self.group = o.group_quant_size
        self.qbits = o.base_bits  # the shared codes' width, for every role
        self._call = None

    dequant_only = "its codes are not MLX's affine layout"

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer; groups of ``xquant_group_size`` consecutive layers share the base's codes."""
        out, base = [], None
        for i, cfg in enumerate(layer_configs):
            cache = cls(cfg)
            if i % cfg.options.group_size == 0:
                base = cache
                cache.xq_role, cache.xq_uid = "base", uuid.uuid4().hex
            else:
                cache.xq_role, cache.xq_uid, cache.base = "shared", base.xq_uid, base
            out.append(cache)
        return out

    # ---------------------------------------------------------------- state (relink on load)
    def _relink_loaded(self):
        base = self.xq_role == "base"
        if self.xq_uid or not base:  # a base built alone belongs to no group
            found = relink(_BASES, self.xq_uid, base, lambda: self, "XQuantKVCache: the base layer")
            self.base = None if base else found

    state = relinking_state(lambda cache: cache._relink_loaded())

    # ---------------------------------------------------------------- shared coding
    def _base_codes(self, t0: int, n: int, d: int, dv: int):
        """The base's integer codes (as float32) of quantized tokens [t0, t0 + n): K^T [B, H, D, n], V [B, H, n, Dv]."""
        b = self.base
        if b.n_quant < t0 + n:
            raise RuntimeError("XQuantKVCache: the base layer has not quantized these tokens yet "
                               "(layers of a group must be fed in order, base first)")
        if b.res_k.shape[:2] + (b.res_k.shape[-1], b.res_v.shape[-1]) != self.res_k.shape[:2] + (d, dv):
            raise ValueError(f"XQuantKVCache: a shared layer needs its base layer's shapes; base keys "
                             f"{b.res_k.shape}, values {b.res_v.shape}, this layer head dims ({d}, {dv})")
        G, w, g0, g = b.group, b._key_words(), t0 // b.group, n // b.group
        kc = b.k_codes[..., g0 * w : (g0 + g) * w]
        ones = mx.ones(kc.shape[:-1] + (g,), dtype=RES_DTYPE)
        kt = gq.dequantize(kc, ones, mx.zeros_like(ones), b.qbits, G)  # s = 1, z = 0: the codes themselves
        gv = b.value_group(dv)
        vc = b.v_codes[:, :, t0 : t0 + n]
        ones = mx.ones(vc.shape[:-1] + (dv // gv,), dtype=RES_DTYPE)
        v = gq.dequantize(vc, ones, mx.zeros_like(ones), b.qbits, gv)
        return kt, v

    def _append_groups(self, kb, vb):
        if self.xq_role == "base":
            return super()._append_groups(kb, vb)
        B, H, n, D = kb.shape
        Dv = vb.shape[-1]
        G, t0 = self.group, self.n_quant
        gv = self.value_group(Dv)
        ck, cv = self._base_codes(t0, n, D, Dv)
        g = n // G
        ks, kz = _fit_scale_zero(ck.reshape(B, H, D, g, G), kb.swapaxes(-1, -2).reshape(B, H, D, g, G))
        vs, vz = _fit_scale_zero(cv.reshape(B, H, n, Dv // gv, gv), vb.reshape(B, H, n, Dv // gv, gv))
        self.v_scales = grow_rows(self.v_scales, t0, vs)
        self.v_biases = grow_rows(self.v_biases, t0, vz)
        cap_groups = self.v_scales.shape[2] // G  # keys follow the values' capacity
        self.k_scales = grow_columns(self.k_scales, t0 // G, ks, cap_groups)
        self.k_biases = grow_columns(self.k_biases, t0 // G, kz, cap_groups)
        self.n_quant = t0 + n

    def _owner(self):
        """The cache holding the codes this layer reads: itself (base) or its base (shared)."""
        return self if self.xq_role == "base" else self.base

    def _keys_t(self, n, dtype=mx.float32):
        g, w, o = n // self.group, self._key_words(), self._owner()
        return gq.dequantize(o.k_codes[..., : g * w], self.k_scales[..., :g], self.k_biases[..., :g],
                             self.qbits, self.group, dtype)

    def _values(self, n, dtype=mx.float32):
        gv, o = self.value_group(self.res_v.shape[-1]), self._owner()
        return gq.dequantize(o.v_codes[:, :, :n], self.v_scales[:, :, :n], self.v_biases[:, :, :n],
                             self.qbits, gv, dtype)

    # ---------------------------------------------------------------- accounting
    @property
    def used_nbytes(self) -> int:
        """KIVI's for the base; a shared layer: its float16 scales / zero points and residual, no codes."""
        if self.xq_role == "base" or self.res_k is None:
            return super().used_nbytes
        B, H, _, D = self.res_k.shape
        dv = self.res_v.shape[-1]
        groups = self.n_quant // self.group
        meta = B * H * (D * groups + self.n_quant * (dv // self.value_group(dv))) * 2 * 2
        return meta + self.res_k.nbytes + self.res_v.nbytes
