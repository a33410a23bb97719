"""XQuant (Yang, Yao, Li, Qi, Liu, Zhao, "XQuant: Achieving Ultra-Low Bit KV Cache Quantization with Cross-Layer
Compression", EMNLP 2025, arXiv 2510.11236): in a pair of adjacent layers the lower is quantized as usual and the
higher stores only scales and zero points that it applies to the lower layer's codes. Here, in each group of
``xquant_group_size`` layers, the base is a KIVI cache at ``xquant_base_bits``; the others hold no codes, only
float16 ``s``, ``z`` per KIVI group (``s * c + z`` of the base's codes ``c``) and their own float16 residual. Groups
are linked per ``for_model`` call by a fresh id, relinked by ``load_prompt_cache`` (the base loads first).

Quality needs similar adjacent layers (tests/test_xquant.py: a pair at b bits beats two KIVI layers at b/2 on
near-identical synthetic layers, loses on unrelated ones); SmolLM2's are not (docs/RESULTS.md: KLD 2.0 at KIVI
2-bit's bytes, where KIVI has 0.193).

Deviations: no data-free end-point calibration; ``s, z`` are the least-squares fit on ``c`` (the paper: the
layer's own min / max; never worse for the given codes); ``xquant_residual_bits`` is validated, unused;
``xquant_max_ctx`` unused (buffers grow); a cache built alone is a base; trims are KIVI's and must hit every layer
alike (mlx_lm does).
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import groupquant as gq
from ...primitives.buffers import grow_columns, grow_rows
from ...window import Partials
from ..layer_links import relink, relinking_state
from ..quantization.kivi import RES_DTYPE, KIVIKVCache


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
    chunk_invariant, exact_trim = True, False  # KIVI groups; KIVI's trim (raises past a group)
    scalar_fields = ("n_quant", "n_res", "dtype_name", "xq_role", "xq_uid")
    attend_path = "dequant"
    xq_role = "base"  # "base" or "shared"
    xq_uid = ""  # group id (one per group per prompt cache)
    base = None  # the group's base cache (shared role)

    def _init_layout(self):
        o = self.config.options
        self.group, self.qbits = o.group_quant_size, o.base_bits  # qbits: every role's width

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

    def _relink_loaded(self):
        base = self.xq_role == "base"
        if self.xq_uid or not base:  # a base built alone belongs to no group
            found = relink(self.xq_uid, base, lambda: self, "XQuantKVCache: the base layer")
            self.base = None if base else found

    state = relinking_state()

    def _base_codes(self, t0: int, n: int, d: int, dv: int):
        """The base's codes (float32) of quantized tokens [t0, t0 + n): K^T [B, H, D, n], V [B, H, n, Dv]."""
        b = self.base
        if b.n_quant < t0 + n:
            raise RuntimeError("XQuantKVCache: the base layer has not quantized these tokens yet "
                               "(layers of a group must be fed in order, base first)")
        if b.res_k.shape[:2] + (b.res_k.shape[-1], b.res_v.shape[-1]) != self.res_k.shape[:2] + (d, dv):
            raise ValueError(f"XQuantKVCache: a shared layer needs its base layer's shapes; base keys "
                             f"{b.res_k.shape}, values {b.res_v.shape}, this layer head dims ({d}, {dv})")
        w, g0, g, gv = b._key_words(), t0 // b.group, n // b.group, b.value_group(dv)

        def codes(c, group, n_groups):  # s = 1, z = 0: the codes themselves
            ones = mx.ones(c.shape[:-1] + (n_groups,), dtype=RES_DTYPE)
            return gq.dequantize(c, ones, mx.zeros_like(ones), b.qbits, group)

        return (codes(b.k_codes[..., g0 * w : (g0 + g) * w], b.group, g),
                codes(b.v_codes[:, :, t0 : t0 + n], gv, dv // gv))

    def _append_groups(self, kb, vb):
        if self.xq_role == "base":
            return super()._append_groups(kb, vb)
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        G, t0, gv = self.group, self.n_quant, self.value_group(Dv)
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

    # the cache holding the codes this layer reads: itself (base) or its base (shared)
    _owner = property(lambda self: self if self.xq_role == "base" else self.base)

    def _keys_t(self, n, dtype=mx.float32):
        g, w, o = n // self.group, self._key_words(), self._owner
        return gq.dequantize(o.k_codes[..., : g * w], self.k_scales[..., :g], self.k_biases[..., :g],
                             self.qbits, self.group, dtype)

    def _values(self, n, dtype=mx.float32):
        gv, o = self.value_group(self.res_v.shape[-1]), self._owner
        return gq.dequantize(o.v_codes[:, :, :n], self.v_scales[:, :, :n], self.v_biases[:, :, :n],
                             self.qbits, gv, dtype)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel over the owner's codes with this layer's scales and biases

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """KIVI's kernel's layouts (``attend_path`` "dequant" names the op path's decoding, not a user's choice)."""
        return (native.available() and self.qbits in (2, 4, 8) and self.group % 32 == 0
                and self.value_group(dv) % 8 == 0 and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` quantized tokens' partials by KIVI's CPU kernel: the group's one set of codes (the
        base's), this layer's own ``s``, ``z`` as the kernel's scales and biases (``s * c + z``: KIVI's decoding)."""
        o, dv = self._owner, self.res_v.shape[-1]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            qf, o.k_codes, self.k_scales, self.k_biases, o.v_codes, self.v_scales, self.v_biases, n, self.qbits,
            self.group, self.value_group(dv), dv)
        return Partials(m, l, acc)

    def _code_nbytes(self, B, H, D, dv):
        """KIVI's for the base; a shared layer holds only its float16 scales / zero points, no codes."""
        if self.xq_role == "base":
            return super()._code_nbytes(B, H, D, dv)
        return B * H * (D * (self.n_quant // self.group) + self.n_quant * (dv // self.value_group(dv))) * 2 * 2
