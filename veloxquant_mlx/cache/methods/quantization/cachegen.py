"""CacheGen (Liu, Li, Cheng, Ray, Huang, Zhang, Du, Yao, Lu, Ananthanarayanan, Maire, Hoffmann, Holtzman, Jiang,
SIGCOMM 2024, arXiv 2310.07240), section 5.1: token-wise locality (a group's first token is an anchor, the others
deltas against it), layer-wise sensitivity (shallower layers get more bits), arithmetic coding of the codes with
tables grouped by channel and layer.

On KIVI's layout (G = ``cachegen_group_size``): ``build_layers`` gives the j-th of n = ``cachegen_layer_groups``
contiguous layer groups ``min(8, cachegen_bits + n - 1 - j)`` bits. With ``cachegen_use_delta`` a group's anchor
is coded per token at 8 bits and the deltas against the *dequantized* anchor at the layer's bits (closed loop);
without, this is KIVI. Attention dequantizes the fixed-width codes; ``state`` (the saved form) entropy-codes them
(``primitives.entropy``, static ANS; tables per (batch, head, channel) with ``cachegen_per_channel``, else per
(batch, head)), bit-exact on load; groups added since the last read form one new block.

Deviations from the paper:

* Group min/max affine codes (KIVI's grouping) replace the per-layer delta levels, 8-bit per-token codes its
  anchors; such codes spread over all levels, so the coder saves little (SmolLM2-135M, 512 essay tokens: 0-6%
  below fixed width; ``veloxquant cache save``).
* Value deltas do not help on SmolLM2-135M (2-bit KL 0.157 with, 0.119 without: weak token locality); they stay
  the default (the paper's design).
* Keys are quantized after RoPE; the newest < G tokens stay float16 (the paper codes whole chunks offline).
* rANS with static per-table frequencies, not adaptive arithmetic coding; a table whose streams are not shorter
  than fixed width is stored raw. The entropy-coded form is what is saved, not what attention reads.
* Trim: KIVI's rule (residual tokens + whole groups), else ``ValueError``.

A CPU decode step reads the codes once in KVQuant's kernel (``native/kvquant_cpu.cpp``, uniform levels): each 64-row
block's deltas decoded at the layer's width, each group's anchor decoded and put in its first row, added to the
others (the op path decodes the whole past every step).
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...kernels.waterfill import rope_tables
from ...primitives import bitpack, entropy
from ...primitives import groupquant as gq
from ...primitives.buffers import grow_rows
from ...window import Partials
from .kivi import KIVIKVCache

ANCHOR_BITS = 8
ANCHOR_CG = 32


def layer_bits(n_layers: int, base: int, n_groups: int) -> list[int]:
    """Bits per layer: ``n_groups`` contiguous layer groups, group j gets ``min(8, base + n_groups-1-j)``."""
    return [min(8, base + (n_groups - 1 - (i * n_groups // n_layers))) for i in range(n_layers)]


@register_with_mlx_lm
@register("cachegen")
class CacheGenKVCache(KIVIKVCache):
    """CacheGen: anchor + token-delta codes, layer-wise bits, entropy-coded saved form."""
    chunk_invariant = True  # per-group anchors and codes, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases",
                    "ka_codes", "ka_scales", "ka_biases", "va_codes", "va_scales", "va_biases", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "qbits")  # qbits: the layer's width
    dequant_only = "delta codes"
    save_entropy_coded = True  # False: save the fixed-width codes (for comparisons)
    _blocks: list = []  # encoded blocks: (first group, end group, key stream, value stream) numpy

    def __init__(self, config, bits: int | None = None):
        self._layer_bits = bits  # this layer's width from ``build_layers``' schedule (None: the config's)
        super().__init__(config)

    def _init_layout(self):
        c, o = self.config, self.config.options
        self.qbits = int(self.__dict__.get("_layer_bits") or c.cachegen_resolved_bits or o.bits)
        self.group, self.use_delta = o.group_size, o.use_delta
        self._blocks = []

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer, its bits from the layer-wise schedule (the configs stay as given)."""
        if not layer_configs:
            return []
        o = layer_configs[0].options
        return [cls(cfg, b) for cfg, b in zip(layer_configs, layer_bits(len(layer_configs), o.bits, o.layer_groups))]

    def _acg(self, d: int) -> int:
        return math.gcd(d, ANCHOR_CG)

    def _append_groups(self, kb, vb):
        """8-bit per-token anchors and the deltas against them (keys per channel over the group, values per token)."""
        G, bits = self.group, self.qbits
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        g, t0 = n // G, self.n_quant
        g0 = t0 // G
        kf, vf = (x.astype(mx.float32).reshape(B, H, g, G, x.shape[-1]) for x in (kb, vb))
        if self.use_delta:
            for side, x in (("k", kf), ("v", vf)):
                aq = gq.quantize(x[:, :, :, 0], ANCHOR_BITS, self._acg(x.shape[-1]), reference=True)
                for name, arr in zip(("codes", "scales", "biases"), aq):
                    setattr(self, f"{side}a_{name}", grow_rows(getattr(self, f"{side}a_{name}"), g0, arr))
            kf, vf = (x - self._anchors(side, g0, g0 + g, x.shape[-1]) for side, x in (("k", kf), ("v", vf)))
        kq = gq.quantize(kf.transpose(0, 1, 4, 2, 3).reshape(B, H, D, n), bits, G, reference=True)
        vq = gq.quantize(vf.reshape(B, H, n, Dv), bits, self.value_group(Dv), reference=True)
        self._append_codes(t0, kq, vq)
        self.n_quant = t0 + n

    def _anchors(self, side: str, g0: int, g1: int, d: int) -> mx.array:
        """Dequantized anchors of groups [g0, g1) as [B, H, g, 1, d]."""
        a = [getattr(self, f"{side}a_{name}")[:, :, g0:g1] for name in ("codes", "scales", "biases")]
        return gq.dequantize(*a, ANCHOR_BITS, self._acg(d))[:, :, :, None]

    def _with_anchor(self, x: mx.array, side: str, g: int) -> mx.array:
        """``x [B, H, g, G, d]`` deltas -> rows (anchor + delta; the anchor row is the anchor)."""
        if not self.use_delta:
            return x
        not_anchor = (mx.arange(x.shape[3]) > 0).astype(mx.float32)[:, None]
        return self._anchors(side, 0, g, x.shape[-1]) + x * not_anchor

    def _keys_t(self, n, dtype=mx.float32):
        B, H, D = self.k_codes.shape[:3]
        g = n // self.group
        x = super()._keys_t(n).reshape(B, H, D, g, self.group)
        x = self._with_anchor(x.transpose(0, 1, 3, 4, 2), "k", g)  # [B, H, g, G, D]
        return x.reshape(B, H, n, D).swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        B, H, _, Dv = self.res_v.shape
        x = self._with_anchor(super()._values(n).reshape(B, H, n // self.group, self.group, Dv), "v", n // self.group)
        return x.reshape(B, H, n, Dv).astype(dtype)

    def _cpu_layout(self) -> bool:
        """The CPU kernel reads CacheGen's codes (KVQuant's kernel, uniform levels and anchors: ``_cpu_part``)."""
        return True

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes ``kvquant_decode`` reads: 2-6- or 8-bit deltas in groups of 32k tokens, value groups of whole words,
        anchors a scale per whole words of one width on both sides, head dims up to 256, up to 32 query heads."""
        return (native.available() and self.attend_path == "auto" and self.qbits in (2, 3, 4, 5, 6, 8)
                and self.group % 32 == 0 and self.value_group(dv) * self.qbits % 32 == 0
                and (not self.use_delta or (self._acg(d) % 4 == 0 and self._acg(d) == self._acg(dv)))
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` quantized tokens' partials by the CPU kernel (``native/kvquant_cpu.cpp``'s uniform form):
        each block's delta codes decoded once, each group's anchor put in its first row and added to the others."""
        B, H, _, D = qf.shape
        dv = self.res_v.shape[-1]
        none = mx.zeros((B, H, 0), mx.uint16), mx.zeros((B, H, 0), mx.float16)
        anchors = [getattr(self, f"{s}a_{a}") for s in "kv" for a in ("codes", "scales", "biases")]
        m, l, acc = native.module().kvquant_decode(  # noqa: E741
            qf, [self.k_codes, self.k_scales, self.k_biases, mx.zeros((B, H, D, 0), mx.float16),
                 mx.zeros((0,), mx.int32), *none], [self.v_codes, self.v_scales, self.v_biases, *none],
            mx.zeros((B, H, 0, D), mx.float16), mx.zeros((B, H, 0, dv), mx.float16), list(rope_tables(None, D)), n,
            self.qbits, self.group, self.value_group(dv), 0, 0, False, anchors=anchors if self.use_delta else [])
        return Partials(m, l, acc)

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        g = self.n_quant // self.group  # encoded blocks reaching past the kept groups are dropped
        self._blocks = [b for b in self._blocks if b[1] <= g]
        return dropped

    def _symbols(self, g0: int, g1: int):
        """(key codes [B*H*D, n], value codes [B*H*Dv, n]) of groups [g0, g1) as uint8 numpy, one stream per channel."""
        G, b, w, n = self.group, self.qbits, self._key_words(), (g1 - g0) * self.group
        (B, H, D), Dv = self.k_codes.shape[:3], self.res_v.shape[-1]
        gv = self.value_group(Dv)
        kc = bitpack.unpack_bits(self.k_codes[..., g0 * w : g1 * w].reshape(B, H, D, g1 - g0, w), b, G)
        vc = bitpack.unpack_bits(self.v_codes[:, :, g0 * G : g1 * G].reshape(B, H, n, Dv // gv, -1), b, gv)
        vc = vc.reshape(B, H, n, Dv).transpose(0, 1, 3, 2)
        return np.array(kc.reshape(B * H * D, n)), np.array(vc.reshape(B * H * Dv, n))

    def _tables(self, B, H, d):
        """Stream -> table map for B*H*d channel streams: per channel, or per (batch, head)."""
        n = B * H * d
        return (np.arange(n), n) if self.config.options.per_channel else (np.arange(n) // d, B * H)

    def _encoded(self) -> list:
        """The entropy-coded blocks covering every quantized group; the groups added since the last call
        form one new block, so reading ``state`` after every prefill chunk codes each group once."""
        g = self.n_quant // self.group
        end = self._blocks[-1][1] if self._blocks else 0
        if end < g:
            kc, vc = self._symbols(end, g)
            (B, H, D), Dv = self.k_codes.shape[:3], self.res_v.shape[-1]
            self._blocks = self._blocks + [(end, g, entropy.encode(kc, self.qbits, *self._tables(B, H, D)),
                                            entropy.encode(vc, self.qbits, *self._tables(B, H, Dv)))]
        return self._blocks

    def _side(self, side: str) -> list:
        """Used parts of the arrays saved as they are (scales, biases, anchors) for ``side``."""
        n = self.n_quant
        g = n // self.group
        out = [self.k_scales[..., :g], self.k_biases[..., :g]] if side == "k" else \
            [self.v_scales[:, :, :n], self.v_biases[:, :, :n]]
        if self.use_delta:
            out += [getattr(self, f"{side}a_{a}")[:, :, :g] for a in ("codes", "scales", "biases")]
        return out

    def _saved_bytes(self, side: str, entropy: bool) -> int:
        """Bytes written for the quantized ``side``: the entropy-coded streams with their share of the block
        index (8 bytes per block for keys, 4 for values), or the fixed-width codes; plus the side info."""
        if self.n_quant == 0:
            return 0
        if entropy:
            blocks, i = self._encoded(), "kv".index(side)
            codes = sum(len(b[2 + i]) for b in blocks) + (8 - 4 * i) * len(blocks)
        elif side == "k":
            codes = self.k_codes[..., : (self.n_quant // self.group) * self._key_words()].nbytes
        else:
            codes = self.v_codes[:, :, : self.n_quant].nbytes
        return codes + sum(a.nbytes for a in self._side(side))

    def _fp16_bytes(self, res) -> int:
        """float16 bytes of the quantized tokens on the side of ``res``."""
        return 0 if res is None else res.shape[0] * res.shape[1] * self.n_quant * res.shape[-1] * 2

    # measured bytes of the quantized tokens: saved (entropy-coded) form, fixed-width form, float16
    compressed_key_bytes = property(lambda self: self._saved_bytes("k", True))
    compressed_value_bytes = property(lambda self: self._saved_bytes("v", True))
    fixed_width_key_bytes = property(lambda self: self._saved_bytes("k", False))
    fixed_width_value_bytes = property(lambda self: self._saved_bytes("v", False))
    fp16_key_bytes = property(lambda self: self._fp16_bytes(self.res_k))
    fp16_value_bytes = property(lambda self: self._fp16_bytes(self.res_v))

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
        out = super().state
        if not self.save_entropy_coded or self.n_quant == 0:
            return out
        meta = json.loads(out["meta"])
        meta["entropy"] = list(self.k_codes.shape[:3])  # B, H, D
        blocks = self._encoded()
        index = np.array([[b[1], len(b[2]), len(b[3])] for b in blocks], dtype=np.uint32)
        out = {"meta": json.dumps(meta), "stream_index": mx.array(index),
               "k_stream": mx.array(np.concatenate([b[2] for b in blocks])),
               "v_stream": mx.array(np.concatenate([b[3] for b in blocks])),
               "res_k": self.res_k, "res_v": self.res_v}
        names = ["_scales", "_biases"] + (["a_codes", "a_scales", "a_biases"] if self.use_delta else [])
        for side in "kv":
            out.update({side + nm: arr for nm, arr in zip(names, self._side(side))})
        return out

    @state.setter
    def state(self, v):
        KIVIKVCache.state.fset(self, v)  # config, scalars and the arrays saved as they are
        self._blocks = []
        meta = json.loads(v["meta"])
        if "entropy" not in meta:
            return
        B, H, D = meta["entropy"]
        Dv, G, b = self.res_v.shape[-1], self.group, self.qbits
        gv = self.value_group(Dv)
        index = np.array(v["stream_index"]).astype(np.int64)
        kbs = np.split(np.array(v["k_stream"]), np.cumsum(index[:-1, 1]))
        vbs = np.split(np.array(v["v_stream"]), np.cumsum(index[:-1, 2]))
        blocks, kcs, vcs, g0 = [], [], [], 0
        for g1, kb, vb in zip(index[:, 0], kbs, vbs):  # one step per saved block
            n = int(g1 - g0) * G
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

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        return self.fixed_width_key_bytes + self.fixed_width_value_bytes

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """Fixed-width bytes per token per head: codes + float16 scale/bias per group, + the 8-bit anchors / G."""
        anchors = sum((x + 4 * x / self._acg(x)) / self.group for x in (d, dv)) if self.use_delta else 0
        return self.kivi_bytes_per_token(d, dv) + anchors
