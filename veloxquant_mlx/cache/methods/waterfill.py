"""Waterfill: per-channel key bits allocated by reverse water-filling on the model's own queries,
pre-RoPE calibrated key ranges, rotated per-token values; float16 sinks and window. The library's
4-bit-class method (a VeloxQuant composition, not one paper).

Why. On SmolLM2 the keys carry the 4-bit error (docs/RESULTS.md, "4-bit class target"): a few key
channels have wide ranges *and* meet large query components, so a uniform width wastes bits on
channels the attention logits barely see. The logit error of channel ``c`` quantized uniformly
over a range ``r_c`` with ``b_c`` bits has variance ``~ E[q_c^2] r_c^2 4^-b_c / 12``; minimising the
sum at a fixed total ``sum_c b_c`` is reverse water-filling (rate-distortion theory for independent
components): every extra bit goes where ``E[q_c^2] r_c^2 4^-b_c`` is largest. The queries are the
model's real ones (the attention dispatch point shows them to the cache).

Ideas used, by source:

* per-channel key quantization with *calibrated* per-channel ranges, on keys *before* RoPE, and
  float16 attention-sink tokens: KVQuant (Hooper et al., arXiv 2401.18079, sections 3.1, 3.2, 3.6);
* channel-wise precision differing per key channel: Kitty (arXiv 2511.18643) boosts a fixed fraction
  of channels to a higher width; here every channel gets its own width, from the allocation above;
* values rotated by a Hadamard transform before per-token quantization (outliers spread over all
  coordinates): QuaRot (Ashkboos et al., arXiv 2404.00456); their coordinates then coded with a
  Lloyd-Max codebook for the Gaussian, scaled per row: TurboQuant-MSE (arXiv 2504.19874);
* a float16 window of the newest tokens: KIVI's residual (arXiv 2402.02750).

Algorithm (per layer; ``b = bit_width_inlier``, ``R = residual_length``):

1. Rows enter a float16 window (``ResidualWindowCache``); until calibration nothing leaves it, and
   every call's queries add ``sum q^2`` per KV head and channel (``q_energy``; with RoPE undone,
   the two channels of a rotary pair share their mean, since a key's pre-RoPE channel meets both).
2. Calibration, once, at the end of the first call after which ``n_calib_tokens`` (default 64) rows
   are stored: keys are un-rotated (the model's RoPE, read from the layer and checked against it,
   inverted by ``primitives.rope.rotate_rows``: the same rotation from angle-addition tables, no
   sine per element; when the layer's RoPE is unknown the keys stay post-RoPE), the range
   ``[lo, hi]`` of every (batch row, head,
   channel) is taken over the stored rows except the first 4 (the sinks), and each head's ``b * D``
   key bits are allocated greedily by marginal gain ``log2(E[q_c^2] (hi - lo)^2) - 2 j`` (the j-th
   bit of channel c; widths 0..8; the top ``b * D`` gains per head): the widths ``k_bits [H, D]``.
3. Rows leaving the window (whole blocks of 16, the newest R..R+15 stay): the stream's first 4
   tokens go to float16 sink rows; the others are quantized.
   Keys: un-rotated, coded ``round((k - lo) / step)`` clamped to ``[0, 2^b_c - 1]`` with
   ``step = (hi - lo) / (2^b_c - 1)`` (0-bit channels reconstruct the range's midpoint), packed at
   their own widths (``primitives.varpack``: ``b * D`` bits per row, in whole 32-bit words).
   Values: ``y = v H`` (normalized Hadamard applied as a fast Walsh-Hadamard transform, no stored
   matrix; a seeded random rotation matrix when ``Dv`` is not a power of two), whose coordinates are then close to Gaussian; each row's RMS ``s`` is stored as float16
   and ``y / s`` is coded coordinate-wise with a ``b``-bit codebook for N(0, 1): TurboQuant-MSE's
   scalar Lloyd-Max quantizer (with the Gaussian limit of its coordinate distribution), its centroids
   replaced by their least-squares fit ``a u + b u^3 + c u^5`` in the centred code ``u`` so that
   decoding is arithmetic (``primitives.codebook.odd_poly_gaussian``: distortion within 0.2% of
   Lloyd-Max's at 4 bits); packed with ``primitives.bitpack``.
4. Attention (``attend``): one softmax over the float16 sinks, the quantized rows and the window plus
   the call's own rows. Quantized keys are decoded (``lo + code * step``, RoPE re-applied at their
   positions by ``rotate_rows``) and multiplied by the queries; the value output is
   ``((p * s) @ centroid[codes]) H^T`` -- the rotation applied once per query, not per row.
   One query row on MLX's CUDA backend (a decode step): the fused kernel of
   ``veloxquant_mlx.cache.kernels.waterfill`` reads each row's key and value words once, decodes
   them in registers, applies RoPE to the query instead of the keys (``q . R(t) k`` as a sum over the
   pre-RoPE key channels), and keeps an online softmax per split of the rows; one more block takes
   the float16 sinks, window and own row, and a merge kernel joins the splits and undoes the
   Hadamard once (two launches per layer). Checked against the op path at first use (falls back with
   a one-line warning); the op path stays the reference and the CPU/Metal path.

Bytes per quantized token and KV head: ``b * D / 8`` (keys, whole words) + ``b * Dv / 8 + 2``
(values + scale); b = 4, D = 64: 32 + 34 = 66 bytes vs 256 at float16 (0.258x). Per cache:
``[B, H, 1, D]`` float16 ``lo``/``step``, the ``[H, D]`` widths and their unpacking tables, the
window (``R + 16`` rows) and 4 sink rows in float16 (on the GPU, once a decode step has run, the
kernel's small tables too); no rotation matrix for a power-of-two ``Dv``, else the seeded rotation
matrix, counted once per model (``build_layers``, as turboquant_rvq).

Measured (``veloxquant eval --task kld``, SmolLM2-135M float32 on the CPU, essay prompt + 32 scored
decode steps; docs/RESULTS.md "Quality targets"): 4 bits with ``residual_length=16``: KLD 0.0009 at
0.296x the fp16 bytes (whole cache) at 1024 tokens, 0.0008 at 0.277x at 2048 -- the 4-bit class target;
2 bits with ``residual_length=32``: KLD 0.065 at 0.159x at 2048 -- the 2-bit class target. Decode speed
is below the plain cache's. CPU: the op path reads the key words with two gathers per channel
(``VarLayout.gather``). H200 (``veloxquant bench --shape llama-8b --random-weights``, 2026-12-01,
docs/data/h200_decode_kernels_2026-12-01.json): 0.40x plain at 8k and 0.31x at 32k with the fused
kernel (0.17x / 0.07x with the op path in the same session); one layer's decode step at 32k
(``scripts/profile_waterfill.py``) 1.08 ms with the kernel vs 5.2 ms on the op path. Most of the
remaining gap is a per-layer cost that hardly grows with the context (+0.53 ms per layer and step over
plain at 8k, +0.77 ms at 32k): host time building each step's graph, which the GPU waits for.

Deviations and limits (all of them):

* KVQuant calibrates per-channel scales offline on a calibration set and quantizes with non-uniform
  (sensitivity-weighted k-means) levels and dense-and-sparse outliers; here ranges come from the
  cache's own first ``n_calib_tokens``, levels are uniform, and sensitivity enters through the bit
  widths instead. Later keys outside the calibrated range are clamped (the range is not refitted);
  pre-RoPE ranges do not drift with position, post-RoPE ones can.
* Calibration happens once; its statistics come from the first calls (prompt), so the cache is not
  chunk-invariant. Without the dispatch point (no queries seen) the widths are allocated with equal
  channel weights, at the first call after ``n_calib_tokens`` rows.
* Values are quantized per token (KIVI's finding: value errors average out over tokens), at the
  uniform width b; the codebook is the Gaussian one (TurboQuant uses the exact Beta-type law of a
  coordinate of a random unit vector and a random rotation; for Dv = 64 the two are close, and a
  Hadamard rotation is cheaper), scaled by the row's RMS instead of its norm.
* ``bit_width_inlier`` sets both the keys' average width and the values' width; ``n_sink_tokens``
  is not used (4 sink rows, as turboquant_rvq).

mlx_lm protocol: as turboquant_rvq (``ResidualWindowCache``): ``offset`` logical, ``state`` with
only the used rows plus the calibration (round trip through ``save_prompt_cache``), trim drops window
rows, then the newest codes; not batchable (``merge`` raises ``BatchingNotSupported``).
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.bitpack import pack_bits, unpack_bits
from ..primitives.buffers import grow_rows, reserve_rows
from ..primitives.codebook import nearest_code, odd_poly_gaussian
from ..primitives.rope import rope_frequencies, rope_spec, rotate_rows
from ..primitives.rotation import hadamard, random_orthogonal
from ..primitives.varpack import VarLayout, extract_codes
from ..attention import group_queries
from .. import dispatch, kernels
from ..kernels import waterfill as wf_kernel
from .turboquant_rvq import SINK_ROWS, ResidualWindowCache

__all__ = ["WaterfillKVCache", "allocate_bits", "value_rotation"]

DEFAULT_CALIB_TOKENS = 64
BLOCK = 16  # rows leave the window in whole blocks of this many
MAX_BITS = 8
_TINY = 1e-30
_ROTATIONS: dict[tuple, mx.array] = {}


def allocate_bits(sensitivity, total: int, max_bits: int = MAX_BITS) -> np.ndarray:
    """Greedy reverse water-filling: ``total`` bits per row of ``sensitivity [G, D]`` (>= 0), each
    bit to the channel whose ``log2(sensitivity) - 2 * (bits it has)`` is largest. Returns int
    widths ``[G, D]`` in ``0..max_bits`` with every row summing to ``total``."""
    s = np.asarray(sensitivity, dtype=np.float64)
    G, D = s.shape
    if not 0 <= total <= max_bits * D:
        raise ValueError(f"total={total} bits cannot be spread over {D} channels of at most {max_bits} bits")
    gain = np.log2(np.maximum(s, _TINY))[:, :, None] - 2.0 * np.arange(max_bits)[None, None, :]
    flat = gain.reshape(G, D * max_bits)
    # stable order: among equal gains the lower channel / lower bit first (gains fall with j per channel,
    # so the chosen set always takes a channel's bits in order)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :total]
    widths = np.zeros(G * D, dtype=np.int64)
    np.add.at(widths, (np.arange(G)[:, None] * D + order // max_bits).reshape(-1), 1)
    return widths.reshape(G, D)


def _power_of_two(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def rotate_values(y: mx.array, seed: int, inverse: bool = False) -> mx.array:
    """``y M`` (or ``y M^T``) over the last axis with the values' rotation ``M``: for a power-of-two
    dim the normalized Hadamard applied as a fast Walsh-Hadamard transform (``mx.hadamard_transform``,
    ``O(Dv log Dv)`` per row, no stored matrix; ``H`` is symmetric and orthogonal, so it is its own
    inverse), else the seeded random rotation's matrix."""
    dv = y.shape[-1]
    if _power_of_two(dv):
        return mx.hadamard_transform(y, scale=dv**-0.5)
    m = value_rotation(dv, seed)
    return y @ (m.T if inverse else m)


def value_rotation(dim: int, seed: int) -> mx.array:
    """The values' rotation as a matrix ``[Dv, Dv]`` (rows are rotated by ``v @ M``): normalized
    Hadamard for a power-of-two ``dim`` (the caches apply it as a transform, :func:`rotate_values`, and
    hold no matrix), else a seeded Haar-random orthogonal matrix (held, one array per process)."""
    key = (int(dim), int(seed))
    m = _ROTATIONS.get(key)
    if m is None:
        m = hadamard(dim) if dim & (dim - 1) == 0 else random_orthogonal(dim, seed)
        _ROTATIONS[key] = m = mx.contiguous(m)
        mx.eval(m)
    return m


@register_with_mlx_lm
@register("waterfill")
class WaterfillKVCache(ResidualWindowCache):
    """Query-weighted per-channel key widths, pre-RoPE calibrated key ranges, rotated per-token
    values, float16 sinks + window. See the module docstring."""

    chunk_invariant = False  # widths and ranges are calibrated once, on the first calls' rows and queries
    exact_trim = False  # rows the trimmed rows pushed out of the window stay quantized (as turboquant_rvq)
    quant_block = BLOCK

    array_fields = ("k_words", "k_lo", "k_step", "k_bits", "v_words", "v_scales", "q_energy",
                    "win_k", "win_v", "sink_k", "sink_v")
    scalar_fields = ("n_sink", "n_quant", "n_win", "dtype_name", "q_count", "rope", "counts_constants",
                     "saliency_source")
    object_scalar_fields = ("rope",)  # the layer's RoPE spec (primitives.rope)
    calib_fields = ("k_lo", "k_step", "k_bits", "q_energy")  # not per-row: saved whole
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
        self.residual_length = int(c.residual_length)
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

    def _post_rope(self, k: mx.array, offset: int) -> mx.array:
        return rotate_rows(k, self.rope, self._omega(), offset) if self.rope is not None else k

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
                w = _pair_mean(w, self.rope)
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
        codes = nearest_code(y / mx.maximum(scale.astype(mx.float32), _TINY), self._codebook())
        return pack_bits(codes, self.bit_width), scale[..., 0]

    def _codebook(self) -> mx.array:
        return odd_poly_gaussian(self.bit_width)[0]

    def _rotation(self, dv: int) -> mx.array:
        return value_rotation(dv, self.seed)

    def _keys(self, n: int) -> mx.array:
        """Decoded keys of the first ``n`` quantized rows, RoPE re-applied: [B, H, n, D] float32."""
        lay = self._layout_of()
        lo, hi = lay.gather(self.k_words[:, :, :n])
        shift, mask = lay.shift[:, None].astype(mx.uint32), lay.mask[:, None].astype(mx.uint32)
        pre = _dequantize(lo, hi, shift, mask, self.k_lo.astype(mx.float32), self.k_step.astype(mx.float32))
        return self._post_rope(pre, self.n_sink)

    def _value_codes(self, n: int) -> mx.array:
        """Unit-RMS rotated values (codebook centroids) of the first ``n`` quantized rows, computed
        from the codes arithmetically (the codebook is an odd polynomial of the centred code)."""
        codes = unpack_bits(self.v_words[:, :, :n], self.bit_width, self._shape[2])
        a, b, c = _poly_coefficients(self.bit_width)
        return _odd_poly(codes, (1 << self.bit_width) - 1, a, b, c)

    def _quantized_dense(self, n):
        memo = self._rows_memo()
        out = memo.get(n, self.k_words)
        if out is None:
            v = self._value_codes(n) * self.v_scales[:, :, :n, None].astype(mx.float32)
            out = memo.put(n, self.k_words, (self._keys(n), rotate_values(v, self.seed, inverse=True)),
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

    def _quantized_part(self, q, n):
        scores = q @ self._keys(n).swapaxes(-1, -2)
        vc = self._value_codes(n)
        vs = self.v_scales[:, :, :n].astype(mx.float32)[:, :, None, :]

        def value_fn(p):  # sum_t p_t s_t centroid[code_t], rotated back once per query row
            return rotate_values((p * vs) @ vc, self.seed, inverse=True)

        return scores, value_fn

    def _quantized_tiles(self, q, ranges):
        """Prefill tiles: keys decoded per tile (RoPE re-applied at the tile's positions), values from
        their codes; the value rotation (``rotate_values``: a fast transform, no matrix) once per tile."""
        lay = self._layout_of()
        shift, mask = lay.shift[:, None].astype(mx.uint32), lay.mask[:, None].astype(mx.uint32)
        k_lo, k_step = self.k_lo.astype(mx.float32), self.k_step.astype(mx.float32)
        top = (1 << self.bit_width) - 1
        a3, b3, c3 = _poly_coefficients(self.bit_width)

        def scores(a, b):
            lo, hi = lay.gather(self.k_words[:, :, a:b])
            keys = self._post_rope(_dequantize(lo, hi, shift, mask, k_lo, k_step), self.n_sink + a)
            return q @ keys.swapaxes(-1, -2)

        def values(p, a, b):
            vc = _odd_poly(unpack_bits(self.v_words[:, :, a:b], self.bit_width, self._shape[2]), top, a3, b3, c3)
            vs = self.v_scales[:, :, a:b].astype(mx.float32)[:, :, None, :]
            return rotate_values((p * vs) @ vc, self.seed, inverse=True)

        return [(lambda a=a, b=b: scores(a, b), lambda p, a=a, b=b: values(p, a, b)) for a, b in ranges]

    # ---- decode (one query row): the fused kernel on the GPU
    def _decode_kernel_ready(self, queries, keys, mask) -> bool:
        """Whether this call can take the fused decode kernel: one query row, quantized rows stored,
        a string/None mask, shapes the kernel handles, and the CUDA backend."""
        call = self._call
        if queries.shape[2] != 1 or call is None or call.q0 == 0 or call.new_k.shape[2] != 1:
            return False
        if not isinstance(mask, (str, type(None))) or keys.shape[2] != call.s0 + call.q0 + call.r0 + 1:
            return False
        H, D, DV = self._shape
        ok = wf_kernel.supported(D, DV, self.k_words.shape[-1], self.v_words.shape[-1]) and _power_of_two(DV)
        return ok and call.s0 > 0 and kernels.kernels_enabled()

    def _kernel_constants(self):
        """The kernel's per-cache tables (key layout, float32 ranges, RoPE), built once per calibration."""
        kc = getattr(self, "_kconst", None)
        if kc is None or kc[0] is not self.k_lo:
            D = self._shape[1]
            lay = self._layout_of()
            a, b, c = _poly_coefficients(self.bit_width)
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

    def _decode_checked(self, queries, keys, values, *, scale, mask, sinks):
        """The kernel path, checked once per process against the op path (``kernels.checked_call``)."""
        return kernels.checked_call(
            "waterfill", self, lambda: self._decode_attend(queries, scale=scale, sinks=sinks),
            lambda: ResidualWindowCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks))

    # ---- attention: observe the queries until calibrated
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if not self.calibrated and getattr(self, "_shape", None):
            self._observe(queries)
        if self.calibrated and self._decode_kernel_ready(queries, keys, mask):
            return self._decode_checked(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if not self.calibrated and self.stored_rows() >= self.n_calib:
            self._calibrate()
            R, w = self.residual_length, self.n_win
            if w >= R + BLOCK:
                self._compact((w - R) // BLOCK * BLOCK)
        return out

    # ---- accounting and state
    @staticmethod
    def constants_key(c):
        """The value rotation depends on the head dim and the seed (``build_layers`` counts it once)."""
        return (c.head_dim, c.seed)

    def held_arrays(self):
        """The arrays of ``array_fields``, the width layout's tables, the RoPE angle table, the decode
        kernel's tables (once built) and, for the cache that counts it, a value rotation matrix (only
        for a non-power-of-two value dim), so ``nbytes`` is their sum."""
        out = super().held_arrays()
        if self._layout is not None:
            out += self._layout.arrays()
        if self._omega_cache is not None:  # the RoPE angles per position, once used
            out.append(self._omega_cache)
        kc = getattr(self, "_kconst", None)
        if kc is not None and kc[0] is self.k_lo:  # the decode kernel's tables, once built
            out += [*kc[1:4], *kc[4], kc[5]]
        if self.counts_constants and getattr(self, "_shape", None) and not _power_of_two(self._shape[2]):
            out.append(self._rotation(self._shape[2]))
        return out

    @property
    def constant_nbytes(self) -> int:
        """Bytes of the value rotation matrix (shared by every layer with the same value dim and seed;
        none for a power-of-two dim: the Hadamard is applied as a transform)."""
        shape = getattr(self, "_shape", None)
        return self._rotation(shape[2]).nbytes if shape and not _power_of_two(shape[2]) else 0

    def bytes_per_token(self, head_dim: Optional[int] = None, value_dim: Optional[int] = None) -> int:
        """Bytes of one quantized token per KV head: key words + value words + the value scale."""
        d = head_dim or (self._shape[1] if getattr(self, "_shape", None) else self.config.head_dim)
        dv = value_dim or (self._shape[2] if getattr(self, "_shape", None) else d)
        return 4 * ((self.bit_width * d + 31) // 32) + 4 * ((self.bit_width * dv + 31) // 32) + 2

    def _used(self, name: str):
        return None if name in self.calib_fields else super()._used(name)

    @property
    def state(self):
        return ResidualWindowCache.state.fget(self)

    @state.setter
    def state(self, v):
        ResidualWindowCache.state.fset(self, v)
        self._rows_memo().clear()
        self._layout = None
        self._omega_cache = None
        if self.k_bits is not None:
            self._layout_of()  # held from the start, as in the cache that was saved

    @property
    def used_nbytes(self) -> int:
        """Bytes of the used rows of every array (spare capacity and the shared rotation left out)."""
        rows = sum(a[:, :, : self._used(n)].nbytes for n in self.array_fields if (a := getattr(self, n)) is not None)
        return rows + (self._layout.nbytes if self._layout is not None else 0)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            shared = k in ("config", "_layout", "_omega_cache", "_kconst") or isinstance(v, mx.Dtype)
            setattr(new, k, v if shared else copy.deepcopy(v, memo))
        return new


@functools.partial(mx.compile, shapeless=True)  # elementwise only: one fused kernel for any row count
def _dequantize(lo, hi, shift, mask, k_lo, k_step):
    """``k_lo + code * k_step`` from the words gathered for each channel (``VarLayout.gather``), one
    fused kernel with the code extraction."""
    return k_lo + extract_codes(lo, hi, shift, mask).astype(mx.float32) * k_step


@functools.lru_cache(maxsize=8)
def _poly_coefficients(bits: int) -> tuple[float, float, float]:
    """``(a, b, c)`` of the values' odd-polynomial codebook (computed once per width: decode steps use it)."""
    return tuple(odd_poly_gaussian(bits)[1])


@functools.partial(mx.compile, shapeless=True)  # elementwise only: one fused kernel for any row count
def _odd_poly(codes, top, a, b, c):
    u = codes.astype(mx.float32) - top / 2
    u2 = u * u
    return u * (a + u2 * (b + c * u2))


def _pair_mean(w: mx.array, spec: dict) -> mx.array:
    """Average ``w [H, D]`` over the channel pairs RoPE rotates together (its first ``dims`` channels:
    adjacent pairs when ``traditional``, else channel i with i + dims/2)."""
    dims = spec["dims"]
    head, tail = w[:, :dims], w[:, dims:]
    H = w.shape[0]
    if spec["traditional"]:
        m = head.reshape(H, dims // 2, 2).mean(axis=-1, keepdims=True)
        head = mx.broadcast_to(m, (H, dims // 2, 2)).reshape(H, dims)
    else:
        m = (head[:, : dims // 2] + head[:, dims // 2 :]) / 2
        head = mx.concatenate([m, m], axis=1)
    return mx.concatenate([head, tail], axis=1) if tail.shape[1] else head
