"""KVQuant (Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, NeurIPS 2024, arXiv 2401.18079):
per-channel key quantization *before* RoPE, non-uniform per-channel levels (nuq), dense-and-sparse outliers kept
exactly, attention-sink tokens in full precision.

On KIVI's residual (b = ``kvquant_bits``, G = ``kvquant_group_size``): ``bind_attention`` reads the layer's RoPE
(``primitives.rope``); keys are rotated back to pre-RoPE before coding and forward when decoded (post-RoPE when
unbound or the RoPE cannot be reproduced, e.g. YaRN). Per (batch, head, group) the ``ceil(f*G*D)`` largest |x|
(f = ``kvquant_outlier_fraction``) are kept sparse (``gear.SparseOutliers``); the rest of a channel, min/max
normalized per group, is the nearest of 2^b levels from ``kvquant_lloyd_iters`` rounds of 1-D Lloyd on the first
block (refitted every ``kvquant_refit_interval`` groups when > 0). Values: the same split, then KIVI's per-token
codes. The first ``kvquant_n_sink`` tokens are also kept float16. Pre-RoPE KL: docs/RESULTS.md; post-RoPE
0.0137 at 3 bits, 0.0673 at 2 (within one text's ~20% noise); on one RoPE-rotated vector per head the pre-RoPE
error is >100x smaller (tests/test_defining_properties.py).

Deviations from the paper:

* Pre-RoPE keys come from undoing the layer's RoPE on the keys mlx_lm hands over (exact up to float32 rounding
  of the angles); sinks and the residual stay post-RoPE.
* Levels are fitted online per layer/head/channel on the cache's own prefill (plain Lloyd on min/max-normalized
  values), not offline with Fisher-information weighting.
* Outliers are a fixed count per G-token block (a dense store), not per-channel calibrated thresholds.
* Values use uniform per-token levels (plus the sparse outliers), not nuq.
* Sink tokens are stored float16 *in addition to* their codes; the newest < G tokens stay float16 (the paper
  quantizes every token on arrival).
* Trim: KIVI's rule; a trim into the block a level fit was made from raises ``ValueError``.

On CUDA a chunk's codes (but a fitting chunk's) and the stored past's dense rows come from one launch each
(``kernels.kvquant_rows``; the stored outliers then in entry order, the same set). On the CPU a decode step reads
the codes once in ``native/kvquant_cpu.cpp`` (``_cpu_part``): each 64-row block's keys through their groups' level
tables, outliers put back, the pre-RoPE keys turned per block (angles in double, the op path's in float32), sinks in
place; checked once against the op path, which decodes the whole past every step (SmolLM2 at 4k: 0.18x the plain
cache's decode on the op path, ~1.0-1.1x on the kernel; docs/RESULTS.md).
"""

from __future__ import annotations

import mlx.core as mx

from ... import kernels, native
from ...base import register
from ...contract import register_with_mlx_lm
from ...kernels import kvquant_rows
from ...kernels.waterfill import rope_tables
from ...primitives import bitpack
from ...primitives import groupquant as gq
from ...primitives import nonuniform as nu
from ...primitives.buffers import grow_columns
from ...primitives.rope import rope_frequencies, rope_spec, rotate_rows
from ...window import Partials
from .gear import SparseOutliers
from .kivi import RES_DTYPE, KIVIKVCache


@register_with_mlx_lm
@register("kvquant")
class KVQuantKVCache(SparseOutliers, KIVIKVCache):
    """KVQuant: per-channel non-uniform keys, dense-and-sparse outliers, float16 sink tokens."""
    chunk_invariant = False  # non-uniform levels fitted on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_codes", "k_scales", "k_biases", "k_levels", "k_fit", "k_oidx", "k_oval",
                    "v_codes", "v_scales", "v_biases", "v_oidx", "v_oval", "sink_k", "sink_v", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "fit_starts", "fit_ends", "rope")
    object_scalar_fields = ("rope",)  # the layer's RoPE spec (primitives.rope)
    dequant_only = "non-uniform codes + outliers"
    fit_starts: list = []
    fit_ends: list = []
    rope: dict | None = None  # the layer's RoPE (primitives.rope spec); None: keys quantized post-RoPE

    def _init_layout(self):
        o = self.config.options
        self.qbits, self.group, self.frac, self.n_sink = o.bits, o.group_size, float(o.outlier_fraction), o.n_sink
        self.fit_starts, self.fit_ends = [], []
        self.rope, self._omega = None, None

    def bind_attention(self, attn) -> None:
        """Read the layer's RoPE (``KVCacheBuilder.for_model`` calls this) so that keys are quantized
        before it; a RoPE that ``rope_spec`` cannot reproduce leaves the keys post-RoPE."""
        self.rope = rope_spec(getattr(attn, "rope", None)) if attn is not None else None
        self._omega = None

    def _rope_omega(self) -> mx.array:
        if self._omega is None:
            self._omega = rope_frequencies(self.rope)
        return self._omega

    def _rope(self, k: mx.array, offset: int, inverse: bool) -> mx.array:
        """float32 rows ``k [B, H, n, D]`` at positions ``offset..`` to pre-RoPE (``inverse``) or back."""
        if self.rope is None:
            return k
        return rotate_rows(k, self.rope, self._rope_omega(), offset, inverse=inverse)

    def held_arrays(self):  # with a RoPE bound, its angle table too (so ``nbytes`` counts it)
        return super().held_arrays() + ([self._rope_omega()] if self.rope is not None else [])

    def _append_groups(self, kb, vb):
        G, b = self.group, self.qbits
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        g, t0 = n // G, self.n_quant
        g0 = t0 // G
        if t0 == 0 and self.n_sink:
            # copies: ``astype`` to the same dtype is a view that would keep the whole block alive
            self.sink_k, self.sink_v = (mx.contiguous(x[:, :, : self.n_sink].astype(RES_DTYPE)) for x in (kb, vb))
        ri = self.config.options.refit_interval
        refit = not self.fit_starts or (ri and g0 - self.fit_starts[-1] >= ri)  # first block, or a refit is due
        if refit or not kernels.kernels_enabled() or not kvquant_rows.encode_supported(D, Dv, G, b):
            keys, (vidx, vval, vd) = self._encode_keys(kb, t0, g0, refit), self._split_values(vb)
        else:  # on CUDA, one launch (``kernels.kvquant_rows``)
            keys, (vidx, vval, vd) = kvquant_rows.checked_encode_rows(
                self, kb, vb, t0, lambda: (self._encode_keys(kb, t0, g0, False), self._split_values(vb)))
        kcodes, kscale, kbias, kidx, kval = keys
        fit = len(self.fit_starts) - 1
        self._append_codes(t0, (kcodes, kscale, kbias), gq.quantize(vd, b, self.value_group(Dv)))
        cap = self.v_codes.shape[2] // G  # per-group arrays follow the values' capacity
        self.k_fit = grow_columns(self.k_fit, g0, mx.full((g,), fit, dtype=mx.int32), cap)
        for side, o, idx, val in (("k", self._n_out(D), kidx, kval), ("v", self._n_out(Dv), vidx, vval)):
            if o:
                self._put_outliers(side, g0, idx, val, cap)
        self.n_quant = t0 + n

    def _split_values(self, vb):
        """(outlier indices, values [B, H, g, o], dense rows [B, H, n, Dv] float32) of the value rows ``vb``: per
        G-token block the outliers split off, the per-token quantizer's input."""
        B, H, n, Dv = vb.shape
        vidx, vval, vd = nu.split_outliers(vb.astype(mx.float32).reshape(B, H, n // self.group, self.group * Dv),
                                           self._n_out(Dv))
        return vidx, vval, vd.reshape(B, H, n, Dv)

    def _encode_keys(self, kb, t0: int, g0: int, refit: bool):
        """(codes [B, H, D, g * w], scales, biases [B, H, D, g], outlier indices, values [B, H, g, o]) of the key
        rows ``kb`` at positions ``t0 ..`` (pre-RoPE if a RoPE is bound): per G-token block the outliers split off,
        then per channel the group's range and the nearest non-uniform level, fitted first when ``refit``."""
        G, b, L = self.group, self.qbits, 1 << self.qbits
        B, H, n, D = kb.shape
        g = n // G
        kpre = self._rope(kb.astype(mx.float32), t0, inverse=True)
        kblk = kpre.reshape(B, H, g, G, D).swapaxes(-1, -2)  # [B, H, g, D, G]
        kidx, kval, kd = nu.split_outliers(kblk.reshape(B, H, g, D * G), self._n_out(D))
        kd = kd.reshape(B, H, g, D, G).transpose(0, 1, 3, 2, 4)  # [B, H, D, g, G]
        lo = kd.min(axis=-1, keepdims=True)
        scale, bias = (kd.max(axis=-1, keepdims=True) - lo).astype(mx.float16), lo.astype(mx.float16)
        s32 = scale.astype(mx.float32)
        u = mx.clip((kd - bias.astype(mx.float32)) / mx.where(s32 > 0, s32, 1.0), 0.0, 1.0)
        if refit:
            lv = nu.fit_levels(u.reshape(B, H, D, g * G), b, self.config.options.lloyd_iters).astype(mx.float16)
            nf = len(self.fit_starts)
            self.k_levels = grow_columns(self.k_levels, nf * L, lv, (nf + 1) * L)
            self.fit_starts = self.fit_starts + [g0]
            self.fit_ends = self.fit_ends + [g0 + g]
        fit = len(self.fit_starts) - 1
        codes = nu.encode_levels(u, self.k_levels[..., fit * L : (fit + 1) * L][:, :, :, None, :])  # [B, H, D, g, G]
        return (bitpack.pack_bits(codes, b).reshape(B, H, D, -1), scale.reshape(B, H, D, g), bias.reshape(B, H, D, g),
                kidx, kval)

    def _keys_t(self, n, dtype=mx.float32):
        G, b, w, L = self.group, self.qbits, self._key_words(), 1 << self.qbits
        g = n // G
        B, H, D = self.k_codes.shape[:3]
        codes = bitpack.unpack_bits(self.k_codes[..., : g * w].reshape(B, H, D, g, w), b, G)
        nf = len(self.fit_starts)
        levels = self.k_levels[..., : nf * L].reshape(B, H, D, nf, L).astype(mx.float32)
        lv = mx.take(levels, self.k_fit[:g], axis=3)  # [B, H, D, g, L]
        u = nu.decode_levels(codes, lv)
        x = u * self.k_scales[..., :g, None].astype(mx.float32) + self.k_biases[..., :g, None].astype(mx.float32)
        blk = self._with_outliers("k", x.transpose(0, 1, 3, 2, 4).reshape(B, H, g, D * G), D)
        x = blk.reshape(B, H, g, D, G).transpose(0, 1, 3, 2, 4).reshape(B, H, D, g * G)
        x = self._rope(x.swapaxes(-1, -2), 0, inverse=False).swapaxes(-1, -2)  # the keys the model attends with
        if self.n_sink and self.sink_k is not None:
            x = mx.concatenate([self.sink_k.swapaxes(-1, -2).astype(mx.float32), x[..., self.n_sink :]], axis=-1)
        return x.astype(dtype)

    def _values(self, n, dtype=mx.float32):
        v = super()._values(n)
        B, H, _, Dv = v.shape
        v = self._with_outliers("v", v.reshape(B, H, n // self.group, self.group * Dv), Dv).reshape(B, H, n, Dv)
        if self.n_sink and self.sink_v is not None:
            v = mx.concatenate([self.sink_v.astype(mx.float32), v[:, :, self.n_sink :]], axis=2)
        return v.astype(dtype)

    def _quantized_rows(self, n, dtype=None):
        """Dense (K, V) of the first ``n`` quantized tokens: the op path (float32), or on CUDA, asked for the model's
        ``dtype`` (a GPU prefill chunk's past), one launch of ``kernels.kvquant_rows``."""
        op = lambda: (self._keys_t(n).swapaxes(-1, -2), self._values(n))  # noqa: E731
        if dtype is None or not kernels.kernels_enabled() or not kvquant_rows.supported(
                self.k_codes.shape[2], self.res_v.shape[-1], self.value_group(self.res_v.shape[-1])):
            return op()
        return kvquant_rows.checked_decode(self, n, dtype, op)

    def _cpu_layout(self) -> bool:
        """The CPU kernel reads KVQuant's own codes (``native/kvquant_cpu.cpp``)."""
        return True

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes ``kvquant_decode`` reads: 2-4 bits, groups of 32k tokens, value groups of whole words, head dims
        up to 256, up to 32 query heads per KV head."""
        return (native.available() and self.attend_path == "auto" and 2 <= self.qbits <= 4 and self.group % 32 == 0
                and self.value_group(dv) * self.qbits % 32 == 0 and max(d, dv) <= 256 and d % 2 == 0 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` quantized tokens' partials by the CPU kernel (``kvquant_decode``): each block of 64
        tokens' codes read once -- keys through their groups' level tables, outliers put back, turned by RoPE
        per block (pre-RoPE keys), the float16 sinks in place of their rows -- scored and summed in one pass."""
        B, H, _, D = qf.shape
        dv = self.res_v.shape[-1]
        none = mx.zeros((B, H, 0), mx.uint16), mx.zeros((B, H, 0), mx.float16)
        out = lambda side: (getattr(self, f"{side}_oidx"), getattr(self, f"{side}_oval")) \
            if getattr(self, f"{side}_oidx") is not None else none  # noqa: E731
        sinks = (self.sink_k, self.sink_v) if self.n_sink and self.sink_k is not None else \
            (mx.zeros((B, H, 0, D), mx.float16), mx.zeros((B, H, 0, dv), mx.float16))
        m, l, acc = native.module().kvquant_decode(  # noqa: E741
            qf, [self.k_codes, self.k_scales, self.k_biases, self.k_levels, self.k_fit, *out("k")],
            [self.v_codes, self.v_scales, self.v_biases, *out("v")], *sinks, list(rope_tables(self.rope, D)), n,
            self.qbits, self.group, self.value_group(dv), self._n_out(D) if self.k_oidx is not None else 0,
            self._n_out(dv) if self.v_oidx is not None else 0, self.rope is not None)
        return Partials(m, l, acc)

    def _fits_kept(self, n: int) -> tuple[int, int]:
        """(fits starting below the groups a trim of ``n`` tokens keeps, those groups): KIVI's rule passed."""
        new_g = (self.n_quant - max(n - self.n_res, 0)) // self.group
        return sum(s < new_g for s in self.fit_starts), new_g

    def _check_trim_rows(self, n: int) -> None:
        """KIVI's rule, and no cut into a block the kept codes' levels were fitted on."""
        super()._check_trim_rows(n)
        kept, new_g = self._fits_kept(n)
        if kept and self.fit_ends[kept - 1] > new_g:
            raise ValueError(
                f"KVQuantKVCache: trimming {n} tokens would remove part of the block (groups "
                f"{self.fit_starts[kept - 1]}..{self.fit_ends[kept - 1] - 1}) the non-uniform levels of the "
                "remaining codes were fitted on; the result would differ from never having seen them")

    def _trim_rows(self, n):
        kept = self._fits_kept(n)[0]  # the fits made on trimmed groups go with them
        self.fit_starts, self.fit_ends = self.fit_starts[:kept], self.fit_ends[:kept]
        return super()._trim_rows(n)

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        g = self.n_quant // self.group
        sparse = B * H * g * (self._n_out(D) + self._n_out(dv)) * (2 + 2)  # uint16 + float16
        levels = B * H * D * len(self.fit_starts) * (1 << self.qbits) * 2 + g * 4
        sinks = 0 if self.sink_k is None else self.sink_k.nbytes + self.sink_v.nbytes
        return super()._code_nbytes(B, H, D, dv) + sparse + levels + sinks

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        return self.kivi_bytes_per_token(d, dv) + 4 * (self._n_out(d) + self._n_out(dv)) / self.group
