"""Waterfill: per-channel key bits allocated by reverse water-filling on the model's own queries, pre-RoPE
calibrated key ranges, rotated per-token values, float16 sinks and window. The library's 4-bit-class method (a
VeloxQuant composition, not one paper).

Why: on SmolLM2 the keys carry the 4-bit error (docs/RESULTS.md, "4-bit class target"): a few key channels have
wide ranges and meet large query components, so each extra bit goes where ``E[q_c^2] r_c^2 4^-b_c`` (channel c's
logit error) is largest (``primitives.bitalloc``), with the real queries the dispatch point shows.

Sources: per-channel key quantization with calibrated ranges, pre-RoPE keys, float16 sinks: KVQuant (arXiv
2401.18079, sections 3.1, 3.2, 3.6); a width per key channel: Kitty (arXiv 2511.18643, which boosts a fixed
fraction of channels); Hadamard-rotated values quantized per token: QuaRot (arXiv 2404.00456), with a Gaussian
Lloyd-Max codebook scaled per row: TurboQuant-MSE (arXiv 2504.19874); a float16 window: KIVI (arXiv 2402.02750).

Algorithm (per layer; ``b = bit_width_inlier``, ``R = residual_length``):

1. Rows enter the float16 window; until calibration nothing leaves it, and every call's queries add ``sum q^2``
   per KV head and channel (pre-RoPE: a rotary pair's channels share their mean).
2. Calibration, once, after ``n_calib_tokens`` (default 64) rows: keys un-rotated by the layer's RoPE (unknown
   RoPE: post-RoPE keys), ``[lo, hi]`` per (batch row, head, channel) over the rows but the 4 sinks, and each
   head's ``b * D`` key bits to the top gains ``log2(E[q_c^2] (hi - lo)^2) - 2 j`` (widths 0..8). At ``b <= 3``
   each range is then shrunk about its midpoint to the fraction (1.0 .. 0.4) whose levels code the calibration
   rows with the least squared error (``fitted_range``): with 4-8 levels the outliers would take most of them.
3. Rows leave the window in blocks of 16 (the newest R..R+15 stay; the first 4 tokens are sinks). Keys:
   ``round((k - lo) / step)`` at their channel's width, packed per row (``primitives.varpack``); a 0-bit channel
   decodes to its range's midpoint. Values: ``y = v H`` (Hadamard; a seeded rotation for a non-power-of-two
   ``Dv``), the row RMS ``s`` in float16, ``y / s`` coded with a ``b``-bit N(0, 1) codebook fitted as an odd
   polynomial of the centred code (``codebook.odd_poly_gaussian``: within 0.2% of Lloyd-Max's distortion at 4
   bits, decoded arithmetically).
4. Attention: one softmax over sinks, quantized rows, window and the call's rows; keys decoded one gather per
   code, RoPE re-applied; values ``((p * s) @ centroid[codes]) H^T``. On CUDA a decode step takes
   ``kernels.waterfill`` (codes read once; float16 models on tensor cores); on the CPU ``native/waterfill_cpu.cpp``
   (where built: the codes read once per step, blocks of 64 rows, an online softmax; its partials join the sinks'
   and window's softmax); each checked against the op path at first use.

Bytes per quantized token and KV head: ``b * D / 8 + b * Dv / 8 + 2`` (b = 4, D = 64: 66 vs 256 at float16), plus
the float16 ranges, width tables, window and sinks. Results: docs/RESULTS.md ("Quality targets", "Speed and memory").

Deviations and limits (all of them):

* KVQuant calibrates per-channel scales offline with non-uniform (sensitivity-weighted k-means) levels and
  dense-and-sparse outliers; here ranges come from the cache's first ``n_calib_tokens``, levels are uniform and
  sensitivity enters through the widths. Later keys outside the range are clamped (not refitted); at 8 bits the
  range is first widened by a quarter of its span on each side (``range_margin``), at <= 3 bits narrowed to the
  squared-error optimum (``fitted_range``, a clipping search instead of KVQuant's non-uniform levels; at 4 bits
  the same fit raised the KLD, so it is not used there).
* Calibration happens once, on the first calls (prompt): not chunk-invariant. Without the dispatch point (no
  queries) the widths use equal channel weights.
* Values are quantized per token (KIVI) at the uniform width b with the Gaussian codebook (TurboQuant: the exact
  Beta-type law and a random rotation), scaled by the row's RMS instead of its norm.
* ``bit_width_inlier`` sets both the keys' average and the values' width; ``n_sink_tokens`` is not used (4 sink
  rows, as turboquant_rvq).
* On CUDA, float16/bfloat16 models at 4 bits decode on tensor cores: dequantized and rotated keys, centroids and
  softmax weights rounded to float16 (relative 2^-11 each, sums in float32; ``kernels.waterfill``).
* The CPU kernel computes in float32 as the op path does, but turns the query to each 64-row block's first position
  (angles in double) and each key by its offset in the block, and sums each block's exponentials (a degree-7
  polynomial, relative ~2e-7) into an online softmax: equal to the op path to float32 rounding, not bit for bit.

mlx_lm protocol: as turboquant_rvq, plus the calibration in ``state``; ``merge`` builds ``waterfill_batch.py``'s.
"""
from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.keygrid import calibrated_grid, fit_rows
from ...primitives.buffers import grow_rows, reserve_rows
from ...primitives.bitalloc import MAX_BITS, allocate_bits, rope_pair_mean
from ...primitives.codebook import nearest_code, odd_poly_gaussian
from ...primitives.rope import rope_frequencies, rope_halves, rope_spec, rotate_parts, rotate_rows
from ...primitives.value_rotation import (nibble_centroids, odd_poly, poly_coefficients, power_of_two, rotate_values,
                                         value_rotation)
from ...primitives.varpack import VarLayout, dequantize_pairs, pair_table
from ...attention import group_queries
from ... import kernels
from ...kernels import waterfill as wf_kernel, waterfill_rows as wf_rows
from ... import native
from ...window import SINK_ROWS, Partials, ResidualWindowCache, split_rows_part

__all__ = ["WaterfillKVCache", "allocate_bits", "value_rotation"]

DEFAULT_CALIB_TOKENS = 64
BLOCK = 16  # rows leave the window in whole blocks of this many
_TINY = 1e-30


@register_with_mlx_lm
@register("waterfill")
class WaterfillKVCache(ResidualWindowCache):
    """Query-weighted per-channel key widths, pre-RoPE calibrated key ranges, rotated per-token values."""

    chunk_invariant = False  # widths and ranges are calibrated once, on the first calls' rows and queries
    exact_trim = False  # rows the trimmed rows pushed out of the window stay quantized (as turboquant_rvq)
    quant_block = BLOCK
    batchable = True  # merge -> WaterfillBatchKVCache (waterfill_batch.py); subclasses keep raising

    array_fields = ("k_words", "k_lo", "k_step", "k_bits", "v_words", "v_scales", "q_energy",
                    "win_k", "win_v", "sink_k", "sink_v")
    scalar_fields = ("n_sink", "n_quant", "n_win", "dtype_name", "q_count", "rope", "counts_constants",
                     "saliency_source")
    object_scalar_fields = ("rope",)  # the layer's RoPE spec (primitives.rope)
    calib_fields = ("k_lo", "k_step", "k_bits", "q_energy")  # not per-row: saved whole
    _shared = ("_layout", "_omega_cache", "_kconst", "_ptab", "_cpuconst")
    q_count = 0
    rope: Optional[dict] = None  # the layer's RoPE (primitives.rope spec), None = keys stay post-RoPE
    saliency_source: Optional[str] = None  # "attention" (real queries) or "uniform" (none seen), once calibrated

    def _init_layout(self):
        c = self.config
        bits = c.bit_width_inlier
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            raise QuantizerConfigError("bit_width_inlier", bits,
                                       "an int in 1..8 (waterfill: keys' average and values' width)")
        self.bit_width = bits
        self.residual_length = int(c.options.residual_length)
        self.n_calib = DEFAULT_CALIB_TOKENS if c.n_calib_tokens is None else c.n_calib_tokens  # (config-checked)
        self.seed = int(c.seed)
        self._layout = self._omega_cache = None

    def bind_attention(self, attn) -> None:
        """Read the layer's RoPE (``KVCacheBuilder.for_model`` calls this) so keys are quantized before it."""
        self.rope = rope_spec(getattr(attn, "rope", None)) if attn is not None else None
        self._omega_cache = None

    def _omega(self) -> mx.array:
        if self._omega_cache is None:
            self._omega_cache = rope_frequencies(self.rope)
        return self._omega_cache

    def _pre_rope(self, k: mx.array, offset) -> mx.array:
        k = k.astype(mx.float32)
        return rotate_rows(k, self.rope, self._omega(), offset, inverse=True) if self.rope is not None else k

    def _post_rope(self, k: mx.array, offset) -> mx.array:
        return rotate_rows(k, self.rope, self._omega(), offset) if self.rope is not None else k

    @property
    def calibrated(self) -> bool:
        return self.k_bits is not None

    def _observe(self, queries: mx.array) -> mx.array:
        """Add the call's ``sum q^2`` per KV head and channel (lazy: no host sync); returns the call's sum, which
        ``attend`` ties to its output (``mx.depends``) so the sum is taken with the layer's attention: left to the
        state's evaluation it kept every layer's queries alive to the end of a prefill chunk (a 2047-token
        chunk of SmolLM2 peaked 1.4x the plain cache's memory)."""
        H = self._shape[0]
        q = group_queries(queries, H).astype(mx.float32)  # [B, H, rep, N, D]
        e = (q * q).sum(axis=(0, 2, 3))[None, :, None, :]  # [1, H, 1, D]
        self.q_energy = e if self.q_energy is None else self.q_energy + e
        self.q_count += queries.shape[0] * queries.shape[1] // H * queries.shape[2]
        return e

    def _calibrate(self) -> None:
        """Key ranges over the stored rows (sinks excluded) and per-head widths (one host sync, once)."""
        n = self.n_win  # nothing has left the window yet: rows 0 .. n-1 are positions 0 .. n-1
        keys = self._pre_rope(self.win_k[:, :, :n], 0)
        body = keys[:, :, SINK_ROWS:] if n > SINK_ROWS else keys
        lo, hi = body.min(axis=2, keepdims=True), body.max(axis=2, keepdims=True)  # [B, H, 1, D]
        self.saliency_source = "attention" if self.q_energy is not None else "uniform"
        w = mx.ones(keys.shape[1::2]) if self.q_energy is None else self.q_energy[0, :, 0]
        if self.q_energy is not None and self.rope is not None:  # a pre-RoPE channel meets its rotary pair
            w = rope_pair_mean(w, self.rope)
        sens = w * ((hi - lo) ** 2).mean(axis=0)[:, 0]
        total = self.bit_width * keys.shape[3]
        widths = allocate_bits(sens, total)  # on the device: calibrating every layer costs no host sync
        self.k_lo, self.k_step = calibrated_grid(keys, lo, hi, widths, self.bit_width, fit_rows([n], n, SINK_ROWS))
        self.k_bits = widths.astype(mx.uint8)[None, :, None, :]
        self._layout = VarLayout(widths, total)
        self.q_energy = None  # only needed to calibrate (the grid stays lazy: no host sync)

    def _layout_of(self) -> VarLayout:
        if self._layout is None:  # restored from a state
            self._layout = VarLayout(np.array(self.k_bits[0, :, 0]))  # checked on the host, once
        return self._layout

    def _store(self, keys, values):
        if not self.calibrated and self.stored_rows() >= self.n_calib:
            self._calibrate()  # the previous call was never attended (no dispatch point): no query weights
        super()._store(keys, values)

    def _short_steps(self) -> bool:
        return self.calibrated  # then ``_store`` adds nothing to the window's

    def _compact(self, n: int) -> None:
        if self.calibrated:  # before calibration every row stays in the float16 window
            super()._compact(n)

    def _append_quantized(self, keys, values):
        t0 = self.n_quant
        pos = self.n_sink + t0  # positions n_sink + t0 ..: sinks first, no rows ever evicted
        op = lambda: self._encoded(keys, values, pos)  # noqa: E731
        kw, vw, vs = wf_rows.checked_encode(self, keys, values, pos, op) if self._rows_kernel() else op()
        for name, rows in (("k_words", kw), ("v_words", vw), ("v_scales", vs)):
            setattr(self, name, grow_rows(reserve_rows(getattr(self, name), t0, rows, BLOCK), t0, rows))

    def _encoded(self, keys, values, pos: int):
        """(key words, value words, value scales) of rows at positions ``pos ..`` (the op path)."""
        lay = self._layout_of()
        return (lay.pack(self._key_codes(keys, pos, lay.mask[None, :, None, :])), *self._encode_values(values))

    def _key_codes(self, keys, pos, mask) -> mx.array:
        """``round((k - lo) / step)`` of the pre-RoPE keys at positions ``pos ..``, clipped to the widths' ``mask``."""
        step, lo = self.k_step.astype(mx.float32), self.k_lo.astype(mx.float32)
        codes = mx.round((self._pre_rope(keys, pos) - lo) / mx.where(step > 0, step, 1.0))
        return mx.clip(codes, 0, mask.astype(mx.float32)).astype(mx.uint32)

    def _encode_values(self, values):
        """Rotated rows ``y = v M``, their RMS ``s`` (float16) and the Lloyd-Max codes of ``y / s``."""
        y = rotate_values(values.astype(mx.float32), self.seed)
        scale = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True)).astype(mx.float16)
        codes = nearest_code(y / mx.maximum(scale.astype(mx.float32), _TINY), odd_poly_gaussian(self.bit_width)[0])
        return pack_bits(codes, self.bit_width), scale[..., 0]

    def _pre_keys(self, a: int, b: int) -> mx.array:
        """Decoded pre-RoPE keys of quantized rows ``a .. b``: [B, H, b - a, D] float32 (one gather per code:
        ``varpack.dequantize_pairs``)."""
        return dequantize_pairs(self.k_words[:, :, a:b], *self._pair_table(), self.k_lo.astype(mx.float32),
                                self.k_step.astype(mx.float32))

    def _pair_table(self):
        """``varpack.pair_table`` of the layout and its width mask (built once per layout; held)."""
        lay = self._layout_of()
        pt = self.__dict__.get("_ptab")
        if pt is None or pt[0] is not lay:
            pt = self._ptab = (lay, *pair_table(lay))
        return pt[1], pt[2], lay.mask[:, None]

    def _ptab_arrays(self) -> list:
        """The byte-pair tables, held whenever the layout is (so copies and loaded caches count the same)."""
        return list(self._pair_table()[:2]) if self._layout is not None else []

    def _keys(self, a: int, b: int) -> mx.array:
        """Decoded keys of quantized rows ``a .. b``, RoPE re-applied: [B, H, b - a, D] float32."""
        return self._post_rope(self._pre_keys(a, b), self.n_sink + a)

    def _key_scores(self, q: mx.array, a: int, b: int) -> mx.array:
        """``q [B, H, R, D] @ K^T`` over quantized rows ``a .. b``, RoPE re-applied in parts (``rope.rotate_parts``:
        a matmul each, no interleaving copy)."""
        pre = self._pre_keys(a, b)
        if self.rope is None:
            return q @ pre.swapaxes(-1, -2)
        first, second, dims = rope_halves(self.rope)
        u, v, tail = rotate_parts(pre, self.rope, self._omega(), self.n_sink + a)
        s = q[..., first] @ u.swapaxes(-1, -2) + q[..., second] @ v.swapaxes(-1, -2)
        return s + q[..., dims:] @ tail.swapaxes(-1, -2) if tail.shape[-1] else s

    def _weighted_values(self, p: mx.array, a: int, b: int) -> mx.array:
        """``sum_t p_t s_t centroid[code_t]`` over quantized rows ``a .. b`` (rotated domain), [B, H, R, Dv].
        4-bit codes: each byte's two nibbles decoded by one fused kernel into the even and odd channels."""
        pw = p * self.v_scales[:, :, a:b].astype(mx.float32)[:, :, None, :]
        dv = self._shape[2]
        if self.bit_width != 4 or dv % 2:
            return pw @ self._value_codes(a, b)
        even, odd = nibble_centroids(mx.contiguous(mx.view(self.v_words[:, :, a:b], mx.uint8)[..., : dv // 2]),
                                      *poly_coefficients(4))
        out = mx.stack([pw @ even, pw @ odd], axis=-1)
        return out.reshape(*out.shape[:-2], dv)

    def _value_codes(self, a: int, b: int) -> mx.array:
        """Unit-RMS rotated values (codebook centroids) of quantized rows ``a .. b``, computed from the
        codes arithmetically (the codebook is an odd polynomial of the centred code)."""
        codes = unpack_bits(self.v_words[:, :, a:b], self.bit_width, self._shape[2])
        return odd_poly(codes, (1 << self.bit_width) - 1, *poly_coefficients(self.bit_width))

    def _quantized_dense(self, n, dtype=mx.float32):
        op = lambda: self._decoded(n)  # noqa: E731
        return self._memo_rows(n, self.k_words,
                               lambda: wf_rows.checked_decode(self, n, dtype, op) if self._rows_kernel() else op())

    def _decoded(self, n: int):
        """Float32 (keys with RoPE, values) of the first ``n`` quantized rows (the op path)."""
        v = self._value_codes(0, n) * self.v_scales[:, :, :n, None].astype(mx.float32)
        return self._keys(0, n), rotate_values(v, self.seed, inverse=True)

    def _rows_kernel(self) -> bool:
        """Whether rows are encoded and decoded by ``kernels.waterfill_rows`` (CUDA, supported shapes)."""
        return kernels.kernels_enabled() and wf_rows.supported(self)

    def _quantized_part(self, q, n: int):
        """Scores on the first ``n`` quantized keys decoded (RoPE re-applied at their positions) and
        ``sum_t p_t s_t centroid[code_t]``, rotated back once (a fast transform)."""
        return split_rows_part(n, functools.partial(self._key_scores, q), self._weighted_values,
                               lambda x: rotate_values(x, self.seed, inverse=True))

    def _decode_kernel_ready(self, queries, keys, mask) -> bool:
        """One query row over quantized rows, a string/None mask, kernel shapes, the CUDA backend."""
        if not self._one_row_over_codes(queries, keys, mask):
            return False
        H, D, DV = self._shape
        ok = (wf_kernel.supported(D, DV, self.k_words.shape[-1], self.v_words.shape[-1], queries.shape[1] // H)
              and power_of_two(DV))
        return ok and (kernels.kernels_enabled() or kernels.metal_enabled())

    def _decode_attend(self, queries, *, scale, sinks=None):
        return wf_kernel.decode_attend(self, queries, scale, sinks)

    def _cpu_constants(self):
        """The CPU kernel's tables: per (head, channel) ``first stream bit | width << 16`` of the codes, float32
        ranges [B, H, D], RoPE's per-channel tables, the values' codebook polynomial; built once per calibration
        (``_cpuconst``: held, counted by ``held_arrays``)."""
        kc = self.__dict__.get("_cpuconst")
        if kc is None or kc[0] is not self.k_lo:
            lay = self._layout_of()
            i32 = mx.int32
            tab = (lay.word.astype(i32) * 32 + lay.shift.astype(i32)) | (lay.bits.astype(i32) << 16)
            poly = mx.array(poly_coefficients(self.bit_width), dtype=mx.float32)
            kc = self._cpuconst = (self.k_lo, mx.contiguous(tab), mx.contiguous(self.k_lo[:, :, 0].astype(mx.float32)),
                                   mx.contiguous(self.k_step[:, :, 0].astype(mx.float32)),
                                   *wf_kernel.rope_tables(self.rope, self._shape[1]), poly)
        return kc[1:]

    def _cpu_part(self, q, n: int, counts=(), pos0=None) -> Partials:
        """The first ``n`` quantized rows' partials for scaled float32 queries ``q`` [B, H, R, D], by the CPU
        kernel (``native/waterfill_cpu.cpp``): codes read once, RoPE turned per block of rows, one pass. A batch
        form's ``counts``: sequence b's first ``counts[b]`` rows; ``pos0``: quantized row 0's position."""
        tab, lo, step, w, partner, sign, poly = self._cpu_constants()
        m, l, acc = native.module().waterfill_decode(  # noqa: E741
            q, self.k_words, tab, lo, step, w, partner, sign, self.v_words, self.v_scales, poly, n,
            self.n_sink if pos0 is None else pos0, self.bit_width, self._shape[2], self.rope is not None,
            counts=list(counts))
        return Partials(m, l, rotate_values(acc, self.seed, inverse=True))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        seen = self._observe(queries) if not self.calibrated and getattr(self, "_shape", None) else None
        def op():
            return ResidualWindowCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)

        if self.calibrated and self._decode_kernel_ready(queries, keys, mask):  # kernels: checked once against op()
            return kernels.checked_call(
                "waterfill", self, lambda: self._decode_attend(queries, scale=scale, sinks=sinks), op)
        if self.calibrated and self._one_row_over_codes(queries, keys, mask) and native.available():
            return kernels.checked_call("waterfill_cpu", self, lambda: self._attend_part(
                queries, keys, self._cpu_part, scale=scale, mask=mask, sinks=sinks), op)
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if not self.calibrated and self.stored_rows() >= self.n_calib:
            self._calibrate()
            self._compact_blocks()
        return out if seen is None else mx.depends(out, seen)

    @staticmethod
    def constants_key(c):
        """The value rotation depends on the head dim and the seed (``build_layers`` counts it once)."""
        return (c.head_dim, c.seed)

    def held_arrays(self):
        """``array_fields``, the width layout's (and byte-pair) tables, the RoPE angles, the decode kernel's tables
        (once built) and, where counted, a non-power-of-two dim's value rotation."""
        out = super().held_arrays()
        if self._layout is not None:
            out += self._layout.arrays() + self._ptab_arrays()
        if self._omega_cache is not None:  # the RoPE angles per position, once used
            out.append(self._omega_cache)
        out += wf_kernel.held_constants(self)  # the decode kernel's tables, once built
        kc = self.__dict__.get("_cpuconst")
        if kc is not None and kc[0] is self.k_lo:  # the CPU kernel's, once built
            out += list(kc[1:])
        if self.counts_constants and getattr(self, "_shape", None) and not power_of_two(self._shape[2]):
            out.append(value_rotation(self._shape[2], self.seed))
        return out

    @property
    def constant_nbytes(self) -> int:
        """Bytes of the shared value rotation matrix (none for a power-of-two dim: a fast transform)."""
        shape = getattr(self, "_shape", None)
        return value_rotation(shape[2], self.seed).nbytes if shape and not power_of_two(shape[2]) else 0

    def bytes_per_token(self, head_dim: Optional[int] = None, value_dim: Optional[int] = None) -> int:
        """Bytes of one quantized token per KV head: key words + value words + the value scale."""
        d, dv = self._dims(head_dim, value_dim)
        return 4 * (packed_words(d, self.bit_width) + packed_words(dv, self.bit_width)) + 2

    def _used(self, name: str):
        return None if name in self.calib_fields else super()._used(name)

    def _set_state(self, v):
        ResidualWindowCache.state.fset(self, v)
        self._layout = self._omega_cache = None
        if self.k_bits is not None:
            self._layout_of()  # held from the start, as in the cache that was saved

    state = ResidualWindowCache.state.setter(_set_state)  # the base's getter, this setter

    @property
    def used_nbytes(self) -> int:
        """Bytes of the used rows of every array (spare capacity and the shared rotation left out)."""
        lay = self._layout.nbytes + sum(a.nbytes for a in self._ptab_arrays()) if self._layout is not None else 0
        return super().used_nbytes + lay

    @classmethod
    def _merge_batch(cls, caches):
        from .waterfill_batch import WaterfillBatchKVCache
        return WaterfillBatchKVCache.from_caches(caches)
