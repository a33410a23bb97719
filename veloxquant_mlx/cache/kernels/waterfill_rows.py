"""Prefill kernels for waterfill's layout: rows in and out of the codes in one launch each, where the op path
takes ~40 small ops (the pre-RoPE rotation, rounding, a bit-stream gather and sum per packed word) to encode a
chunk and a byte-pair gather per code to decode the past. On the H200 these two were most of a prefill chunk's
cost beyond the plain cache's (``scripts/prefill_chunk_cost.py``, docs/RESULTS.md).

* :func:`encode_rows`: key rows -> pre-RoPE -> ``round((k - lo) / step)`` clipped to each channel's width, packed
  at its bit offset (``varpack``'s stream layout); value rows -> Hadamard -> RMS scale (float16) -> the
  codebook's nearest code (the same binary search over the boundaries as ``codebook.nearest_code``), packed
  ``bitpack``-style. The same codes as the op path but for a float32 rounding tie (a Hadamard sum or an angle
  differing in its last bit can move a value across a decision boundary).
* :func:`decode_rows`: the first ``n`` quantized rows as dense keys (RoPE re-applied at their positions) and
  values (Hadamard undone), in the model's dtype: the rows a GPU prefill chunk's fused attention reads.

One warp per row: lane ``l`` holds channels ``l + 32 j``; a rotary partner is read through the warp's shared
row, the Hadamard butterflies are shuffles (lane bits) and register pairs (``j`` bits). Tested against the op
path (``tests/test_decode_kernels.py``) and checked once per process at first use (``kernels.checked_call``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..primitives.codebook import code_boundaries, odd_poly_gaussian
from ..primitives.bitpack import packed_words, unpack_bits
from ._common import checked_call, relative_error
from ._compile import Kernel
from .waterfill import VALUE_DECODE, cache_constants

__all__ = ["encode_rows", "decode_rows", "supported"]

WARPS = 4

_HEAD = r"""
  const int warp = VQ_WARP, lane = VQ_LANE;
  const int t = VQ_BLOCK_X * NW + warp;
  const int bh = VQ_BLOCK_Y;
  if (t >= n) return;  // a whole warp: its row is past the end
  const int h = bh % H;
  constexpr int CJ = D / 32;
  constexpr int VJ = DV / 32;
  VQ_SHARED float row[NW][D];
"""

# In-warp normalized Hadamard transform of x[VJ] at channels lane + 32 j (Sylvester order, self-inverse).
_FWHT = r"""
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
    for (int j = 0; j < VJ; ++j) {
      const float o = VQ_SHFL_XOR(x[j], m);
      x[j] = (lane & m) ? o - x[j] : x[j] + o;
    }
  }
#pragma unroll
  for (int m = 1; m < VJ; m <<= 1) {
#pragma unroll
    for (int j = 0; j < VJ; ++j) {
      if (j & m) continue;
      const float a = x[j], b = x[j | m];
      x[j] = a + b;
      x[j | m] = a - b;
    }
  }
  const float vnorm = rsqrtf((float)DV);
#pragma unroll
  for (int j = 0; j < VJ; ++j) x[j] *= vnorm;
"""

# cos/sin of channel c's angle at row t's position (angle 0 where RoPE does not rotate).
_ROPE = r"""
    const float ang = (float)(pos0 + t) * rw[c];
    float sn, cs;
    sincosf(ang, &sn, &cs);
"""

_ENCODE = _HEAD + r"""
  VQ_SHARED vq_u32 kbits[NW][32];
  VQ_SHARED vq_u32 vbits[NW][32];
  const size_t r = (size_t)bh * n + t;
  kbits[warp][lane] = 0u;
  vbits[warp][lane] = 0u;
#pragma unroll
  for (int j = 0; j < CJ; ++j) row[warp][lane + 32 * j] = VQ_F(k[r * D + lane + 32 * j]);
  VQ_SYNCWARP();
#pragma unroll
  for (int j = 0; j < CJ; ++j) {
    const int c = lane + 32 * j;
""" + _ROPE + r"""
    const float pre = row[warp][c] * cs + rs[c] * row[warp][rp[c]] * sn;  // the inverse rotation
    const vq_u32 tb = ktab[h * D + c];
    const vq_u32 word = tb & 255u, shift = (tb >> 8) & 31u, width = (tb >> 16) & 15u;
    const float stp = kst[bh * D + c];
    float code = rintf((pre - klo[bh * D + c]) / (stp > 0.f ? stp : 1.f));
    code = fminf(fmaxf(code, 0.f), (float)((1u << width) - 1u));
    const vq_u32 u = (vq_u32)code;
    if (width) {
      VQ_ATOMIC_OR(&kbits[warp][word], u << shift);
      if (shift + width > 32u) VQ_ATOMIC_OR(&kbits[warp][word + 1], u >> (32u - shift));
    }
  }
  float x[VJ];
#pragma unroll
  for (int j = 0; j < VJ; ++j) x[j] = VQ_F(v[r * DV + lane + 32 * j]);
""" + _FWHT + r"""
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < VJ; ++j) ss += x[j] * x[j];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += VQ_SHFL_XOR(ss, o);
  vq_f16 s16;
  {
    // the float16 scale, as the op path's sqrt(mean(y^2)).astype(float16), and its float32 value
    unsigned short hb;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(sqrtf(ss / (float)DV)));
    s16.b = hb;
  }
  const float sc = fmaxf(VQ_F(s16), 1e-30f);
#pragma unroll
  for (int j = 0; j < VJ; ++j) {
    const float y = x[j] / sc;
    int idx = 0;
#pragma unroll
    for (int lv = 0; lv < LEVELS; ++lv) {
      const int cand = idx + (1 << (LEVELS - 1 - lv));
      if (y > bnd[cand - 1]) idx = cand;
    }
    const int bit = (lane + 32 * j) * VB;
    VQ_ATOMIC_OR(&vbits[warp][bit >> 5], ((vq_u32)idx) << (bit & 31));
    if ((bit & 31) + VB > 32) VQ_ATOMIC_OR(&vbits[warp][(bit >> 5) + 1], ((vq_u32)idx) >> (32 - (bit & 31)));
  }
  VQ_SYNCWARP();
  if (lane < WK) okw[r * WK + lane] = kbits[warp][lane];
  if (lane < WV) ovw[r * WV + lane] = vbits[warp][lane];
  if (lane == 0) ovs[r] = s16;
"""

_DECODE = _HEAD + r"""
  const vq_u32 kword = lane < WK ? kw[((size_t)bh * TK + t) * WK + lane] : 0u;
  const vq_u32 vword = lane < WV ? vw[((size_t)bh * TV + t) * WV + lane] : 0u;
  const size_t r = (size_t)bh * n + t;
#pragma unroll
  for (int j = 0; j < CJ; ++j) {
    const int c = lane + 32 * j;
    const vq_u32 tb = ktab[h * D + c];
    const vq_u32 wi = tb & 255u, sh = (tb >> 8) & 31u, mk = (1u << ((tb >> 16) & 15u)) - 1u;
    const vq_u32 a = VQ_SHFL(kword, (int)wi);
    const vq_u32 b = VQ_SHFL(kword, (int)min(wi + 1u, (vq_u32)(WK - 1)));
    const vq_u32 code = ((a >> sh) | ((b << (31u - sh)) << 1)) & mk;
    row[warp][c] = klo[bh * D + c] + (float)code * kst[bh * D + c];
  }
  VQ_SYNCWARP();
#pragma unroll
  for (int j = 0; j < CJ; ++j) {
    const int c = lane + 32 * j;
""" + _ROPE + r"""
    vq_store(ok + r * D + c, row[warp][c] * cs - rs[c] * row[warp][rp[c]] * sn);
  }
  const float vscale = VQ_F(vs[(size_t)bh * TS + t]);
  const float pa = vpoly[0], pb = vpoly[1], pc = vpoly[2], half_top = vpoly[3];
  constexpr vq_u32 VMASK = (1u << VB) - 1u;
  float x[VJ];
""" + VALUE_DECODE.replace("VQ_OUT", "x") + _FWHT + r"""
#pragma unroll
  for (int j = 0; j < VJ; ++j) vq_store(ov + r * DV + lane + 32 * j, x[j]);
"""

_ENCODE_K = Kernel("vq_waterfill_encode", ["k", "v", "ktab", "klo", "kst", "rw", "rp", "rs", "bnd"],
                   ["okw", "ovw", "ovs"], [("n", "int"), ("pos0", "int"), ("H", "int")], _ENCODE)
_DECODE_K = Kernel("vq_waterfill_rows", ["kw", "ktab", "klo", "kst", "rw", "rp", "rs", "vw", "vs", "vpoly"],
                   ["ok", "ov"], [("n", "int"), ("pos0", "int"), ("H", "int"), ("TK", "int"), ("TV", "int"),
                                  ("TS", "int")], _DECODE)


def supported(c) -> bool:
    """Head dims multiples of 32 (value dim a power of two: the in-warp Hadamard) and rows of at most 32 words."""
    shape = getattr(c, "_shape", None)
    if not shape or c.k_bits is None:
        return False
    _, d, dv = shape
    return (d % 32 == 0 and dv % 32 == 0 and dv & (dv - 1) == 0 and 0 < c._layout_of().words <= 32
            and packed_words(dv, c.bit_width) <= 32)


def _grid(n: int, B: int, H: int) -> dict:
    return {"grid": (32 * WARPS * -(-n // WARPS), B * H, 1), "threads": (32 * WARPS, 1, 1)}


@functools.lru_cache(maxsize=8)
def _boundaries(bits: int) -> tuple[mx.array, int]:
    """The codebook's decision boundaries padded with +inf to a power of two, and the search depth."""
    levels = max(1, ((1 << bits) - 1).bit_length())
    bnd = code_boundaries(odd_poly_gaussian(bits)[0])
    pad = (1 << levels) - bnd.size
    return mx.concatenate([bnd, mx.full((pad,), float("inf"), dtype=mx.float32)]) if pad else bnd, levels


def encode_rows(c, keys: mx.array, values: mx.array, pos0: int):
    """(key words, value words, value scales) of rows ``keys``/``values`` [B, H, n, D] at positions ``pos0 ..``:
    :meth:`WaterfillKVCache._key_codes` packed + :meth:`_encode_values` in one launch."""
    B, H, n, D = keys.shape
    dv = values.shape[-1]
    ktab, lo, step, (rw, rp, rs, *_), _ = cache_constants(c)
    bnd, levels = _boundaries(c.bit_width)
    wk, wv = c._layout_of().words, packed_words(dv, c.bit_width)
    consts = (("D", D), ("DV", dv), ("WK", wk), ("WV", wv), ("VB", c.bit_width), ("LEVELS", levels), ("NW", WARPS))
    return _ENCODE_K([keys, values, ktab, lo, step, rw, rp, rs, bnd], [n, pos0, H], consts,
                     [(B, H, n, wk), (B, H, n, wv), (B, H, n)], [mx.uint32, mx.uint32, mx.float16], **_grid(n, B, H))


def decode_rows(c, n: int, dtype) -> tuple[mx.array, mx.array]:
    """Dense (keys with RoPE, values) [B, H, n, D] of cache ``c``'s first ``n`` quantized rows, in ``dtype``."""
    ktab, lo, step, (rw, rp, rs, *_), vpoly = cache_constants(c)
    B, H, TK, WK = c.k_words.shape
    _, D, dv = c._shape
    consts = (("D", D), ("DV", dv), ("WK", WK), ("WV", c.v_words.shape[-1]), ("VB", c.bit_width), ("NW", WARPS))
    return tuple(_DECODE_K([c.k_words, ktab, lo, step, rw, rp, rs, c.v_words, c.v_scales, vpoly],
                           [n, c.n_sink, H, TK, c.v_words.shape[2], c.v_scales.shape[2]], consts,
                           [(B, H, n, D), (B, H, n, dv)], [dtype, dtype], **_grid(n, B, H)))


def checked_decode(c, n: int, dtype, op_fn):
    """:func:`decode_rows`, checked once per process against ``op_fn()`` (the op path's dense rows)."""
    return checked_call("waterfill_rows", c, lambda: decode_rows(c, n, dtype), op_fn)


def checked_encode(c, keys, values, pos0: int, op_fn):
    """:func:`encode_rows`, checked once per process against ``op_fn()`` (the op path's words and scales): the
    fraction of differing key and value codes plus the scales' relative error must stay below the check's
    tolerance (a rounding tie flips a code now and then; a layout error flips most)."""
    lay, b, dv = c._layout_of(), c.bit_width, values.shape[-1]

    def error(got, want):
        keys_off = (lay.unpack(got[0]) != lay.unpack(want[0])).astype(mx.float32).mean()
        values_off = (unpack_bits(got[1], b, dv) != unpack_bits(want[1], b, dv)).astype(mx.float32).mean()
        return float(keys_off + values_off) + relative_error(got[2], want[2])

    return checked_call("waterfill_encode", c, lambda: encode_rows(c, keys, values, pos0), op_fn, error)
