"""Waterfill: per-channel key bits allocated by reverse water-filling on the model's own queries,
pre-RoPE calibrated key ranges, rotated per-token values; float16 sinks and window. The library's
4-bit-class method (a VeloxQuant composition, not one paper).

Why. On SmolLM2 the keys carry the 4-bit error (docs/RESULTS.md, "4-bit class target"): a few key
channels have wide ranges *and* meet large query components, so a uniform width wastes bits on
channels the logits barely see. Each extra bit goes where ``E[q_c^2] r_c^2 4^-b_c`` (the logit error
of channel ``c``) is largest: reverse water-filling (``primitives.bitalloc``), with the model's real
queries (the attention dispatch point shows them to the cache).

Ideas used, by source: per-channel key quantization with *calibrated* ranges, on keys *before* RoPE,
and float16 attention-sink tokens: KVQuant (arXiv 2401.18079, sections 3.1, 3.2, 3.6); a width per
key channel: Kitty (arXiv 2511.18643) boosts a fixed fraction of channels, here every channel gets its
own width; values rotated by a Hadamard transform before per-token quantization: QuaRot (arXiv
2404.00456), their coordinates coded with a Gaussian Lloyd-Max codebook scaled per row: TurboQuant-MSE
(arXiv 2504.19874); a float16 window of the newest tokens: KIVI's residual (arXiv 2402.02750).

Algorithm (per layer; ``b = bit_width_inlier``, ``R = residual_length``):

1. Rows enter a float16 window (``ResidualWindowCache``); until calibration nothing leaves it, and
   every call's queries add ``sum q^2`` per KV head and channel (``q_energy``; with RoPE undone,
   the two channels of a rotary pair share their mean, since a key's pre-RoPE channel meets both).
2. Calibration, once, at the end of the first call after which ``n_calib_tokens`` (default 64) rows
   are stored: keys are un-rotated (the layer's RoPE, checked against it and inverted by
   ``primitives.rope.rotate_rows``; unknown RoPE: keys stay post-RoPE), the range ``[lo, hi]`` of every
   (batch row, head, channel) is taken over the stored rows but the 4 sinks, and each head's ``b * D``
   key bits go to the top gains ``log2(E[q_c^2] (hi - lo)^2) - 2 j`` (the j-th bit of channel c, widths
   0..8; ``allocate_bits``): the widths ``k_bits [H, D]``.
3. Rows leaving the window (whole blocks of 16, the newest R..R+15 stay; the stream's first 4 tokens
   go to float16 sink rows). Keys: un-rotated, coded ``round((k - lo) / step)`` in ``[0, 2^b_c - 1]``
   with ``step = (hi - lo) / (2^b_c - 1)`` (0-bit channels: the range's midpoint), packed at their
   own widths (``primitives.varpack``, whole 32-bit words per row). Values: ``y = v H`` (normalized
   Hadamard as a fast transform; a seeded random rotation matrix when ``Dv`` is not a power of two);
   each row's RMS ``s`` is stored as float16 and ``y / s`` coded with a ``b``-bit codebook for N(0, 1)
   (TurboQuant-MSE's Lloyd-Max levels fitted by ``a u + b u^3 + c u^5`` in the centred code ``u``, so
   decoding is arithmetic: ``codebook.odd_poly_gaussian``, within 0.2% of Lloyd-Max's distortion at
   4 bits); packed with ``primitives.bitpack``.
4. Attention (``attend``): one softmax over the float16 sinks, the quantized rows, the window and the
   call's rows (``window.joint_attention``); quantized keys decoded (``lo + code * step``, each code
   read from the 16 bits at its first byte: one gather, a shift and a mask), RoPE re-applied to the
   rotary pairs' halves (the scores are two matmuls, no interleaving copy), values as
   ``((p * s) @ centroid[codes]) H^T`` (4 bits: both nibbles of a byte in one fused kernel). A decode
   step on MLX's CUDA backend takes the fused kernel of ``cache.kernels.waterfill`` (words read once,
   RoPE applied to the query, split-K online softmax, one merge undoing the Hadamard), checked against
   the op path at first use.

Bytes per quantized token and KV head: ``b * D / 8`` (keys, whole words) + ``b * Dv / 8 + 2`` (values
+ scale); b = 4, D = 64: 66 bytes vs 256 at float16 (0.258x). Per cache: float16 ``lo``/``step``
``[B, H, 1, D]``, the widths and their unpacking tables, the float16 window and sinks (and the decode
kernel's small tables once used); a value rotation matrix only for a non-power-of-two ``Dv``, counted
once per model (``build_layers``).

Measured (``veloxquant eval --task kld``, SmolLM2-135M float32 on the CPU, essay prompt + 32 scored
decode steps; docs/RESULTS.md "Quality targets"): 4 bits with ``residual_length=16``: KLD 0.0009 at
0.296x the fp16 bytes (whole cache) at 1024 tokens, 0.0008 at 0.277x at 2048 -- the 4-bit class target;
2 bits with ``residual_length=32``: KLD 0.065 at 0.159x at 2048 -- the 2-bit class target. Decode speed
is below the plain cache's. CPU (2 cores shared with other jobs, 2026-12-01, ``veloxquant bench --method
waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 4096 --repeats 1
--decode-tokens 16 --baselines none``): 0.58x plain at 4k (0.45x on 2026-11-29, before the byte-pair
decoding); the code decoding and RoPE passes over every stored row cost more than the plain cache's
two matmuls, and each of the step's ~80 small MLX ops ~15 us of host time. H200 (``veloxquant bench --shape llama-8b --random-weights``, 2026-12-01,
docs/data/h200_decode_kernels_2026-12-01.json): 0.40x plain at 8k and 0.31x at 32k with the fused
kernel (0.17x / 0.07x on the op path); the remaining gap is mostly a per-layer host cost of building
each step's graph (+0.53 ms per layer and step over plain at 8k, +0.77 ms at 32k).

Deviations and limits (all of them):

* KVQuant calibrates per-channel scales offline on a calibration set and quantizes with non-uniform
  (sensitivity-weighted k-means) levels and dense-and-sparse outliers; here ranges come from the
  cache's own first ``n_calib_tokens``, levels are uniform, and sensitivity enters through the bit
  widths instead. Later keys outside the calibrated range are clamped (the range is not refitted);
  pre-RoPE ranges do not drift with position, post-RoPE ones can.
* Calibration happens once; its statistics come from the first calls (prompt), so the cache is not
  chunk-invariant. Without the dispatch point (no queries seen) the widths are allocated with equal
  channel weights, at the first call after ``n_calib_tokens`` rows.
* Values are quantized per token (KIVI: value errors average out over tokens) at the uniform width b,
  with the Gaussian codebook (TurboQuant: the exact Beta-type law and a random rotation; close for
  Dv = 64, and a Hadamard is cheaper), scaled by the row's RMS instead of its norm.
* ``bit_width_inlier`` sets both the keys' average width and the values' width; ``n_sink_tokens``
  is not used (4 sink rows, as turboquant_rvq).

mlx_lm protocol: as turboquant_rvq (``ResidualWindowCache``), plus the calibration in ``state``;
``merge`` builds the batch form (``waterfill_batch.py``).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, unpack_bits
from ...primitives.buffers import grow_rows, reserve_rows
from ...primitives.bitalloc import MAX_BITS, allocate_bits, rope_pair_mean
from ...primitives.codebook import nearest_code, odd_poly_gaussian
from ...primitives.rope import _turn, angle_tables, rope_frequencies, rope_spec, rotate_rows
from ...primitives.value_rotation import odd_poly, poly_coefficients, power_of_two, rotate_values, value_rotation
from ...primitives.varpack import VarLayout
from ...attention import group_queries
from ... import dispatch, kernels
from ...kernels import waterfill as wf_kernel
from ...window import SINK_ROWS, ResidualWindowCache

__all__ = ["WaterfillKVCache", "allocate_bits", "value_rotation"]

DEFAULT_CALIB_TOKENS = 64
BLOCK = 16  # rows leave the window in whole blocks of this many
_TINY = 1e-30


@register_with_mlx_lm
@register("waterfill")
class WaterfillKVCache(ResidualWindowCache):
    """Query-weighted per-channel key widths, pre-RoPE calibrated key ranges, rotated per-token
    values, float16 sinks + window. See the module docstring."""

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
    _shared = ("_layout", "_omega_cache", "_kconst", "_ptab")
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
        n_calib = c.n_calib_tokens
        if n_calib is not None and (isinstance(n_calib, bool) or not isinstance(n_calib, int) or n_calib < 1):
            raise QuantizerConfigError("n_calib_tokens", n_calib, "an int >= 1 or None (waterfill: 64)")
        self.n_calib = DEFAULT_CALIB_TOKENS if n_calib is None else n_calib
        self.seed = int(c.seed)
        self._call = None
        self._layout = None
        self._omega_cache = None

    # ---- the layer's RoPE (KVCacheBuilder.for_model calls this)
    def bind_attention(self, attn) -> None:
        """Read the layer's RoPE so keys are quantized before it (None: post-RoPE keys)."""
        self.rope = rope_spec(getattr(attn, "rope", None)) if attn is not None else None
        self._omega_cache = None

    def _omega(self) -> mx.array:
        if self._omega_cache is None:
            self._omega_cache = rope_frequencies(self.rope)
        return self._omega_cache

    def _pre_rope(self, k: mx.array, offset: int) -> mx.array:
        k = k.astype(mx.float32)
        return rotate_rows(k, self.rope, self._omega(), offset, inverse=True) if self.rope is not None else k

    # ---- calibration
    @property
    def calibrated(self) -> bool:
        return self.k_bits is not None

    def _observe(self, queries: mx.array) -> None:
        """Add the call's ``sum q^2`` per KV head and channel (lazy: no host sync)."""
        H = self._shape[0]
        q = group_queries(queries, H).astype(mx.float32)  # [B, H, rep, N, D]
        e = (q * q).sum(axis=(0, 2, 3))[None, :, None, :]  # [1, H, 1, D]
        self.q_energy = e if self.q_energy is None else self.q_energy + e
        self.q_count += queries.shape[0] * queries.shape[1] // H * queries.shape[2]

    def _calibrate(self) -> None:
        """Key ranges over the stored rows (sinks excluded) and per-head widths (one host sync, once)."""
        n = self.n_win  # nothing has left the window yet: rows 0 .. n-1 are positions 0 .. n-1
        keys = self._pre_rope(self.win_k[:, :, :n], 0)
        body = keys[:, :, SINK_ROWS:] if n > SINK_ROWS else keys
        lo, hi = body.min(axis=2, keepdims=True), body.max(axis=2, keepdims=True)  # [B, H, 1, D]
        H, D = keys.shape[1], keys.shape[3]
        self.saliency_source = "attention" if self.q_energy is not None else "uniform"
        if self.q_energy is not None:
            w = self.q_energy[0, :, 0]
            if self.rope is not None:  # a pre-RoPE channel meets both channels of its rotary pair
                w = rope_pair_mean(w, self.rope)
        else:
            w = mx.ones((H, D))
        sens = w * ((hi - lo) ** 2).mean(axis=0)[:, 0]
        widths = allocate_bits(np.array(sens), self.bit_width * D)
        levels = mx.array((2 ** widths - 1).astype(np.float32))[None, :, None, :]
        zero = levels == 0
        self.k_step = mx.where(zero, 0.0, (hi - lo) / mx.maximum(levels, 1.0)).astype(mx.float16)
        self.k_lo = mx.where(zero, (lo + hi) / 2, lo).astype(mx.float16)
        self.k_bits = mx.array(widths.astype(np.uint8))[None, :, None, :]
        self._layout = VarLayout(widths)
        self.q_energy = None  # only needed to calibrate
        mx.eval(self.k_step, self.k_lo)

    def _layout_of(self) -> VarLayout:
        if self._layout is None:  # restored from a state
            self._layout = VarLayout(np.array(self.k_bits[0, :, 0]))
        return self._layout

    # ---- storage hooks
    def _store(self, keys, values):
        if not self.calibrated and self.stored_rows() >= self.n_calib:
            self._calibrate()  # the previous call was never attended (no dispatch point): no query weights
        super()._store(keys, values)

    def _compact(self, n: int) -> None:
        if self.calibrated:  # before calibration every row stays in the float16 window
            super()._compact(n)

    def _append_quantized(self, keys, values):
        self._rows_memo().clear()
        t0 = self.n_quant
        pos = self.n_sink + t0  # positions of these rows (sinks first, no rows ever evicted)
        lay = self._layout_of()
        step, lo = self.k_step.astype(mx.float32), self.k_lo.astype(mx.float32)
        codes = mx.round((self._pre_rope(keys, pos) - lo) / mx.where(step > 0, step, 1.0))
        codes = mx.clip(codes, 0, mx.array(lay.mask[None, :, None, :]).astype(mx.float32))
        kw = lay.pack(codes.astype(mx.uint32))
        vw, vs = self._encode_values(values)
        for name, rows in (("k_words", kw), ("v_words", vw), ("v_scales", vs)):
            buf = reserve_rows(getattr(self, name), t0, rows, BLOCK)
            setattr(self, name, grow_rows(buf, t0, rows))

    def _encode_values(self, values):
        """Rotated rows ``y = v M``, their RMS ``s`` (float16) and the Lloyd-Max codes of ``y / s``."""
        y = rotate_values(values.astype(mx.float32), self.seed)
        scale = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True)).astype(mx.float16)
        codes = nearest_code(y / mx.maximum(scale.astype(mx.float32), _TINY), odd_poly_gaussian(self.bit_width)[0])
        return pack_bits(codes, self.bit_width), scale[..., 0]

    def _pre_keys(self, a: int, b: int) -> mx.array:
        """Decoded pre-RoPE keys of quantized rows ``a .. b``: [B, H, b - a, D] float32. A code of width
        <= 8 at stream bit ``o`` lies in the 16 bits from byte ``o // 8``: the rows' bytes are paired with
        their next byte once, then one gather per code and a shift (``o % 8``) and mask."""
        byte, shift, mask = self._pair_table()
        by = mx.view(mx.contiguous(self.k_words[:, :, a:b]), mx.uint8)  # (a strided input makes the fused
        # kernels below take MLX's per-element strided loop: ~4x slower)
        pairs = _byte_pairs(by, mx.pad(by[..., 1:], [(0, 0)] * (by.ndim - 1) + [(0, 1)]))
        return _dequantize(mx.take_along_axis(pairs, byte, axis=-1), shift, mask, self.k_lo.astype(mx.float32),
                           self.k_step.astype(mx.float32))

    def _pair_table(self):
        """Per (head, channel): the byte where its code starts (``[1, H, 1, D]``), the code's bit offset in it
        and its width mask (``[H, 1, D]``) (built once per layout; the first two held, the mask is the layout's)."""
        lay = self._layout_of()
        pt = self.__dict__.get("_ptab")
        if pt is None or pt[0] is not lay:
            dt = mx.uint8 if lay.words * 4 <= 256 else mx.uint16
            byte = (lay.word.astype(mx.uint16) * 4 + (lay.shift >> 3)).astype(dt)[None, :, None]
            pt = self._ptab = (lay, byte, (lay.shift & 7)[:, None])
            mx.eval(pt[1:])
        return pt[1], pt[2], lay.mask[:, None]

    def _ptab_arrays(self) -> list:
        pt = self.__dict__.get("_ptab")
        return list(pt[1:]) if pt is not None and pt[0] is self._layout else []

    def _pair_slices(self):
        """The channels of the rotary pairs' first and second members, and the rotated dims."""
        dims = self.rope["dims"]
        if self.rope["traditional"]:
            return slice(0, dims, 2), slice(1, dims, 2), dims
        return slice(0, dims // 2), slice(dims // 2, dims), dims

    def _rotated_keys(self, a: int, b: int):
        """Keys of quantized rows ``a .. b`` with RoPE re-applied, in parts: ``(keys,)`` without RoPE, else
        the rotated pairs' first and second members and the unrotated tail (no interleaving copy)."""
        pre = self._pre_keys(a, b)
        if self.rope is None:
            return (pre,)
        first, second, dims = self._pair_slices()
        cos, sin = angle_tables(self._omega(), self.n_sink + a, b - a)
        return (*_turn(pre[..., first], pre[..., second], cos, sin), pre[..., dims:])

    def _keys(self, a: int, b: int) -> mx.array:
        """Decoded keys of quantized rows ``a .. b``, RoPE re-applied: [B, H, b - a, D] float32."""
        parts = self._rotated_keys(a, b)
        if len(parts) == 1:
            return parts[0]
        u, v, tail = parts
        if self.rope["traditional"]:
            rot = mx.stack([u, v], axis=-1).reshape(*u.shape[:3], -1)
        else:
            rot = mx.concatenate([u, v], axis=-1)
        return mx.concatenate([rot, tail], axis=-1) if tail.shape[-1] else rot

    def _key_scores(self, q: mx.array, a: int, b: int) -> mx.array:
        """``q [B, H, R, D] @ K^T`` over quantized rows ``a .. b`` from the key parts (a matmul each)."""
        parts = self._rotated_keys(a, b)
        if len(parts) == 1:
            return q @ parts[0].swapaxes(-1, -2)
        first, second, dims = self._pair_slices()
        u, v, tail = parts
        s = q[..., first] @ u.swapaxes(-1, -2) + q[..., second] @ v.swapaxes(-1, -2)
        return s + q[..., dims:] @ tail.swapaxes(-1, -2) if tail.shape[-1] else s

    def _weighted_values(self, p: mx.array, a: int, b: int) -> mx.array:
        """``sum_t p_t s_t centroid[code_t]`` over quantized rows ``a .. b`` (rotated domain), [B, H, R, Dv].
        4-bit codes: each byte's two nibbles decoded by one fused kernel into the even and odd channels."""
        pw = p * self.v_scales[:, :, a:b].astype(mx.float32)[:, :, None, :]
        dv = self._shape[2]
        if self.bit_width != 4 or dv % 2:
            return pw @ self._value_codes(a, b)
        even, odd = _nibble_centroids(mx.contiguous(mx.view(self.v_words[:, :, a:b], mx.uint8)[..., : dv // 2]),
                                      *poly_coefficients(4))
        out = mx.stack([pw @ even, pw @ odd], axis=-1)
        return out.reshape(*out.shape[:-2], dv)

    def _value_codes(self, a: int, b: int) -> mx.array:
        """Unit-RMS rotated values (codebook centroids) of quantized rows ``a .. b``, computed from the
        codes arithmetically (the codebook is an odd polynomial of the centred code)."""
        codes = unpack_bits(self.v_words[:, :, a:b], self.bit_width, self._shape[2])
        return odd_poly(codes, (1 << self.bit_width) - 1, *poly_coefficients(self.bit_width))

    def _quantized_dense(self, n):
        memo = self._rows_memo()
        out = memo.get(n, self.k_words)
        if out is None:
            v = self._value_codes(0, n) * self.v_scales[:, :, :n, None].astype(mx.float32)
            out = memo.put(n, self.k_words, (self._keys(0, n), rotate_values(v, self.seed, inverse=True)),
                           keep=dispatch.installed() and kernels.kernels_enabled())
        return out

    def _rows_memo(self) -> "kernels._common.RowsMemo":
        """The memo of the dense quantized rows (their lazy graph, reused between compactions on the
        decode kernels' backend while the dispatch point is installed: then the model's attention
        never evaluates them)."""
        memo = self.__dict__.get("_dense_memo")
        if memo is None:
            memo = self._dense_memo = kernels._common.RowsMemo()
        return memo

    def _trim_rows(self, n: int) -> int:
        self._rows_memo().clear()
        return super()._trim_rows(n)

    def _quantized_tiles(self, q, ranges):
        """Per range of quantized rows: scores on the keys decoded there (RoPE re-applied at their
        positions) and ``sum_t p_t s_t centroid[code_t]``, rotated back once (a fast transform)."""
        return [(lambda a=a, b=b: self._key_scores(q, a, b),
                 lambda p, a=a, b=b: rotate_values(self._weighted_values(p, a, b), self.seed, inverse=True))
                for a, b in ranges]

    # ---- decode (one query row): the fused kernel on the GPU
    def _decode_kernel_ready(self, queries, keys, mask) -> bool:
        """One query row over quantized rows, a string/None mask, kernel shapes, the CUDA backend."""
        call = self._call
        if queries.shape[2] != 1 or call is None or call.q0 == 0 or call.new_k.shape[2] != 1:
            return False
        if not isinstance(mask, (str, type(None))) or keys.shape[2] != call.s0 + call.q0 + call.r0 + 1:
            return False
        H, D, DV = self._shape
        ok = wf_kernel.supported(D, DV, self.k_words.shape[-1], self.v_words.shape[-1]) and power_of_two(DV)
        return ok and call.s0 > 0 and kernels.kernels_enabled()

    def _kernel_constants(self):
        """The kernel's per-cache tables (key layout, float32 ranges, RoPE), built once per calibration."""
        kc = getattr(self, "_kconst", None)
        if kc is None or kc[0] is not self.k_lo:
            D = self._shape[1]
            lay = self._layout_of()
            a, b, c = poly_coefficients(self.bit_width)
            vpoly = mx.array([a, b, c, ((1 << self.bit_width) - 1) / 2], dtype=mx.float32)
            omega = self._omega() if self.rope is not None else None
            kc = (self.k_lo, wf_kernel.key_table(lay), mx.contiguous(self.k_lo[:, :, 0].astype(mx.float32)),
                  mx.contiguous(self.k_step[:, :, 0].astype(mx.float32)),
                  wf_kernel.rope_tables(self.rope, omega, D), vpoly)
            mx.eval(*kc[1:4], *kc[4], kc[5])
            self._kconst = kc
        return kc[1:]

    def _decode_attend(self, queries, *, scale, sinks=None):
        """Attention of one query row in two launches: the decode kernel's split-K partials over the
        codes plus the float16 sinks, the window and the call's own row, then the merge kernel (one
        softmax; the values' Hadamard rotation undone once, as a fast transform)."""
        call, self._call = self._call, None
        ktab, lo, step, rope, vpoly = self._kernel_constants()
        if call.r0 == 0:  # no past window rows: any buffer stands in (0 rows read)
            win_k, win_v = self.sink_k, self.sink_v
        elif self.n_quant == call.q0 and self.n_sink == call.s0:
            win_k, win_v = self.win_k, self.win_v  # the window buffer still holds the past rows first
        else:  # this call compacted the window: its past rows are the record's (a copy of <= 32 rows)
            win_k, win_v = call.past_k, call.past_v
        exact = (self.sink_k, self.sink_v, call.s0, win_k, win_v, call.r0, call.new_k, call.new_v)
        m, l, acc = wf_kernel.waterfill_partials(queries, scale, self.k_words, ktab, lo, step, rope, self.v_words,
                                                 self.v_scales, vpoly, call.q0, call.s0, self.bit_width,
                                                 self._shape[2], exact)
        return kernels.merge_kernel(m, l, acc, sinks, hadamard=True, out_dtype=queries.dtype)

    # ---- attention: observe the queries until calibrated
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if not self.calibrated and getattr(self, "_shape", None):
            self._observe(queries)
        if self.calibrated and self._decode_kernel_ready(queries, keys, mask):  # checked once against the op path
            return kernels.checked_call(
                "waterfill", self, lambda: self._decode_attend(queries, scale=scale, sinks=sinks),
                lambda: ResidualWindowCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks))
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if not self.calibrated and self.stored_rows() >= self.n_calib:
            self._calibrate()
            self._compact_blocks()
        return out

    # ---- accounting and state
    @staticmethod
    def constants_key(c):
        """The value rotation depends on the head dim and the seed (``build_layers`` counts it once)."""
        return (c.head_dim, c.seed)

    def held_arrays(self):
        """``array_fields``, the width layout's tables (and its byte-pair tables), the RoPE angles, the decode
        kernel's tables (once built) and, for the cache that counts it, a non-power-of-two dim's value
        rotation matrix."""
        out = super().held_arrays()
        if self._layout is not None:
            out += self._layout.arrays() + self._ptab_arrays()
        if self._omega_cache is not None:  # the RoPE angles per position, once used
            out.append(self._omega_cache)
        kc = getattr(self, "_kconst", None)
        if kc is not None and kc[0] is self.k_lo:  # the decode kernel's tables, once built
            out += [*kc[1:4], *kc[4], kc[5]]
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
        return 4 * ((self.bit_width * d + 31) // 32) + 4 * ((self.bit_width * dv + 31) // 32) + 2

    def _used(self, name: str):
        return None if name in self.calib_fields else super()._used(name)

    def _set_state(self, v):
        ResidualWindowCache.state.fset(self, v)
        self._rows_memo().clear()
        self._layout = None
        self._omega_cache = None
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


@functools.partial(mx.compile, shapeless=True)  # elementwise only: one fused kernel for any row count
def _dequantize(pairs, shift, mask, k_lo, k_step):
    """``k_lo + code * k_step`` with ``code = (pairs >> shift) & mask`` (``_pre_keys``), one fused kernel."""
    return k_lo + ((pairs >> shift) & mask).astype(mx.float32) * k_step  # (float16 -> 32 per element: 3x slower)


@functools.partial(mx.compile, shapeless=True)
def _byte_pairs(b, following):
    """16-bit windows ``b | following << 8`` of bytes and their next bytes."""
    return b.astype(mx.uint16) | (following.astype(mx.uint16) << 8)


@functools.partial(mx.compile, shapeless=True)
def _nibble_centroids(b, pa, pb, pc):
    """Codebook values of the low and high 4-bit codes of bytes ``b`` (channels 2j and 2j + 1)."""
    return odd_poly(b & 15, 15, pa, pb, pc), odd_poly(b >> 4, 15, pa, pb, pc)
