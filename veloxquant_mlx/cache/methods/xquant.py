"""XQuant-style cross-layer residual quantization (after Yang, Yao, Li, Qi, Liu, Zhao, "XQuant:
Achieving Ultra-Low Bit KV Cache Quantization with Cross-Layer Compression", arXiv 2510.11236).

Paper: adjacent layers' KV caches are similar, so layers are paired and the higher layer of a pair
reuses the lower layer's quantized cache (storing only its own scales / zero points), plus a
data-free calibration of the quantizer's end points. This module implements the cross-layer reuse
as this project specifies it (``xquant_group_size`` g, ``xquant_base_bits``,
``xquant_residual_bits``, ``xquant_group_quant_size`` G):

* The full-KV layers of a model are split into groups of g consecutive layers. The first layer of a
  group (the *base*) is stored as KIVI codes at ``xquant_base_bits`` (keys per channel, values per
  token, groups of G, float16 residual of < G tokens: ``KIVIKVCache``). Every other layer of the
  group stores only the *residual* against the base's dequantized rows of the same tokens,
  ``X_l - Q_b(X_base)``, as KIVI codes at ``xquant_residual_bits``; it reads back
  ``Q_b(X_base) + Q_r(X_l - Q_b(X_base))``.
* A coordinator built by ``build_layers`` links the caches of a group; its lifetime is one prompt
  cache (``KVCacheBuilder.for_model`` call): two prompt caches never share state (a fresh group id
  per call). The base's arrays are held (and counted in ``nbytes``) once, by the base cache; residual
  caches count only their own codes. ``save_prompt_cache``/``load_prompt_cache`` relink a group by
  its id when the base (an earlier layer) has been loaded first, which ``load_prompt_cache``'s
  layer order guarantees; ``deepcopy`` of the cache list keeps the links within the copy.
* Attention: KIVI's attend (dispatch point) with the residual layer's ``_keys_t`` / ``_values``
  = base + residual dequantized; mlx_lm runs layer l after the base layer of its group, so the base
  has always stored (at least) the same quantized tokens.

Measured (scripts/quality_lowrank.py, SmolLM2-135M, 512-token essay context + 32 scored steps,
identical bytes in each pair of rows): pairs with base 2-bit / residual 4-bit: KL 0.118 vs 0.126 for
KIVI quantizing each layer alone at the same 2,4,2,4,... bits; base 4 / residual 4: 0.0082 vs 0.0074
for KIVI 4-bit. Cross-layer reuse is neutral here (within noise): adjacent SmolLM2 layers' K/V are
not similar enough for the residual to have a smaller range than the layer itself. On synthetic,
strongly correlated layers it helps a lot, on unrelated layers it hurts (tests/test_lowrank.py).

Deviations: the paper shares the base layer's *codes* and stores new scales / zero points for the
higher layer (and calibrates end points data-free); here the higher layer stores a quantized residual
(the project's specification), no calibration; ``xquant_max_ctx`` is not used (buffers grow). A
cache built alone (``KVCacheFactory.create``) is a base with no partners: KIVI at the base bits.
Trims are exact only (KIVI's rule) and must be applied to every layer alike (mlx_lm does).
"""

from __future__ import annotations

import uuid
import weakref

import mlx.core as mx

from ..base import register
from ..contract import CompressedKVCache, register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives import groupquant as gq
from .kivi import KIVI_BITS, KIVIKVCache

_BASES: "weakref.WeakValueDictionary[str, XQuantKVCache]" = weakref.WeakValueDictionary()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@register_with_mlx_lm
@register("xquant")
class XQuantKVCache(KIVIKVCache):
    """Cross-layer residual KIVI: base layer at base bits, the others as residuals against it."""
    chunk_invariant = True  # KIVI groups; residual layers code against the base's same group
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    scalar_fields = ("n_quant", "n_res", "dtype_name", "xq_role", "xq_uid")
    attend_path = "dequant"
    xq_role = "base"  # "base" or "residual"
    xq_uid = ""  # group id (one per group per prompt cache)
    base = None  # the group's base cache (residual role)

    def _init_layout(self):
        c = self.config
        if not _is_int(c.xquant_group_size) or c.xquant_group_size < 1:
            raise QuantizerConfigError("xquant_group_size", c.xquant_group_size, "a positive int (layers per group)")
        for f in ("xquant_base_bits", "xquant_residual_bits"):
            b = getattr(c, f)
            if not _is_int(b) or b not in KIVI_BITS:
                raise QuantizerConfigError(f, b, "one of 2, 3, 4, 8")
        if not _is_int(c.xquant_group_quant_size) or c.xquant_group_quant_size < 1:
            raise QuantizerConfigError("xquant_group_quant_size", c.xquant_group_quant_size, "a positive int")
        self.group = int(c.xquant_group_quant_size)
        self._call = None

    @property
    def qbits(self) -> int:
        c = self.config
        return int(c.xquant_base_bits if self.xq_role == "base" else c.xquant_residual_bits)

    def _uses_qmm(self) -> bool:
        return False

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer; groups of ``xquant_group_size`` consecutive layers share a base."""
        out, base = [], None
        for i, cfg in enumerate(layer_configs):
            cache = cls(cfg)
            if i % cfg.xquant_group_size == 0:
                base = cache
                cache.xq_role, cache.xq_uid = "base", uuid.uuid4().hex
            else:
                cache.xq_role, cache.xq_uid, cache.base = "residual", base.xq_uid, base
            out.append(cache)
        return out

    # ---------------------------------------------------------------- state (relink on load)
    @property
    def state(self):
        return CompressedKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        CompressedKVCache.state.fset(self, v)
        if self.xq_role == "base":
            if self.xq_uid:
                _BASES[self.xq_uid] = self
        else:
            base = _BASES.get(self.xq_uid)
            if base is None:
                raise ValueError(f"XQuantKVCache: the base layer of group {self.xq_uid} must be loaded first")
            self.base = base

    # ---------------------------------------------------------------- residual coding
    def _base_rows(self, t0: int, n: int):
        """The base's dequantized (K, V) [B, H, n, D] of quantized tokens [t0, t0 + n)."""
        b = self.base
        if b.n_quant < t0 + n:
            raise RuntimeError("XQuantKVCache: the base layer has not stored these tokens yet "
                               "(layers of a group must be fed in order, base first)")
        G, w, g0, g = b.group, b._key_words(), t0 // b.group, n // b.group
        kt = gq.dequantize(b.k_codes[..., g0 * w : (g0 + g) * w], b.k_scales[..., g0 : g0 + g],
                           b.k_biases[..., g0 : g0 + g], b.qbits, G)
        dv = b.res_v.shape[-1]
        v = gq.dequantize(b.v_codes[:, :, t0 : t0 + n], b.v_scales[:, :, t0 : t0 + n],
                          b.v_biases[:, :, t0 : t0 + n], b.qbits, b.value_group(dv))
        return kt.swapaxes(-1, -2), v

    def _append_groups(self, kb, vb):
        if self.xq_role == "residual":
            bk, bv = self._base_rows(self.n_quant, kb.shape[2])
            kb = kb.astype(mx.float32) - bk
            vb = vb.astype(mx.float32) - bv
        super()._append_groups(kb, vb)

    def _keys_t(self, n, dtype=mx.float32):
        own = super()._keys_t(n, dtype)
        return own if self.xq_role == "base" else own + self.base._keys_t(n, dtype)

    def _values(self, n, dtype=mx.float32):
        own = super()._values(n, dtype)
        return own if self.xq_role == "base" else own + self.base._values(n, dtype)
