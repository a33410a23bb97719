"""CacheGen (Liu, Li, Cheng, Ray, Huang, Zhang, Du, Yao, Lu, Ananthanarayanan, Maire, Hoffmann,
Holtzman, Jiang, "CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
Serving", SIGCOMM 2024, arXiv 2310.07240).

Paper ideas used (section 5.1): (1) *token-wise locality*: nearby tokens have similar K/V, so within
a group of tokens the first is an *anchor* and the others are coded as deltas against it; (2)
*layer-wise sensitivity*: shallower layers are more sensitive to loss, so they get more bits; (3)
*arithmetic coding* of the quantized deltas with probability tables grouped by channel and layer.

Algorithm (a ``KIVIKVCache`` subclass: same float16 residual of < G tokens, same
``update_and_fetch``/``attend``; G = ``cachegen_group_size``, b = the layer's bits):

* Layer-wise bits: ``build_layers`` splits the m layers with a full KV cache into
  ``cachegen_layer_groups`` = n contiguous groups (layer i is in group ``i * n // m``) and gives group
  j the bits ``min(8, cachegen_bits + (n - 1 - j))`` in ``cachegen_resolved_bits`` (n = 3, bits 4:
  6 / 5 / 4 bits for the first / middle / last third). A cache built alone uses ``cachegen_bits``.
* Token deltas (``cachegen_use_delta``): for every G-token group the anchor (its first token) is
  quantized per token at 8 bits (channel groups of gcd(D, 32), float16 scale/bias); every token's delta
  against the *dequantized* anchor is quantized at b bits (closed loop: the anchor's error does not
  add to the deltas'), keys per channel over the group (KIVI's layout, transposed), values per token
  in channel groups of gcd(Dv, G). Decoding: anchor + dequantized delta (the anchor row itself is the
  dequantized anchor). Without deltas the tokens are quantized directly (= KIVI at b bits). The
  deltas matter for the per-token value groups (they remove each channel's offset: 2-bit value error
  on a smooth walk with per-channel offsets drops ~10^4x in the test); per-channel key groups already
  remove it through their min, so there the deltas change the error little.
* In memory the codes are fixed-width: b-bit codes bit-packed per group (``primitives.bitpack``),
  which attention (KIVI's ``attend`` through ``_keys_t``/``_values``) dequantizes.
* Saved form (``state``, what ``save_prompt_cache`` writes): the key and value codes are
  entropy-coded by ``primitives.entropy`` (static-frequency ANS by constriction, tables in the stream):
  with ``cachegen_per_channel`` one table per (batch, head, channel) (paper section 5.1.3: grouping
  by channel and layer), otherwise one per (batch, head); scales, biases, anchors and the residual are
  saved as they are. Loading decodes the streams bit-exactly back to the same codes. Coding is
  incremental: mlx_lm reads ``state`` after every prefill chunk, so the groups added since the last
  read are coded as one new *block* (own tables; a ``stream_index`` row of 12 bytes per block) and the
  earlier blocks are reused; a trim drops the blocks that reach past the kept groups.
* Measured sizes (real bytes, never a Shannon estimate): ``compressed_{key,value}_bytes`` = the
  bytes written for the quantized tokens (entropy-coded stream + scales/biases + anchors),
  ``fixed_width_{key,value}_bytes`` = the same with the in-memory fixed-width codes, ``fp16_*`` =
  float16 for the same tokens; ``entropy_savings`` = 1 - compressed/fixed-width (keys);
  ``assigned_avg_bits`` = 8 * compressed key bytes / quantized key elements.

Deviations from the paper (deliberate):

* The paper's delta quantizer (per-layer quantization levels shared across tokens) is replaced by
  group min/max affine codes (KIVI's grouping: keys per channel, values per token) and the anchors by
  8-bit per-token codes. Consequence, measured: min/max-scaled codes of a group spread over all
  levels, so their empirical entropy is close to b bits and the coder saves little (SmolLM2-135M,
  512 essay tokens: saved form 0-6% smaller than fixed width, most at 2 bits; per-(head, channel)
  tables pay off only at long contexts; ``veloxquant cache save``).
* On SmolLM2-135M the value deltas do not help: 2-bit uniform KL 0.157 with deltas vs 0.119 without
  (its values have weak token locality, so x_t - x_anchor has a wider range than x_t); deltas are
  still the default (``cachegen_use_delta=True``, the paper's design).
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys); the newest < G tokens stay in
  float16 (KIVI's residual), the paper codes whole chunks offline.
* Entropy coding is rANS with static per-table frequencies instead of adaptive arithmetic coding; a
  table whose streams do not get shorter than fixed width (table cost included) is stored raw.
* The entropy-coded form is what is saved, not what attention reads (the paper decodes on load as
  well; it streams the bytes over the network instead of saving them).

Trim: KIVI's exact rule (residual tokens + whole groups; anchors are per group), else ``ValueError``.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np

from ..base import register
from ..contract import config_from_json, config_to_json, register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_rows
from ..primitives import bitpack
from ..primitives import entropy
from .kivi import KIVIKVCache
from ..primitives.buffers import grow_columns

ANCHOR_BITS = 8
ANCHOR_CG = 32


def _int(v, lo, hi=None):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)


def layer_bits(n_layers: int, base: int, n_groups: int) -> list[int]:
    """Bits per layer: ``n_groups`` contiguous layer groups, group j gets ``min(8, base + n_groups-1-j)``."""
    return [min(8, base + (n_groups - 1 - (i * n_groups // n_layers))) for i in range(n_layers)]


def _quant(xg: mx.array, bits: int):
    """Min/max affine codes of ``xg [..., G]`` along the last axis: (packed words [..., w], f16 scale
    [...], f16 bias [...])."""
    levels = float((1 << bits) - 1)
    lo, hi = xg.min(axis=-1), xg.max(axis=-1)
    scale = ((hi - lo) / levels).astype(mx.float16)
    bias = lo.astype(mx.float16)
    s = scale.astype(mx.float32)[..., None]
    q = mx.clip(mx.round((xg - bias.astype(mx.float32)[..., None]) / mx.where(s > 0, s, 1.0)), 0.0, levels)
    return bitpack.pack_bits(q.astype(mx.uint32), bits), scale, bias


def _dequant(words: mx.array, scale: mx.array, bias: mx.array, bits: int, g: int) -> mx.array:
    q = bitpack.unpack_bits(words, bits, g).astype(mx.float32)
    return q * scale.astype(mx.float32)[..., None] + bias.astype(mx.float32)[..., None]


@register_with_mlx_lm
@register("cachegen")
class CacheGenKVCache(KIVIKVCache):
    """CacheGen: anchor + token-delta codes, layer-wise bits, entropy-coded saved form."""
    chunk_invariant = True  # per-group anchors and codes, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases",
                    "ka_codes", "ka_scales", "ka_biases", "va_codes", "va_scales", "va_biases", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name")

    #: save the entropy-coded form (False: the fixed-width codes, for comparisons)
    save_entropy_coded = True
    _blocks: list = []  # encoded blocks: (first group, end group, key stream, value stream) numpy

    def _init_layout(self):
        c = self.config
        if not _int(c.cachegen_bits, 1, 8):
            raise QuantizerConfigError("cachegen_bits", c.cachegen_bits, "an int in 1..8")
        if c.cachegen_resolved_bits is not None and not _int(c.cachegen_resolved_bits, 1, 8):
            raise QuantizerConfigError("cachegen_resolved_bits", c.cachegen_resolved_bits, "None or an int in 1..8")
        if not _int(c.cachegen_group_size, 2, 1024):
            raise QuantizerConfigError("cachegen_group_size", c.cachegen_group_size, "an int in 2..1024")
        if not _int(c.cachegen_layer_groups, 1):
            raise QuantizerConfigError("cachegen_layer_groups", c.cachegen_layer_groups, "an int >= 1")
        for f in ("cachegen_use_delta", "cachegen_per_channel"):
            if not isinstance(getattr(c, f), bool):
                raise QuantizerConfigError(f, getattr(c, f), "a bool")
        self.qbits = int(c.cachegen_bits if c.cachegen_resolved_bits is None else c.cachegen_resolved_bits)
        self.group = int(c.cachegen_group_size)
        self.use_delta = c.cachegen_use_delta
        self._call = None
        self._blocks = []

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer with its ``cachegen_resolved_bits`` from the layer-wise schedule."""
        if not layer_configs:
            return []
        c = layer_configs[0]
        cls(c)  # validates the shared fields
        bits = layer_bits(len(layer_configs), c.cachegen_bits, c.cachegen_layer_groups)
        return [cls(cfg.replace(cachegen_resolved_bits=b)) for cfg, b in zip(layer_configs, bits)]

    def _uses_qmm(self) -> bool:
        return False  # delta codes: not MLX's affine layout

    def _key_words(self) -> int:
        return bitpack.packed_words(self.group, self.qbits)

    def _acg(self, d: int) -> int:
        return math.gcd(d, ANCHOR_CG)

    # ---------------------------------------------------------------- encode
    def _anchor(self, a: mx.array):
        """8-bit per-token codes of anchors [B, H, g, d] and their dequantized rows."""
        B, H, g, d = a.shape
        cg = self._acg(d)
        w, s, b = _quant(a.reshape(B, H, g, d // cg, cg), ANCHOR_BITS)
        deq = _dequant(w, s, b, ANCHOR_BITS, cg).reshape(B, H, g, d)
        return (w.reshape(B, H, g, -1), s, b), deq

    def _append_groups(self, kb, vb):
        G, bits = self.group, self.qbits
        B, H, n, D = kb.shape
        Dv = vb.shape[-1]
        g, t0 = n // G, self.n_quant
        g0 = t0 // G
        kf = kb.astype(mx.float32).reshape(B, H, g, G, D)
        vf = vb.astype(mx.float32).reshape(B, H, g, G, Dv)
        if self.use_delta:
            kaq, ka = self._anchor(kf[:, :, :, 0])
            vaq, va = self._anchor(vf[:, :, :, 0])
            kf = kf - ka[:, :, :, None]
            vf = vf - va[:, :, :, None]
            for name, arr in zip(("ka_codes", "ka_scales", "ka_biases", "va_codes", "va_scales", "va_biases"),
                                 (*kaq, *vaq)):
                setattr(self, name, grow_rows(getattr(self, name), g0, arr))
        # keys per channel over the group: [B, H, D, g, G]
        kw, ks, kbias = _quant(kf.transpose(0, 1, 4, 2, 3), bits)
        gv = self.value_group(Dv)
        vw, vs, vbias = _quant(vf.reshape(B, H, n, Dv // gv, gv), bits)
        self.v_codes = grow_rows(self.v_codes, t0, vw.reshape(B, H, n, -1))
        self.v_scales = grow_rows(self.v_scales, t0, vs)
        self.v_biases = grow_rows(self.v_biases, t0, vbias)
        cap = self.v_codes.shape[2] // G
        w = self._key_words()
        self.k_codes = grow_columns(self.k_codes, g0 * w, kw.reshape(B, H, D, g * w), cap * w)
        self.k_scales = grow_columns(self.k_scales, g0, ks, cap)
        self.k_biases = grow_columns(self.k_biases, g0, kbias, cap)
        self.n_quant = t0 + n

    # ---------------------------------------------------------------- decode
    def _with_anchor(self, x: mx.array, side: str, g: int) -> mx.array:
        """``x [B, H, g, G, d]`` deltas -> rows (anchor + delta; the anchor row is the anchor)."""
        if not self.use_delta:
            return x
        B, H, _, G, d = x.shape
        cg = self._acg(d)
        a = _dequant(getattr(self, f"{side}a_codes")[:, :, :g].reshape(B, H, g, d // cg, -1),
                     getattr(self, f"{side}a_scales")[:, :, :g], getattr(self, f"{side}a_biases")[:, :, :g],
                     ANCHOR_BITS, cg).reshape(B, H, g, 1, d)
        not_anchor = (mx.arange(G) > 0).astype(mx.float32)[:, None]
        return a + x * not_anchor

    def _keys_t(self, n, dtype=mx.float32):
        G = self.group
        g = n // G
        B, H, D = self.k_codes.shape[:3]
        w = self._key_words()
        x = _dequant(self.k_codes[..., : g * w].reshape(B, H, D, g, w), self.k_scales[..., :g],
                     self.k_biases[..., :g], self.qbits, G)  # [B, H, D, g, G]
        x = self._with_anchor(x.transpose(0, 1, 3, 4, 2), "k", g)  # [B, H, g, G, D]
        return x.reshape(B, H, n, D).swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        G = self.group
        B, H = self.v_codes.shape[:2]
        Dv = self.res_v.shape[-1]
        gv = self.value_group(Dv)
        x = _dequant(self.v_codes[:, :, :n].reshape(B, H, n, Dv // gv, -1), self.v_scales[:, :, :n],
                     self.v_biases[:, :, :n], self.qbits, gv)
        x = self._with_anchor(x.reshape(B, H, n // G, G, Dv), "v", n // G)
        return x.reshape(B, H, n, Dv).astype(dtype)

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        g = self.n_quant // self.group  # encoded blocks reaching past the kept groups are dropped
        self._blocks = [b for b in self._blocks if b[1] <= g]
        return dropped

    # ---------------------------------------------------------------- entropy-coded form
    def _symbols(self, g0: int, g1: int):
        """(key codes [B*H*D, n], value codes [B*H*Dv, n]) of groups [g0, g1) as uint8 numpy, one
        stream per channel."""
        G, b = self.group, self.qbits
        n = (g1 - g0) * G
        B, H, D = self.k_codes.shape[:3]
        Dv = self.res_v.shape[-1]
        gv = self.value_group(Dv)
        w = self._key_words()
        kc = bitpack.unpack_bits(self.k_codes[..., g0 * w : g1 * w].reshape(B, H, D, g1 - g0, w), b, G)
        vc = bitpack.unpack_bits(self.v_codes[:, :, g0 * G : g1 * G].reshape(B, H, n, Dv // gv, -1), b, gv)
        vc = vc.reshape(B, H, n, Dv).transpose(0, 1, 3, 2)
        return np.array(kc.reshape(B * H * D, n)), np.array(vc.reshape(B * H * Dv, n))

    def _tables(self, B, H, d):
        """Stream -> table map for B*H*d channel streams: per channel, or per (batch, head)."""
        if self.config.cachegen_per_channel:
            return np.arange(B * H * d), B * H * d
        return np.arange(B * H * d) // d, B * H

    def _encoded(self) -> list:
        """The entropy-coded blocks covering every quantized group. Groups added since the last call
        are coded as one new block (tables per block), so reading ``state`` after every prefill chunk
        (mlx_lm does) codes each group once."""
        g = self.n_quant // self.group
        end = self._blocks[-1][1] if self._blocks else 0
        if end < g:
            kc, vc = self._symbols(end, g)
            B, H, D = self.k_codes.shape[:3]
            Dv = self.res_v.shape[-1]
            self._blocks = self._blocks + [(end, g, entropy.encode(kc, self.qbits, *self._tables(B, H, D)),
                                            entropy.encode(vc, self.qbits, *self._tables(B, H, Dv)))]
        return self._blocks

    def _side(self, side: str) -> list:
        """Used parts of the arrays saved as they are (scales, biases, anchors) for ``side``."""
        G, n = self.group, self.n_quant
        g = n // G
        if side == "k":
            out = [self.k_scales[..., :g], self.k_biases[..., :g]]
        else:
            out = [self.v_scales[:, :, :n], self.v_biases[:, :, :n]]
        if self.use_delta:
            out += [getattr(self, f"{side}a_{a}")[:, :, :g] for a in ("codes", "scales", "biases")]
        return out

    def _fixed_codes_bytes(self, side: str) -> int:
        if self.n_quant == 0:
            return 0
        if side == "k":
            return self.k_codes[..., : (self.n_quant // self.group) * self._key_words()].nbytes
        return self.v_codes[:, :, : self.n_quant].nbytes

    @property
    def compressed_key_bytes(self) -> int:
        """Bytes written for the quantized keys: entropy-coded streams + block index share + side info."""
        if self.n_quant == 0:
            return 0
        blocks = self._encoded()
        return sum(len(b[2]) for b in blocks) + 8 * len(blocks) + sum(a.nbytes for a in self._side("k"))

    @property
    def compressed_value_bytes(self) -> int:
        if self.n_quant == 0:
            return 0
        blocks = self._encoded()
        return sum(len(b[3]) for b in blocks) + 4 * len(blocks) + sum(a.nbytes for a in self._side("v"))

    @property
    def fixed_width_key_bytes(self) -> int:
        return 0 if self.n_quant == 0 else self._fixed_codes_bytes("k") + sum(a.nbytes for a in self._side("k"))

    @property
    def fixed_width_value_bytes(self) -> int:
        return 0 if self.n_quant == 0 else self._fixed_codes_bytes("v") + sum(a.nbytes for a in self._side("v"))

    @property
    def fp16_key_bytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return B * H * self.n_quant * D * 2

    @property
    def fp16_value_bytes(self) -> int:
        if self.res_v is None:
            return 0
        B, H, _, Dv = self.res_v.shape
        return B * H * self.n_quant * Dv * 2

    @property
    def entropy_savings(self) -> float:
        """1 - compressed / fixed-width bytes of the key side (both include the same side info)."""
        f = self.fixed_width_key_bytes
        return 1.0 - self.compressed_key_bytes / f if f else 0.0

    @property
    def assigned_avg_bits(self) -> float:
        """Bits per quantized key element in the saved (entropy-coded) form, side info included."""
        e = self.fp16_key_bytes // 2
        return 8.0 * self.compressed_key_bytes / e if e else 0.0

    @property
    def state(self):
        if not self.save_entropy_coded or self.n_quant == 0:
            return super().state
        B, H, D = self.k_codes.shape[:3]
        meta = {"config": config_to_json(self.config), "offset": self.offset,
                "scalars": {n: getattr(self, n) for n in self.scalar_fields},
                "shape": list(getattr(self, "_shape", None) or []), "entropy": [B, H, D]}
        blocks = self._encoded()
        index = np.array([[b[1], len(b[2]), len(b[3])] for b in blocks], dtype=np.uint32)
        out = {"meta": json.dumps(meta), "stream_index": mx.array(index),
               "k_stream": mx.array(np.concatenate([b[2] for b in blocks])),
               "v_stream": mx.array(np.concatenate([b[3] for b in blocks])),
               "res_k": self.res_k, "res_v": self.res_v}
        names = ["scales", "biases"] + (["a_codes", "a_scales", "a_biases"] if self.use_delta else [])
        for side in "kv":
            for nm, arr in zip(names, self._side(side)):
                out[f"{side}_{nm}" if not nm.startswith("a_") else f"{side}{nm}"] = arr
        return out

    @state.setter
    def state(self, v):
        meta = json.loads(v["meta"])
        if "entropy" not in meta:
            KIVIKVCache.state.fset(self, v)
            self._blocks = []
            return
        self.config = config_from_json(meta["config"])
        self._init_layout()
        self.offset = meta["offset"]
        for k, val in meta["scalars"].items():
            setattr(self, k, val)
        self._shape = tuple(meta["shape"]) or None
        for name in self.array_fields:
            setattr(self, name, v.get(name))
        B, H, D = meta["entropy"]
        Dv = self.res_v.shape[-1]
        G, b = self.group, self.qbits
        gv = self.value_group(Dv)
        ks, vs = np.array(v["k_stream"]), np.array(v["v_stream"])
        index = np.array(v["stream_index"]).astype(np.int64)
        kp = np.concatenate([[0], np.cumsum(index[:, 1])])
        vp = np.concatenate([[0], np.cumsum(index[:, 2])])
        blocks, kcs, vcs, g0 = [], [], [], 0
        for i, (g1, _, _) in enumerate(index):  # one step per saved block
            n = int(g1 - g0) * G
            kb, vb = ks[kp[i] : kp[i + 1]], vs[vp[i] : vp[i + 1]]
            kcs.append(entropy.decode(kb, B * H * D, n, b, *self._tables(B, H, D)).reshape(B, H, D, n))
            vcs.append(entropy.decode(vb, B * H * Dv, n, b, *self._tables(B, H, Dv)).reshape(B, H, Dv, n))
            blocks.append((g0, int(g1), kb, vb))
            g0 = int(g1)
        n = self.n_quant
        kc = mx.array(np.concatenate(kcs, axis=-1)).reshape(B, H, D, n // G, G)
        self.k_codes = bitpack.pack_bits(kc, b).reshape(B, H, D, -1)
        vc = mx.array(np.concatenate(vcs, axis=-1)).swapaxes(-1, -2).reshape(B, H, n, Dv // gv, gv)
        self.v_codes = bitpack.pack_bits(vc, b).reshape(B, H, n, -1)
        self._blocks = blocks

    # ---------------------------------------------------------------- accounting
    @property
    def used_nbytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        Dv = self.res_v.shape[-1]
        G, b = self.group, self.qbits
        g = self.n_quant // G
        gv = self.value_group(Dv)
        key = B * H * D * g * (4 * self._key_words() + 4)
        value = B * H * self.n_quant * (Dv // gv) * (4 * bitpack.packed_words(gv, b) + 4)
        anchors = 0
        if self.use_delta:
            for d in (D, Dv):
                cg = self._acg(d)
                anchors += B * H * g * (d // cg) * (4 * bitpack.packed_words(cg, ANCHOR_BITS) + 4)
        return key + value + anchors + self.res_k.nbytes + self.res_v.nbytes

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """Fixed-width bytes per token per head: b-bit codes + f16 scale/bias per group, + the
        per-group 8-bit anchors (codes + scale/bias per channel group of gcd(d, 32)) / G."""
        G, b = self.group, self.qbits
        gv = math.gcd(dv, G)
        per = (b * d / 8 + 4 * d / G) + (b * dv / 8 + 4 * dv / gv)
        if self.use_delta:
            per += sum((d_ + 4 * d_ / self._acg(d_)) / G for d_ in (d, dv))
        return per
