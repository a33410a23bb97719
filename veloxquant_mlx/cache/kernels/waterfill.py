"""Decode kernel for waterfill's layout: variable-width pre-RoPE key codes (``primitives.varpack``) and
rotated-domain value codes of one width with a per-row scale (``primitives.bitpack`` + the odd
polynomial codebook).

One warp walks its tokens in order, PF rows at a time (their words loaded together: independent loads in flight).
Lanes 0..WK-1 hold a key row's words (each word read once, coalesced); every lane decodes its D/32 key channels
``lane + 32 j`` (two shuffles, a funnel shift and a mask: ``lo + code * step``). RoPE: ``q . R(t) k``. Where a rotary
pair lies in one lane (the half-split rotation over all channels with d/2 a multiple of 32: ``paired_rope``) the lane
rotates its key pair once per row and every query head reads it unrotated; otherwise the query side carries the
rotation, ``sum_c k_c (q_c cos(t w_c) + s_c q_p(c) sin(t w_c))`` with ``p(c)`` the channel's partner and ``s_c`` its
sign. Either way each lane's (cos, sin) advance by one rotation per row. A group's PF rows x RP2 query heads of lane
partial scores are summed over the warp by one reduce-scatter (each step halves what a lane holds: NV - 1 shuffles
for NV scores instead of 5 per score), leaving one score per lane; the online softmax then rescales once per group
and head and takes one exp per lane, and each weight is broadcast to the lanes for the value sum. Value codes that
never straddle a word (``VMAP``) are decoded without shuffles, each lane taking VJ consecutive channels of one word
(``VQ_VCH`` maps them back). The value sum stays in the rotated domain (the merge rotates back once).

The grouping exists because the kernel is bound by instruction issue (docs/RESULTS.md "Waterfill's decode kernel:
rows and heads grouped"). The reduce-scatter's steps are written out so that its scores stay in registers (as a loop
nest nvcc did not unroll them: local memory; ``tests/test_kernel_compile.py``).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..primitives.rope import frequencies_of, spec_key
from ..primitives.value_rotation import poly_coefficients
from ._common import (ACC_INIT, BLOCK_MERGE, EXACT_ROWS, WARPS, Merge, exact_args, kernel_variants, launch,
                      shared_limit, split_count, step_counters, window_exact)

PREFETCH = 4  # rows whose words a warp loads before decoding them (memory-level parallelism)

__all__ = ["waterfill_partials", "key_table", "rope_tables", "paired_rope", "supported", "cache_constants",
           "held_constants", "decode_attend"]

# A value row's channels lane + 32 j (j < VJ) decoded from the row's words (``vword``: word ``lane`` of the row,
# spread over the warp) into VQ_OUT[j]: the odd-polynomial centroid of the VB-bit code times the row scale ``vscale``.
VALUE_DECODE = r"""
#pragma unroll
  for (int j = 0; j < VJ; ++j) {
    const int bit = (lane + 32 * j) * VB;
    const vq_u32 a = VQ_SHFL(vword, bit >> 5);
    const vq_u32 b = VQ_SHFL(vword, min((bit >> 5) + 1, WV - 1));
    const vq_u32 sft = (vq_u32)(bit & 31);
    const vq_u32 code = ((a >> sft) | ((b << (31u - sft)) << 1)) & VMASK;
    const float u = (float)code - half_top;
    const float u2 = u * u;
    VQ_OUT[j] = vscale * (u * (pa + u2 * (pb + pc * u2)));
  }
"""

_SOURCE = r"""
  const int bh = VQ_BLOCK_X;
VQ_COUNTS
  const int h = bh % H;  // the key table's row (H: its rows; a batch form's tables are per sequence and head)
  const int s = VQ_BLOCK_Y;
  const int S1 = VQ_GRID_Y;
  const int S = S1 - 1;  // splits of the quantized rows; block row S takes the exact rows
  const int lane = VQ_LANE, warp = VQ_WARP;
  constexpr int CJ = D / 32;
  constexpr int VJ = DV / 32;
  constexpr vq_u32 VMASK = (1u << VB) - 1u;
  constexpr int NV = PF * RP2;      // scores a group of PF rows reduces at once: PF rows x RP2 query heads
  constexpr int LSH = 5 - LNV;      // after the reduce-scatter lane holds score (lane >> LSH) = row * RP2 + head
  constexpr int CPW = 32 / VB;      // value channels per word (VMAP: each lane decodes VJ of one word's)
#undef VQ_VCH
#define VQ_VCH(l, j) (VMAP ? (((l) % WV) * CPW + ((l) / WV) * VJ + (j)) : ((l) + 32 * (j)))
  const int per = (n + S - 1) / S;
  const int t_begin = min(n, s * per);
  const int t_end = min(n, t_begin + per);
  const int wper = (t_end - t_begin + NW - 1) / NW;
  const int w0 = min(t_end, t_begin + warp * wper);
  const int w1 = min(t_end, w0 + wper);

  vq_u32 wi[CJ], wi1[CJ], sh[CJ], mk[CJ];
  float lo[CJ], st[CJ], cs[CJ], sn[CJ], cw[CJ], sw[CJ];
  float qa[REP][CJ], qb[REP][CJ];
#pragma unroll
  for (int j = 0; j < CJ; ++j) {
    const int c = lane + 32 * j;
    const vq_u32 tb = ktab[h * D + c];
    wi[j] = tb & 255u;
    wi1[j] = min(wi[j] + 1u, (vq_u32)(WK - 1));
    sh[j] = (tb >> 8) & 31u;
    mk[j] = (1u << ((tb >> 16) & 15u)) - 1u;
    lo[j] = klo[bh * D + c];
    st[j] = kst[bh * D + c];
    const float om = rw[c];
    sincosf(om, &sw[j], &cw[j]);
    sincosf((float)(pos0 + w0) * om, &sn[j], &cs[j]);
    const int p = rp[c];
    const float sg = rs[c];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      qa[r][j] = VQ_F(q[(bh * REP + r) * D + c]) * scale;
      qb[r][j] = sg * VQ_F(q[(bh * REP + r) * D + p]) * scale;
    }
  }
  const float pa = vpoly[0], pb = vpoly[1], pc = vpoly[2], half_top = vpoly[3];
""" + ACC_INIT + r"""
// key channel lane + 32 j of the row whose words lane i holds in ``kword``: two shuffles, a funnel shift, a mask
#define WF_KEY(j) (lo[j] + (float)(VQ_FUNNEL(VQ_SHFL(kword, (int)wi[j]), VQ_SHFL(kword, (int)wi1[j]), sh[j]) & mk[j]) \
                   * st[j])
#define WF_TURN(j) {                                                                      \
    const float c2 = cs[j] * cw[j] - sn[j] * sw[j];                                        \
    sn[j] = sn[j] * cw[j] + cs[j] * sw[j];                                                 \
    cs[j] = c2;                                                                            \
  }
  if (s == S) {
#define QV(r, j) qa[r][j]
""" + EXACT_ROWS + r"""
#undef QV
  } else for (int t0 = w0; t0 < w1; t0 += PF) {
    // the next PF rows' words are loaded together (independent loads in flight)
    vq_u32 kwd[PF], vwd[PF];
    float vsf[PF];
    const int vlane = VMAP ? lane % WV : lane;
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int t = min(t0 + i, w1 - 1);
      kwd[i] = lane < WK ? kw[((size_t)bh * TK + t) * WK + lane] : 0u;
      vwd[i] = vlane < WV ? vw[((size_t)bh * TV + t) * WV + vlane] : 0u;
      vsf[i] = VQ_F(vs[(size_t)bh * TS + t]);
    }
    // each lane's share of the PF rows' scores for every query head: sv[row * RP2 + head]
    float sv[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) sv[i] = 0.f;
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const vq_u32 kword = kwd[i];
      if (PAIR) {  // channel j's rotary partner is the lane's j + CJ/2: rotate the key pair, not the query
#pragma unroll
        for (int j = 0; j < CJ / 2; ++j) {
          const float k1 = WF_KEY(j), k2 = WF_KEY(j + CJ / 2);
          const float r1 = k1 * cs[j] - k2 * sn[j], r2 = k1 * sn[j] + k2 * cs[j];
#pragma unroll
          for (int r = 0; r < REP; ++r) sv[i * RP2 + r] += qa[r][j] * r1 + qa[r][j + CJ / 2] * r2;
          WF_TURN(j)
        }
      } else {
#pragma unroll
        for (int j = 0; j < CJ; ++j) {
          const float k = WF_KEY(j);
#pragma unroll
          for (int r = 0; r < REP; ++r) sv[i * RP2 + r] += k * (qa[r][j] * cs[j] + qb[r][j] * sn[j]);
          WF_TURN(j)
        }
      }
    }
    // reduce-scatter: each step halves the values a lane holds, so NV scores take NV - 1 shuffles, not 5 NV (steps
    // written out so that every index is a constant: sv stays in registers)
#define WF_HALVE(k)                                                                        \
    if ((k) < LNV) {                                                                       \
      constexpr int hf = NV >> ((k) + 1);                                                  \
      const bool up = (lane & (16 >> (k))) != 0;                                           \
      _Pragma("unroll") for (int i = 0; i < hf; ++i) {                                     \
        const float send = up ? sv[i] : sv[i + hf];                                        \
        const float keep = up ? sv[i + hf] : sv[i];                                        \
        sv[i] = keep + VQ_SHFL_XOR(send, 16 >> (k));                                       \
      }                                                                                    \
    }
    WF_HALVE(0) WF_HALVE(1) WF_HALVE(2) WF_HALVE(3) WF_HALVE(4)
#undef WF_HALVE
    float sc = sv[0];
#pragma unroll
    for (int o = 16 >> LNV; o > 0; o >>= 1) sc += VQ_SHFL_XOR(sc, o);
    const int idx = lane >> LSH, rl = idx & (RP2 - 1);
    const bool ok = rl < REP && t0 + (idx >> LRP) < w1;
    sc = ok ? sc : -VQ_INF;
    float g = sc;  // the group's max for head rl
#pragma unroll
    for (int o = RP2 << LSH; o < 32; o <<= 1) g = fmaxf(g, VQ_SHFL_XOR(g, o));
    // one online-softmax rescale per group and head; one exp per lane for its own score
    float mo = 0.f;
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      const float mn = fmaxf(m[r], VQ_SHFL(g, r << LSH));
      const float corr = VQ_EXP(m[r] - mn);
      m[r] = mn;
      l[r] *= corr;
#pragma unroll
      for (int j = 0; j < VJ; ++j) acc[r][j] *= corr;
      mo = rl == r ? mn : mo;
    }
    const float p = ok ? VQ_EXP(sc - mo) : 0.f;
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      if (t0 + i >= w1) break;
      const vq_u32 vword = vwd[i];
      const float vscale = vsf[i];
      float v[VJ];
      if (VMAP) {  // this lane's VJ channels are consecutive codes of its word: no shuffle
        const vq_u32 vl = vword >> ((lane / WV) * VJ * VB);
#pragma unroll
        for (int j = 0; j < VJ; ++j) {
          const float u = vq_code(vl, 23 - VB * (j + 1), VMASK << (23 - VB)) * (float)(1 << VB)
                          - ((float)(1 << VB) + half_top);
          const float u2 = u * u;
          v[j] = vscale * (u * (pa + u2 * (pb + pc * u2)));
        }
      } else {
""" + VALUE_DECODE.replace("VQ_OUT", "v") + r"""
      }
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        const float pr = VQ_SHFL(p, (i * RP2 + r) << LSH);
        l[r] += pr;
#pragma unroll
        for (int j = 0; j < VJ; ++j) acc[r][j] += pr * v[j];
      }
    }
  }
#undef WF_KEY
#undef WF_TURN
""" + BLOCK_MERGE

# H: KV heads; TK / TV / TS: rows of the key words, value words and value scales buffers (capacities)
_KERNELS = kernel_variants("vq_waterfill_decode",
                           ["q", "kw", "ktab", "klo", "kst", "rw", "rp", "rs", "vw", "vs", "vpoly"],
                           [("n_all", "int"), ("pos0", "int"), ("scale", "float"), ("H", "int"), ("TK", "int"),
                            ("TV", "int"), ("TS", "int")], _SOURCE)


@functools.cache
def supported(d: int, dv: int, key_words: int, value_words: int, rep: int = 1) -> bool:
    """Shapes the kernel handles: head dims multiples of 32, rows of at most 32 words, at most 32 query heads per
    KV head (a group's scores are reduced together over the warp's 32 lanes) whose block partials fit the 48 KB of
    static shared memory (``_common.BLOCK_SHARED`` and the fused tail's weights: at d 128, 16 query heads)."""
    shared = 4 * rep * (WARPS * (dv + 2) + 32) + 4
    return (d % 32 == 0 and dv % 32 == 0 and 0 < key_words <= 32 and 0 < value_words <= 32 and 0 < rep <= 32
            and shared <= shared_limit())


def paired_rope(spec, d: int) -> bool:
    """True when every rotary pair of a ``d``-channel key sits in one lane of the kernel (channels c and c + d/2,
    lane c mod 32: mlx_lm's default rotation over all ``d`` channels, or none), so the kernel rotates each key pair
    once per row instead of rotating the query for every head."""
    return (d // 2) % 32 == 0 and (spec is None or (not spec["traditional"] and spec["dims"] == d))


@functools.cache
def group_constants(rep: int, value_bits: int, dv: int) -> tuple:
    """The kernel's grouping: PF rows per group (at most PREFETCH, PF x RP2 <= 32 scores), RP2 the query heads
    rounded up to a power of two, LNV / LRP their log2s, and VMAP (value codes that never straddle a word: each lane
    decodes VJ consecutive channels of one word)."""
    rp2 = 1 << (rep - 1).bit_length()
    pf = max(1, min(PREFETCH, 32 // rp2))
    vmap = 32 % value_bits == 0 and value_bits * (dv // 32) <= 32
    return (("PF", pf), ("RP2", rp2), ("LNV", (pf * rp2).bit_length() - 1), ("LRP", rp2.bit_length() - 1),
            ("VMAP", vmap))


def key_table(layout) -> mx.array:
    """Per (head, channel) ``word | shift << 8 | width << 16`` (uint32 ``[H, D]``) of a ``VarLayout``."""
    u = mx.uint32
    return mx.contiguous(layout.word.astype(u) | (layout.shift.astype(u) << 8) | (layout.bits.astype(u) << 16))


def rope_tables(spec, d: int):
    """Per channel: angle per position ``w`` (0 where RoPE does not rotate), rotary partner and sign
    (``q . R(t) k = sum_c k_c (q_c cos(t w_c) + sign_c q_partner(c) sin(t w_c))``), as float32 /
    int32 / float32 ``[d]``. ``spec`` None: no rotation. Built on the host once per (spec, d): shared by the
    layers."""
    return _rope_tables(None if spec is None else (spec_key(spec), spec["traditional"]), d)


@functools.lru_cache(maxsize=64)
def _rope_tables(key, d: int):
    w = np.zeros(d, np.float32)
    partner = np.arange(d, dtype=np.int32)
    sign = np.zeros(d, np.float32)
    if key is not None:
        spec, traditional = key
        om, dims = frequencies_of(spec)[0], spec[0]
        c = np.arange(dims)
        off = 1 if traditional else dims // 2  # a channel's distance to its rotary partner
        first = c % 2 == 0 if traditional else c < off
        w[:dims] = om[c // 2] if traditional else om[c % off]
        partner[:dims] = np.where(first, c + off, c - off)
        sign[:dims] = np.where(first, 1.0, -1.0)
    return mx.array(w), mx.array(partner), mx.array(sign)


def waterfill_partials(queries, scale: float, k_words, ktab, k_lo, k_step, rope, v_words, v_scales, vpoly,
                       n: int, pos0: int, value_bits: int, dv: int, exact, counts=None, merge=None,
                       paired: bool = False):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first
    ``n`` quantized rows (``acc`` in the rotated value domain), then the exact rows.

    ``queries`` [B, H * R, 1, D] as the model gives them (scaled by ``scale`` in the kernel);
    ``k_words``/``v_words``/``v_scales``: the cache's buffers (capacity rows, not sliced: no copy);
    ``ktab`` from :func:`key_table`; ``k_lo``/``k_step`` float32 ``[B, H, D]``; ``rope`` from
    :func:`rope_tables`; ``vpoly`` float32 ``[a, b, c, (2^b - 1) / 2]``; ``pos0`` the position of
    quantized row 0; ``exact`` = (k0, v0, e0, k1, v1, e1, new_k, new_v): the first ``e0`` rows of the
    buffers k0/v0 [B, H, T0, D], the first ``e1`` of k1/v1, then the step's own row. A batch form passes
    ``counts`` as for ``kivi_partials`` (``n`` their maximum) and ``ktab`` [B * H, D]. With ``merge``
    (``_common.Merge``): the attention output [B, H * R, 1, Dv] (``_common.launch``). ``paired``: from
    :func:`paired_rope` (False is right for any rotation, only slower)."""
    B, Hq, _, D = queries.shape
    H = k_words.shape[1]
    arrays, scalars, consts = exact_args(exact, counts, H)
    return launch(_KERNELS, counts is not None,
                  [queries, k_words, ktab, k_lo, k_step, *rope, v_words, v_scales, vpoly, *arrays],
                  [int(n), int(pos0), float(scale), ktab.shape[0], k_words.shape[2], v_words.shape[2],
                   v_scales.shape[2], *scalars],
                  (("D", D), ("WK", k_words.shape[-1]), ("WV", v_words.shape[-1]), ("VB", value_bits), ("PAIR", paired))
                  + group_constants(Hq // H, value_bits, dv) + consts, B, H, Hq // H, split_count(n), dv, merge)


def cache_constants(c):
    """A waterfill cache's kernel tables (key layout, float32 ranges, RoPE, value codebook), built once per
    calibration and kept on the cache (``_kconst``: held, counted by its ``held_arrays``)."""
    kc = getattr(c, "_kconst", None)
    if kc is None or kc[0] is not c.k_lo:
        vpoly = mx.array([*poly_coefficients(c.bit_width), ((1 << c.bit_width) - 1) / 2], dtype=mx.float32)
        kc = (c.k_lo, key_table(c._layout_of()), mx.contiguous(c.k_lo[:, :, 0].astype(mx.float32)),
              mx.contiguous(c.k_step[:, :, 0].astype(mx.float32)), rope_tables(c.rope, c._shape[1]), vpoly)
        c._kconst = kc
    return kc[1:]


def held_constants(c) -> list:
    """The kernel tables ``cache_constants`` keeps on cache ``c`` (for its ``held_arrays``): none until built, and
    none once its calibration has moved on (they are rebuilt at the next decode step)."""
    kc = getattr(c, "_kconst", None)
    return [*kc[1:4], *kc[4], kc[5]] if kc is not None and kc[0] is c.k_lo else []


def decode_attend(c, queries, scale: float, sinks=None):
    """One query row of waterfill cache ``c``: the split-K partials over the codes plus the float16 sinks, the
    window and the call's own row, merged in one softmax (the values' Hadamard rotation undone once) by the
    launch's last block per head, or past ``_common.FUSED_MAX_S1`` partials by a second launch."""
    call, c._call = c._call, None
    ktab, lo, step, rope, vpoly = cache_constants(c)
    merge = Merge(sinks, True, queries.dtype, step_counters(c, queries.shape[0] * c.k_words.shape[1]))
    return waterfill_partials(queries, scale, c.k_words, ktab, lo, step, rope, c.v_words, c.v_scales, vpoly, call.q0,
                              call.s0, c.bit_width, c._shape[2], window_exact(c, call),
                              paired=paired_rope(c.rope, c._shape[1]), merge=merge)
