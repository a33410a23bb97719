"""Decode kernel for KIVI's layout (and its family through the shared layout): keys per channel,
stored transposed (``k_codes [B, H, D, groups * words]``, token ``t`` of channel ``c`` at bits
``t*b .. t*b + b - 1`` of the channel's word stream, float16 scale/bias per channel and group of G
tokens), values per token (``v_codes [B, H, T, Dv*b/32]``, float16 scale/bias per token and group of
Gv channels); MLX's affine layout ``x = code * scale + bias`` with b in {2, 4, 8}.

A warp takes a tile of 8 words per key channel (8 * 32/b tokens): lane (q, w) reads word w of the
channels ``c = 4 j + q`` (four 32-byte runs per load), so a lane's dependent chain is D/4 loads, not D,
and the tile's loads are independent; the scale folds into the query (``q_c * s_c``) and the bias into
one dot product per lane; two shuffles join the four channel quarters. After one online-softmax update
for the tile the weights go to shared memory and the tile's value rows are read a whole row per
Dv*b/32 lanes (coalesced), each lane owning one word's 32/b channels; rows past ``n`` are read clamped
with weight 0 (no branch, so the loads can be issued together). Splits take tiles round-robin, one tile
per warp up to ~BLOCKS blocks; the block's warps join in shared memory.

A code becomes a float without an int-to-float conversion (``VQ_CODE``: shifted into the mantissa of 1.0, it
reads 1 + c / 2^b), the offset folded into the bias: s c + z = (s 2^b)(1 + c / 2^b) + (z - s 2^b), once per word.

On the H200 (Nsight Compute, 8 KV heads x 4, d 128, 4-bit, SM at 1.48 GHz): bound by instruction issue -- the 32
FMAs per code word are half the key loop's instructions, the rest unpacking and addressing; batching the loads or
halving the tiles did not help (docs/RESULTS.md "Decode: what bounds a step"). The fused kernel: 27.9 us at 8k,
62.6 us at 32k, 205 us at 128k (28.1 / 66.4 / 219.6 with int-to-float conversions; session 14).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._common import (BLOCK_JOIN, BLOCK_SHARED, EXACT_ROWS, KERNEL_HEAD, LANE_STORE, MAX_SPLITS, WARPS,
                      exact_args, kernel_variants, launch)

__all__ = ["kivi_partials", "supported", "TILE_WORDS"]

TILE_WORDS = 8  # key words per channel in a warp's tile; 32 / TILE_WORDS channel quarters per warp
BLOCKS = 512  # grid size past which splits take several tiles (~4 blocks per SM on an H200: one wave)

_SOURCE = KERNEL_HEAD + r"""  constexpr int VJ = DV / 32;
  constexpr int TPW = 32 / KB;        // tokens (or value channels) per code word
  constexpr int CQ = 32 / TW;         // channel quarters per warp
  constexpr int TOK = TW * TPW;       // tokens per warp tile
  constexpr int LPR = WV;             // lanes per value row (one word each)
  constexpr int RPW = 32 / LPR;       // value rows per warp load
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  constexpr float TOP = (float)(1u << KB);  // code c of a word reads as 1 + c / TOP (VQ_CODE), so x = s c + z
                                            // = (s TOP) (1 + c / TOP) + (z - s TOP): no int-to-float conversion
  VQ_SHARED float sq[REP * D];
  VQ_SHARED float sp[NW * REP * TOK];
""" + BLOCK_SHARED + r"""
  for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) sq[i] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
  VQ_SYNC();
  if (s == S) {
    float m[REP], l[REP], acc[REP][VJ];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      m[r] = -VQ_INF; l[r] = 0.f;
#pragma unroll
      for (int j = 0; j < VJ; ++j) acc[r][j] = 0.f;
    }
#define QV(r, j) sq[(r) * D + lane + 32 * (j)]
""" + EXACT_ROWS + LANE_STORE + r"""
#undef QV
  } else {
    const int ntiles = (n + TOK - 1) / TOK;
    const int kq = lane / TW, kw = lane % TW;     // key lanes: channel quarter, word in the tile
    const int vw = lane % LPR, ro = lane / LPR;   // value lanes: word in the row, row offset
    float* wp = sp + warp * REP * TOK;
    float m[REP], l[REP], acc[REP][TPW], vb[REP];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      m[r] = -VQ_INF; l[r] = 0.f; vb[r] = 0.f;
#pragma unroll
      for (int i = 0; i < TPW; ++i) acc[r][i] = 0.f;
    }
    const size_t cbase = (size_t)bh * D;
    for (int ti = s * NW + warp; ti < ntiles; ti += S * NW) {
      const int tt0 = ti * TOK;
      const int col = ti * TW + kw;      // this lane's key word
      const int tl0 = col * TPW;         // its first token
      float sc[REP][TPW], bs[REP];
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        bs[r] = 0.f;
#pragma unroll
        for (int i = 0; i < TPW; ++i) sc[r][i] = 0.f;
      }
      if (tl0 < n) {
        const int g = tl0 / G;
#pragma unroll 8
        for (int j = 0; j < D / CQ; ++j) {
          const int c = j * CQ + kq;
          const vq_u32 w = kc[(cbase + c) * CK + col];
          const size_t gi = (cbase + c) * GK + g;
          const float ksc = VQ_F(ks[gi]) * TOP, kbi = VQ_F(kb[gi]) - ksc;
#pragma unroll
          for (int r = 0; r < REP; ++r) {
            const float qv = sq[r * D + c];
            const float qs = qv * ksc;
            bs[r] += qv * kbi;
#pragma unroll
            for (int i = 0; i < TPW; ++i) sc[r][i] += qs * VQ_CODE(w, i);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        float mt = -VQ_INF;
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
          float x = sc[r][i] + bs[r];
#pragma unroll
          for (int o = TW; o < 32; o <<= 1) x += VQ_SHFL_XOR(x, o);
          sc[r][i] = (tl0 + i < n) ? x : -VQ_INF;
          mt = fmaxf(mt, sc[r][i]);
        }
#pragma unroll
        for (int o = 1; o < TW; o <<= 1) mt = fmaxf(mt, VQ_SHFL_XOR(mt, o));
        const float mn = fmaxf(m[r], mt);  // finite: the tile's first token is < n
        const float corr = VQ_EXP(m[r] - mn);
        float ps = 0.f;
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
          const float p = (tl0 + i < n) ? VQ_EXP(sc[r][i] - mn) : 0.f;
          ps += p;
          if (kq == 0) wp[r * TOK + kw * TPW + i] = p;
        }
#pragma unroll
        for (int o = 1; o < TW; o <<= 1) ps += VQ_SHFL_XOR(ps, o);
        l[r] = l[r] * corr + ps;
        vb[r] *= corr;
#pragma unroll
        for (int i = 0; i < TPW; ++i) acc[r][i] *= corr;
        m[r] = mn;
      }
      VQ_SYNCWARP();
#pragma unroll 8
      for (int kk = 0; kk < TOK / RPW; ++kk) {
        const int row = kk * RPW + ro;
        const size_t vrow = (size_t)bh * TV + (size_t)min(tt0 + row, n - 1);  // weight 0 past n
        const vq_u32 w = vc[vrow * WV + vw];
        const size_t gi = vrow * NG + (vw * TPW) / GV;
        const float vsc_ = VQ_F(vsc[gi]) * TOP, vbi_ = VQ_F(vbi[gi]) - vsc_;
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float p = wp[r * TOK + row];
          const float pw = p * vsc_;
          vb[r] += p * vbi_;
#pragma unroll
          for (int i = 0; i < TPW; ++i) acc[r][i] += pw * VQ_CODE(w, i);
        }
      }
      VQ_SYNCWARP();
    }
#pragma unroll
    for (int r = 0; r < REP; ++r) {
#pragma unroll
      for (int o = LPR; o < 32; o <<= 1) {
        vb[r] += VQ_SHFL_XOR(vb[r], o);
#pragma unroll
        for (int i = 0; i < TPW; ++i) acc[r][i] += VQ_SHFL_XOR(acc[r][i], o);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < REP; ++r) { sm_m[warp * REP + r] = m[r]; sm_l[warp * REP + r] = l[r]; }
    }
    if (ro == 0) {
#pragma unroll
      for (int r = 0; r < REP; ++r) {
#pragma unroll
        for (int i = 0; i < TPW; ++i) sm_a[(warp * REP + r) * DV + vw * TPW + i] = acc[r][i] + vb[r];
      }
    }
  }
""" + BLOCK_JOIN

# CK / GK: key words / groups per channel row; TV: value rows; NG: value groups per row (buffer capacities)
# four blocks an SM (the fused tail would otherwise take a few more registers than the 128 that allows)
_KERNELS = kernel_variants("vq_kivi_decode", ["q", "kc", "ks", "kb", "vc", "vsc", "vbi"],
                           [("n_all", "int"), ("scale", "float"), ("CK", "int"), ("GK", "int"), ("TV", "int"),
                            ("NG", "int")], _SOURCE, bounds=(32 * WARPS, 4))


@functools.cache
def supported(bits: int, group: int, value_group: int, d: int, dv: int, rep: int = 1) -> bool:
    """Layouts the kernel reads: b in {2, 4, 8} (codes never straddle words), G a multiple of 32, a
    value word inside one value group, a value row of at most 32 words dividing the warp, head dims
    multiples of 32, per-lane registers for ``rep`` query heads x 32/b tokens (at most 64), and the
    block's shared memory (query, tile weights, warp partials) within 48 KB."""
    tpw = 32 // bits if bits in (2, 4, 8) else 0
    wv = dv * bits // 32
    smem = 4 * rep * (d + WARPS * (TILE_WORDS * tpw + dv + 2) + 32)  # + the fused merge's split weights
    return (tpw > 0 and group % 32 == 0 and d % 32 == 0 and dv % 32 == 0 and dv % value_group == 0
            and value_group % tpw == 0 and 0 < wv <= 32 and 32 % wv == 0 and rep * tpw <= 64
            and smem <= 48 * 1024)


def kivi_partials(queries, scale: float, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, n: int,
                  bits: int, group: int, value_group: int, exact, counts=None, merge=None):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first
    ``n`` quantized tokens (a multiple of 32), then the exact rows (``exact`` as for
    ``waterfill_partials``). ``queries`` [B, H * R, 1, D] as the model gives them; the arrays are the
    cache's buffers at full capacity. A batch form passes ``counts`` (int32 [B, 5]: quantized tokens, then
    first row and rows taken of each exact buffer, per sequence; ``_common.kernel_variants``), ``n`` their
    maximum.
    With ``merge`` (``_common.Merge``): the attention output [B, H * R, 1, Dv] (``_common.launch``)."""
    B, Hq, _, D = queries.shape
    H = k_codes.shape[1]
    dv = v_codes.shape[-1] * 32 // bits
    tiles = -(-n // (TILE_WORDS * (32 // bits)))
    # one tile per warp while the grid stays under ~BLOCKS blocks; past that, warps take several tiles
    S = max(1, min(MAX_SPLITS, -(-tiles // WARPS), -(-BLOCKS // (B * H))))
    arrays, scalars, consts = exact_args(exact, counts, H)
    return launch(_KERNELS, counts is not None,
                  [queries, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, *arrays],
                  [int(n), float(scale), k_codes.shape[3], k_scales.shape[3], v_codes.shape[2], v_scales.shape[3],
                   *scalars],
                  (("D", D), ("KB", bits), ("G", group), ("GV", value_group), ("WV", v_codes.shape[-1]),
                   ("TW", TILE_WORDS)) + consts, B, H, Hq // H, S, dv, merge)
