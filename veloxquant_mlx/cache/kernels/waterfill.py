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

Float16/bfloat16 models on sm_80+ with 4-bit values, half-split RoPE (or none), d and dv 64 or 128 and at most 8 query
heads per KV head take the tensor-core form instead (``uses_tensor_cores``; ``_MMA_SOURCE`` says how): the same
function with float16 operands, ~3x fewer instructions a row (docs/RESULTS.md "Waterfill's decode on tensor cores").
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..primitives.rope import frequencies_of, spec_key
from ..primitives.value_rotation import poly_coefficients
from ._compile import HALF_FLOATS, TENSOR_PRELUDE, tensor_cores_here
from ._common import (ACC_INIT, BLOCK_JOIN, BLOCK_MERGE, BLOCK_SHARED, EXACT_ROWS, KERNEL_HEAD, MMA_STORE, SQ_EXACT,
                      WARPS, Merge, exact_args, kernel_variants, launch, shared_limit, split_count, window_exact)

PREFETCH = 4  # rows whose words a warp loads before decoding them (memory-level parallelism)

__all__ = ["waterfill_partials", "key_table", "rope_tables", "rope_delta_table", "paired_rope", "supported",
           "tensor_core_layout", "uses_tensor_cores", "cache_constants",
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


# one 64-row tile of the mma form (FULL: every row below n; else the last tile, rows past n read as row n - 1)
_TILE = r"""
        const int r0 = tt0 + g, v0 = tt0 + 2 * t;  // the lane's first key row and first value row
#define WF_ROW(d) (FULL ? (d) - g : min(tt0 + (d), n - 1) - r0)
#define WF_VROW(d) (FULL ? (d) : min(v0 + (d), n - 1) - v0)
        const vq_u32* kb = KSTAGE ? wk + g * KSTR : kw + ((size_t)bh * TK + r0) * WK;
        const auto* sb = vs + (size_t)bh * TS + r0;
        const vq_u32* vb = vw + ((size_t)bh * TV + v0) * WV + VPL * g;
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[j][e] = 0.f;
#pragma unroll 1
        for (int sp = 0; sp < HS; ++sp) {
          const vq_u32* da = wfd + 12 * (t * (D / 32) + sp);           // this thread's run in the first half
          const vq_u32* db = da + 12 * (D / 8);                           // its rotary partners
          const vq_u32 awi = da[0], awj = da[1], ash = da[2], ak01 = da[3], as01 = da[4], ac2 = da[5], as23 = da[6];
          const vq_u32 ak23 = da[7], alo01 = da[8], alo23 = da[9], ast01 = da[10], ast23 = da[11];
          const vq_u32 bwi = db[0], bwj = db[1], bsh = db[2], bk01 = db[3], bs01 = db[4], bc2 = db[5], bs23 = db[6];
          const vq_u32 bk23 = db[7], blo01 = db[8], blo23 = db[9], bst01 = db[10], bst23 = db[11];
          const vq_u32 qa0 = wq[(sp * 32 + lane) * 2], qa1 = wq[(sp * 32 + lane) * 2 + 1];
          const vq_u32 qb0 = wq[((sp + HS) * 32 + lane) * 2], qb1 = wq[((sp + HS) * 32 + lane) * 2 + 1];
          const vq_u4* rt = (const vq_u4*)rtab + t * (D / 32) + sp;
          const vq_u32 *pa = kb + awi, *pj = kb + awj, *pb = kb + bwi, *pk = kb + bwj;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            vq_u32 fa[4], fb[4];  // A fragments of slices sp and sp + HS: rows g, g + 8 x channel pairs 01, 23
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const int d = 16 * j + g + 8 * x;
              const int ro = WF_ROW(d) * KROW;
              const vq_u32 xa = VQ_FUNNEL(pa[ro], pj[ro], ash), xb = VQ_FUNNEL(pb[ro], pk[ro], bsh);
              const vq_u32 a01 = wf_deq(xa, as01, ak01, alo01, ast01);
              const vq_u32 a23 = wf_deq(xa >> ac2, as23, ak23, alo23, ast23);
              const vq_u32 b01 = wf_deq(xb, bs01, bk01, blo01, bst01);
              const vq_u32 b23 = wf_deq(xb >> bc2, bs23, bk23, blo23, bst23);
              const vq_u4 cs = rt[d * (D / 8)];  // (cos, sin) of d w for the run's channel pairs 01, 23
              wf_turn(a01, b01, cs.x, cs.y, fa[x], fb[x]);
              wf_turn(a23, b23, cs.z, cs.w, fa[2 + x], fb[2 + x]);
            }
            vq_mma(sc[j], fa[0], fa[1], fa[2], fa[3], qa0, qa1);
            vq_mma(sc[j], fb[0], fb[1], fb[2], fb[3], qb0, qb1);
          }
        }
        // online softmax for heads 2 t + u: sc[j][2 x + u] is row 16 j + g + 8 x; weights x row scale to shared memory
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          float mt = -VQ_INF;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              if (!FULL && tt0 + 16 * j + g + 8 * x >= n) sc[j][2 * x + u] = -VQ_INF;
              mt = fmaxf(mt, sc[j][2 * x + u]);
            }
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) mt = fmaxf(mt, VQ_SHFL_XOR(mt, o));
          const float mn = fmaxf(m2[u], mt);  // finite: the tile's first row is < n
          const float corr = VQ_EXP(m2[u] - mn);
          float ps = 0.f;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const int d = 16 * j + g + 8 * x;
              const float p = VQ_EXP(sc[j][2 * x + u] - mn);
              ps += p;
              wp16[(2 * t + u) * 2 * PRS + d] = (unsigned short)vq_hbits(p * VQ_F(sb[WF_ROW(d)]));
            }
          l2[u] = l2[u] * corr + ps;  // this lane's rows; summed over the lanes at the end
#pragma unroll
          for (int v = 0; v < VM; ++v) { acc[v / 4][v % 4][u] *= corr; acc[v / 4][v % 4][2 + u] *= corr; }
          m2[u] = mn;
        }
        VQ_SYNCWARP();
        // values: k = rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of each 16; m-block mb rows g, g + 8 = nibbles of byte mb % 4
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const vq_u32 b0 = g < REP ? wp[g * PRS + 8 * kk + t] : 0u, b1 = g < REP ? wp[g * PRS + 8 * kk + t + 4] : 0u;
          vq_u32 wa[VPL], wb[VPL], wc[VPL], wd[VPL];
#pragma unroll
          for (int i = 0; i < VPL; ++i) {
            wa[i] = vb[WF_VROW(16 * kk) * WV + i];
            wb[i] = vb[WF_VROW(16 * kk + 1) * WV + i];
            wc[i] = vb[WF_VROW(16 * kk + 8) * WV + i];
            wd[i] = vb[WF_VROW(16 * kk + 9) * WV + i];
          }
#pragma unroll
          for (int v = 0; v < VM; ++v) {
            const vq_u32 pab = __byte_perm(wa[v / 4], wb[v / 4], 0x4400u + 0x1111u * (v % 4));
            const vq_u32 pcd = __byte_perm(wc[v / 4], wd[v / 4], 0x4400u + 0x1111u * (v % 4));
            vq_mma(acc[v / 4][v % 4], wf_cent<true>(pab, UL, PA, PB, PC), wf_cent<false>(pab, UH, PA, PB, PC),
                   wf_cent<true>(pcd, UL, PA, PB, PC), wf_cent<false>(pcd, UH, PA, PB, PC), b0, b1);
          }
        }
#undef WF_ROW
#undef WF_VROW
"""

# The tensor-core form (float16/bfloat16 queries, 4-bit values, rotary pairs split in halves or no RoPE, d and dv
# 64 or 128, at most 8 query heads a KV head, sm_80+). A warp takes tiles of 64 quantized rows; both products are
# ``mma.m16n8k16`` (float16 in, float32 sums), the query heads as the scores' n and as the value sum's n.
# * Keys (A: 16 rows x 16 channels a slice). Scores are invariant to a channel permutation shared by queries and
#   keys, so slice s, mma column 2 t + {0, 1, 8, 9} is channel hf * D/2 + (D/8) t + 4 s' + {0, 1, 2, 3} (hf, s' =
#   s's half and index in it): each thread's four channels of a slice are consecutive in the row's bit stream (at
#   most 32 bits: one funnel shift of two words), and their rotary partners (channel + D/2) sit in the same thread.
#   Per run of 4 channels a shared descriptor (``wfd``, built once a block from the width table) holds the word,
#   shift and the masks that put two codes into the mantissas of a float16 pair (1024 + code: ``prmt``, ``lop3``, an
#   exact ``sub``), then one ``fma`` per pair applies the channel ranges (``lo + code * step``).
# * RoPE: q . R(P0 + d) k = (R(P0)^T q) . (R(d) k). The warp rotates the query to each tile's first position P0
#   (``__sincosf`` of two frequencies a lane, the angle reduced modulo 2 pi in double, into the tile's B fragments in
#   shared memory); each key pair turns by the tile-relative d from a table of (cos, sin)(d w) as float16 pairs
#   (``rope_delta_table``, read through L1).
# * Values (A: 16 channels x 16 rows): m-block mb row g is rotated channel (DV/8) g + 2 mb (g + 8: the next one), so
#   a thread reads one or two whole words of each of its four rows; the centroid (the odd polynomial of code - 7.5)
#   is evaluated on float16 pairs and the row scale goes into the softmax weight, which reaches the B operand through
#   shared memory (as KIVI's). Full tiles (``_TILE`` with FULL) read every row at constant offsets.
# Deviation from the float32 kernel: dequantized and rotated keys, centroids, the rotated query and the weights are
# rounded to float16 (relative 2^-11 each), sums stay float32 (as KIVI's tensor-core kernel).
_MMA_SOURCE = KERNEL_HEAD + r"""
  const int h = bh % H;  // the key table's row
  constexpr int VJ = DV / 32;
  constexpr int KS = D / 16, HS = KS / 2;  // key slices of 16 channels; slices in a rotary half
  constexpr int RH = D / 8;                // channels a thread holds in each half
  constexpr int VM = DV / 16, VS = DV / 64, VPL = DV / 64;  // value m-blocks, sets of 4, words a thread reads a row
  constexpr int PRS = 36;                  // a head's row of tile weights: 32 float16 pairs + 4 (no bank conflicts)
  VQ_SHARED float sq[REP * D];
  VQ_SHARED vq_u32 wfd[(D / 4) * 12];       // per run of 4 channels: word, next word, shift, masks, ranges
  VQ_SHARED vq_u32 sbq[NW * KS * 64];       // per warp: the rotated query's B fragments [slice][lane][2]
  VQ_SHARED vq_u32 sp2[NW * 8 * PRS];       // per warp: the tile's weights x row scales, float16 [head][row]
  // the tile's key words staged in shared memory where the block's 48 KB hold them beside the rest (its arrays above
  // and below, the fused tail's), rows KSTR words apart: the 8 rows a warp's lanes read at once fall in distinct
  // banks (a stride that is a multiple of 8 words would put 2-4 rows in one)
  constexpr int KSTR = WK % 8 == 0 ? WK + 4 : WK;
  constexpr int REST = 4 * (REP * D + (D / 4) * 12 + NW * KS * 64 + NW * 8 * PRS + NW * REP * (DV + 2) + REP * 32 + 1);
  constexpr bool KSTAGE = WK <= 16 && REST + 4 * NW * 64 * KSTR + 256 <= 48 * 1024;
  constexpr int KROW = KSTAGE ? KSTR : WK;
  VQ_SHARED __align__(16) vq_u32 skw[KSTAGE ? NW * 64 * KSTR : 4];  // per warp: its tile's key words
""" + BLOCK_SHARED + r"""
  const int ntiles = (n + 63) / 64;
  vq_u32* wk = skw + (KSTAGE ? warp * 64 * KSTR : 0);
  // the warp's first tile: its key words on their way to shared memory, its values into L2, while the block sets up
  if (s < S && s * NW + warp < ntiles)
    wf_stage_tile<KSTAGE, WK, KSTR>(wk, kw, vw, vs, bh, TK, TV, TS, WV, s * NW + warp, n, lane);
  for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) sq[i] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
  for (int i = VQ_TID; i < NW * KS * 64; i += VQ_NTHREADS) sbq[i] = 0u;
  for (int r = VQ_TID; r < D / 4; r += VQ_NTHREADS) {
    vq_u32 off[4], wd[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const vq_u32 tb = ktab[h * D + 4 * r + e];
      off[e] = (tb & 255u) * 32u + ((tb >> 8) & 31u);
      wd[e] = (tb >> 16) & 15u;
    }
    const float* lo = klo + (size_t)bh * D + 4 * r;
    const float* st = kst + (size_t)bh * D + 4 * r;
    vq_u32* o = wfd + 12 * r;
    o[0] = off[0] >> 5; o[1] = min((off[0] >> 5) + 1u, (vq_u32)(WK - 1)); o[2] = off[0] & 31u;
    o[3] = ((1u << wd[0]) - 1u) | (((1u << wd[1]) - 1u) << 16);
    o[4] = 16u - wd[0]; o[5] = off[2] - off[0]; o[6] = 16u - wd[2];
    o[7] = ((1u << wd[2]) - 1u) | (((1u << wd[3]) - 1u) << 16);
    o[8] = vq_h2(lo[0], lo[1]); o[9] = vq_h2(lo[2], lo[3]); o[10] = vq_h2(st[0], st[1]); o[11] = vq_h2(st[2], st[3]);
  }
  VQ_SYNC();
  if (s == S) {
""" + SQ_EXACT + r"""
  } else {
    const int g = lane >> 2, t = lane & 3;
    const vq_u32 PA = vq_h2(vpoly[0], vpoly[0]), PB = vq_h2(vpoly[1], vpoly[1]), PC = vq_h2(vpoly[2], vpoly[2]);
    const vq_u32 UL = vq_h2(vpoly[3], vpoly[3]), UH = vq_h2(64.f + vpoly[3], 64.f + vpoly[3]);
    float m2[2] = {-VQ_INF, -VQ_INF}, l2[2] = {0.f, 0.f};  // heads 2 t + u
    float acc[VS][4][4];  // m-block 4 v + j: rotated channel (DV / 8) g + 8 v + 2 j (+1 for [2], [3]), heads 2 t (+1)
#pragma unroll
    for (int v = 0; v < VS; ++v)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[v][j][e] = 0.f;
    vq_u32* wq = sbq + warp * KS * 64;
    unsigned short* wq16 = (unsigned short*)wq;
    vq_u32* wp = sp2 + warp * 8 * PRS;
    unsigned short* wp16 = (unsigned short*)wp;
    for (int ti = s * NW + warp; ti < ntiles; ti += S * NW) {
      const int tt0 = ti * 64;
      if (ti != s * NW + warp) {  // a later tile: the last one's key words read (the warp synced at its end)
        wf_stage_tile<KSTAGE, WK, KSTR>(wk, kw, vw, vs, bh, TK, TV, TS, WV, ti, n, lane);
      }
      // the query rotated to the tile's first position, as the B fragments of its slices (heads g < REP)
      const float P0 = (float)(pos0 + tt0);
#pragma unroll
      for (int f = lane; f < D / 2; f += 32) {
        // the angle as the op path forms it (a float32 product), reduced modulo 2 pi in double: __sincosf's range
        const float a = P0 * rw[f];
        const double k = rint((double)a * 0.15915494309189535);
        float sn, cs;
        __sincosf((float)((double)a - k * 6.283185307179586), &sn, &cs);
        const int tq = f / RH, sp = (f % RH) >> 2, e = f & 3;
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float q1 = sq[r * D + f], q2 = sq[r * D + f + D / 2];
          const int i0 = ((sp * 32 + 4 * r + tq) * 2 + (e >> 1)) * 2 + (e & 1);
          wq16[i0] = (unsigned short)vq_hbits(q1 * cs + q2 * sn);
          wq16[i0 + HS * 128] = (unsigned short)vq_hbits(q2 * cs - q1 * sn);
        }
      }
      if (KSTAGE) asm volatile("cp.async.wait_all;\n" ::: "memory");
      VQ_SYNCWARP();
      // the tile's rows, each read from the lane's first row r0: FULL (all below n) at constant offsets, else (the last
      // tile) rows past n read as row n - 1 with weight 0
      if (tt0 + 64 <= n) {
""" + _TILE.replace("FULL", "true") + r"""
      } else {
""" + _TILE.replace("FULL", "false") + r"""
      }
      VQ_SYNCWARP();
    }
#define VQ_MMA_CH(v, j) ((DV / 8) * g + 8 * (v) + 2 * (j))
""" + MMA_STORE + r"""#undef VQ_MMA_CH
  }
""" + BLOCK_JOIN

# device functions of the tensor-core form
_MMA_PRELUDE = TENSOR_PRELUDE + r"""
struct __align__(16) vq_u4 { vq_u32 x, y, z, w; };
// the 128-byte lines of ``bytes`` bytes from ``p`` into L2, one line a lane
__device__ __forceinline__ void wf_prefetch(const void* p, size_t bytes, int lane) {
  const size_t a0 = (size_t)p & ~(size_t)127, end = (size_t)p + bytes;
  for (size_t a = a0 + 128 * (size_t)lane; a < end; a += 32 * 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
}
// tile ``ti``'s rows on their way before they are read: its key words copied into the warp's buffer ``wk`` with
// KSTAGE (``cp.async``, every load in flight at once; waited for before the keys are read), else prefetched into L2,
// and its value words and scales prefetched into L2. The warp's first tile is staged before the block's set-up.
template <bool KSTAGE, int WK_, int KSTR_, typename TS_>
__device__ __forceinline__ void wf_stage_tile(vq_u32* wk, const vq_u32* kw, const vq_u32* vw, const TS_* vs, int bh,
                                              int TK, int TV, int TSN, int WV_, int ti, int n, int lane) {
  const int r0 = ti * 64, rows = min(64, n - r0);
  const vq_u32* src = kw + ((size_t)bh * TK + r0) * WK_;
  if (KSTAGE) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(wk);
    if (WK_ % 4 == 0) {  // 16 bytes a copy (aligned: a row is a multiple of 16 bytes)
      constexpr int C = WK_ / 4;
      for (int i = lane; i < rows * C; i += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                     :: "r"(dst + 4 * ((i / C) * KSTR_ + 4 * (i % C))), "l"(src + 4 * i) : "memory");
    } else {
      for (int i = lane; i < rows * WK_; i += 32)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                     :: "r"(dst + 4 * ((i / WK_) * KSTR_ + i % WK_)), "l"(src + i) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  } else {
    wf_prefetch(src, (size_t)rows * WK_ * 4, lane);
  }
  wf_prefetch(vw + ((size_t)bh * TV + r0) * WV_, (size_t)rows * WV_ * 4, lane);
  wf_prefetch(vs + (size_t)bh * TSN + r0, (size_t)rows * sizeof(TS_), lane);
}
// two key codes of a run (bits 0.. and w0.. of x; ``s01`` = 16 - w0, ``k`` their masks) dequantized as a float16 pair
__device__ __forceinline__ vq_u32 wf_deq(vq_u32 x, vq_u32 s01, vq_u32 k, vq_u32 lo, vq_u32 st) {
  vq_u32 p, r;
  p = __byte_perm(x, x << s01, 0x7610u);
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(p), "r"(k), "r"(0x64006400u));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(0x64006400u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(st), "r"(lo));
  return r;
}
// a key pair (a, b) of float16 pairs turned by (cos, sin) pairs: (a c - b s, a s + b c)
__device__ __forceinline__ void wf_turn(vq_u32 a, vq_u32 b, vq_u32 c, vq_u32 s, vq_u32& ra, vq_u32& rb) {
  vq_u32 x, y;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(b), "r"(s));
  asm("neg.f16x2 %0, %1;" : "=r"(x) : "r"(x));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(ra) : "r"(a), "r"(c), "r"(x));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(y) : "r"(b), "r"(c));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(rb) : "r"(a), "r"(s), "r"(y));
}
// centroids of two 4-bit value codes: u (pa + u^2 (pb + pc u^2)), u = code - (2^4 - 1) / 2 (``ut``). LO: the low
// nibbles of each half of p read as 1024 + code (two exact subs: 1031.5 is no float16); else the high ones as
// 64 + code (one sub of 71.5)
template <bool LO>
__device__ __forceinline__ vq_u32 wf_cent(vq_u32 p, vq_u32 ut, vq_u32 pa, vq_u32 pb, vq_u32 pc) {
  vq_u32 x, u2, r;
  if (LO) {
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(x) : "r"(p), "r"(0x000f000fu), "r"(0x64006400u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(0x64006400u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(ut));
  } else {
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(x) : "r"(p), "r"(0x00f000f0u), "r"(0x54005400u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(ut));
  }
  asm("mul.rn.f16x2 %0, %1, %1;" : "=r"(u2) : "r"(x));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(pc), "r"(u2), "r"(pb));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(u2), "r"(pa));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(x));
  return r;
}
"""

_MMA_KERNELS = kernel_variants("vq_waterfill_decode_mma",
                               ["q", "kw", "ktab", "klo", "kst", "rw", "rtab", "vw", "vs", "vpoly"],
                               [("n_all", "int"), ("pos0", "int"), ("scale", "float"), ("H", "int"), ("TK", "int"),
                                ("TV", "int"), ("TS", "int")], _MMA_SOURCE, bounds=(32 * WARPS, 4),
                               prelude=_MMA_PRELUDE)
TENSOR_CORES = True  # layouts the mma form reads take it on sm_80+ (tests switch it off to compare the forms)
# The mma form's splits of a long context: past 32k tokens its warps take several tiles each (128k: 4), so each
# block's set-up and partials are spread over more rows (H100, 128k: 152 -> 127 us a layer; at 32k, already 128
# splits, no change; docs/RESULTS.md)
MMA_MAX_SPLITS = 128


@functools.cache
def tensor_core_layout(d: int, dv: int, value_bits: int, rep: int, paired: bool) -> bool:
    """Layouts the tensor-core form reads: rotary pairs split in halves (or no RoPE: ``paired``), head dims 64 or 128
    (its registers and tables), 4-bit values, at most 8 query heads per KV head (the mma's n)."""
    return paired and d in (64, 128) and dv in (64, 128) and value_bits == 4 and 0 < rep <= 8


def uses_tensor_cores(d: int, dv: int, value_bits: int, rep: int, paired: bool, dtype) -> bool:
    """Whether a decode step runs the tensor-core form: ``TENSOR_CORES``, the layout, queries in a 2-byte float
    (float32 models keep the float32 kernel), an sm_80+ device."""
    return (TENSOR_CORES and dtype in HALF_FLOATS and tensor_core_layout(d, dv, value_bits, rep, paired)
            and tensor_cores_here())


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


def rope_delta_table(spec, d: int) -> mx.array:
    """The tensor-core form's key rotations within a tile: per row offset ``0 <= t < 64`` and run of 4 channels
    ``c0 .. c0 + 3`` of the first rotary half, (cos, sin)(t w_c) as float16 pairs for channels (c0, c0 + 1) and
    (c0 + 2, c0 + 3): uint32 ``[64, d / 8, 4]`` (cos01, sin01, cos23, sin23). Built on the host once per (spec, d)."""
    return _rope_delta_table(None if spec is None else (spec_key(spec), spec["traditional"]), d)


@functools.lru_cache(maxsize=64)
def _rope_delta_table(key, d: int):
    w = np.array(_rope_tables(key, d)[0], np.float64)[: d // 2].reshape(d // 8, 2, 2)  # [run, pair, channel]
    ang = np.arange(64, dtype=np.float64)[:, None, None, None] * w[None]
    bits = np.stack([np.cos(ang), np.sin(ang)], axis=3).astype(np.float16).view(np.uint16).astype(np.uint32)
    return mx.array((bits[..., 0] | (bits[..., 1] << 16)).reshape(64, d // 8, 4))  # (cos01, sin01, cos23, sin23)


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
    if uses_tensor_cores(D, dv, value_bits, Hq // H, paired, queries.dtype) and len(rope) > 3:
        return launch(_MMA_KERNELS, counts is not None,
                      [queries, k_words, ktab, k_lo, k_step, rope[0], rope[3], v_words, v_scales, vpoly, *arrays],
                      [int(n), int(pos0), float(scale), ktab.shape[0], k_words.shape[2], v_words.shape[2],
                       v_scales.shape[2], *scalars],
                      (("D", D), ("WK", k_words.shape[-1]), ("WV", v_words.shape[-1])) + consts, B, H, Hq // H,
                      min(split_count(n), MMA_MAX_SPLITS), dv, merge)
    return launch(_KERNELS, counts is not None,
                  [queries, k_words, ktab, k_lo, k_step, *rope[:3], v_words, v_scales, vpoly, *arrays],
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
              mx.contiguous(c.k_step[:, :, 0].astype(mx.float32)), rope_tables(c.rope, c._shape[1])
              + ((rope_delta_table(c.rope, c._shape[1]),) if paired_rope(c.rope, c._shape[1]) else ()), vpoly)
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
    merge = Merge(sinks, True, queries.dtype, c)
    return waterfill_partials(queries, scale, c.k_words, ktab, lo, step, rope, c.v_words, c.v_scales, vpoly, call.q0,
                              call.s0, c.bit_width, c._shape[2], window_exact(c, call),
                              paired=paired_rope(c.rope, c._shape[1]), merge=merge)
