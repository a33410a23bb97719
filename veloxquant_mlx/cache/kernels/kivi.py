"""Decode kernel for KIVI's layout (and its family through the shared layout): keys per channel,
stored transposed (``k_codes [B, H, D, groups * words]``, token ``t`` of channel ``c`` at bits
``t*b .. t*b + b - 1`` of the channel's word stream, float16 scale/bias per channel and group of G
tokens), values per token (``v_codes [B, H, T, Dv*b/32]``, float16 scale/bias per token and group of
Gv channels); MLX's affine layout ``x = code * scale + bias`` with b in {2, 4, 8}.

A warp takes a tile of 32 words per key channel (32 * 32/b tokens): lane i reads word i of every
channel (128 coalesced bytes per channel), so each word is read once and holds 32/b of the lane's
tokens; the scale folds into the query (``q_c * s_c``) and the bias into one dot product per lane.
After one online-softmax update for the tile, the value rows are read a whole row per 32/(Dv*b/32)
lanes (consecutive rows: coalesced), each lane owning one word's 32/b channels; the weights reach
those lanes by shuffles. Splits take tiles round-robin; the block's warps join in shared memory.
"""

from __future__ import annotations

import mlx.core as mx

from ._common import (BLOCK_JOIN, BLOCK_SHARED, EXACT_INPUTS, EXACT_ROWS, LANE_STORE, MAX_SPLITS, OUTPUTS, WARPS,
                      cuda_kernel, exact_template, launch, scale_array)

__all__ = ["kivi_partials", "supported"]

_SOURCE = r"""
  const int n = meta[0];
  const int e0 = meta[1];
  const int e1 = meta[2];
  const float scale = fs[0];
  const int CK = kc_shape[3];
  const int GK = ks_shape[3];
  const int TV = vc_shape[2];
  const int NG = vsc_shape[3];
  const int bh = VQ_BLOCK_X;
  const int s = VQ_BLOCK_Y;
  const int S1 = VQ_GRID_Y;
  const int S = S1 - 1;  // splits of the quantized rows; block row S takes the exact rows
  const int lane = VQ_LANE, warp = VQ_WARP;
  constexpr int VJ = DV / 32;
  constexpr int TPW = 32 / KB;       // tokens per code word
  constexpr int TILE = 32 * TPW;     // tokens per warp tile: one key word per lane and channel
  constexpr int LPR = WV;            // lanes per value row (one word each)
  constexpr int RPW = 32 / LPR;      // value rows per warp load
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  VQ_SHARED float sq[REP * D];
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
    const int ntiles = (n + TILE - 1) / TILE;
    const int wi = lane % LPR, ro = lane / LPR;
    float m[REP], l[REP], acc[REP][TPW], vb[REP];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      m[r] = -VQ_INF; l[r] = 0.f; vb[r] = 0.f;
#pragma unroll
      for (int i = 0; i < TPW; ++i) acc[r][i] = 0.f;
    }
    const size_t cbase = (size_t)bh * D;
    for (int ti = s * NW + warp; ti < ntiles; ti += S * NW) {
      const int tt0 = ti * TILE;
      const int tl0 = tt0 + lane * TPW;  // this lane's first token
      float sc[REP][TPW], bs[REP];
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        bs[r] = 0.f;
#pragma unroll
        for (int i = 0; i < TPW; ++i) sc[r][i] = 0.f;
      }
      if (tl0 < n) {
        const int col = tl0 / TPW;
        const int g = tl0 / G;
#pragma unroll 8
        for (int c = 0; c < D; ++c) {
          const vq_u32 w = kc[(cbase + c) * CK + col];
          const size_t gi = (cbase + c) * GK + g;
          const float ksc = VQ_F(ks[gi]), kbi = VQ_F(kb[gi]);
#pragma unroll
          for (int r = 0; r < REP; ++r) {
            const float qv = sq[r * D + c];
            const float qs = qv * ksc;
            bs[r] += qv * kbi;
#pragma unroll
            for (int i = 0; i < TPW; ++i) sc[r][i] += qs * (float)((w >> (i * KB)) & MASK);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        float mt = -VQ_INF;
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
          sc[r][i] = (tl0 + i < n) ? sc[r][i] + bs[r] : -VQ_INF;
          mt = fmaxf(mt, sc[r][i]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, VQ_SHFL_XOR(mt, o));
        const float mn = fmaxf(m[r], mt);
        const float corr = VQ_EXP(m[r] - mn);
        float ps = 0.f;
#pragma unroll
        for (int i = 0; i < TPW; ++i) { sc[r][i] = (tl0 + i < n) ? VQ_EXP(sc[r][i] - mn) : 0.f; ps += sc[r][i]; }
        l[r] = l[r] * corr + ps;
        vb[r] *= corr;
#pragma unroll
        for (int i = 0; i < TPW; ++i) acc[r][i] *= corr;
        m[r] = mn;
      }
      // values: lane (wi, ro) reads word wi of rows owner * TPW + k, k = kk * RPW + ro
#pragma unroll 2
      for (int owner = 0; owner < 32; ++owner) {
        const int tb = tt0 + owner * TPW;
        if (tb >= n) break;
#pragma unroll
        for (int kk = 0; kk < TPW / RPW; ++kk) {
          float pv[REP];
#pragma unroll
          for (int r = 0; r < REP; ++r) {
            float sel = 0.f;
#pragma unroll
            for (int q2 = 0; q2 < RPW; ++q2) {
              const float x = VQ_SHFL(sc[r][kk * RPW + q2], owner);
              if (ro == q2) sel = x;
            }
            pv[r] = sel;
          }
          const int t = tb + kk * RPW + ro;
          if (t < n) {
            const size_t vrow = (size_t)bh * TV + (size_t)t;
            const vq_u32 w = vc[vrow * WV + wi];
            const size_t gi = vrow * NG + (wi * TPW) / GV;
            const float vsc_ = VQ_F(vsc[gi]), vbi_ = VQ_F(vbi[gi]);
#pragma unroll
            for (int r = 0; r < REP; ++r) {
              const float pw = pv[r] * vsc_;
              vb[r] += pv[r] * vbi_;
#pragma unroll
              for (int i = 0; i < TPW; ++i) acc[r][i] += pw * (float)((w >> (i * KB)) & MASK);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < REP; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l[r] += VQ_SHFL_XOR(l[r], o);
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
        for (int i = 0; i < TPW; ++i) sm_a[(warp * REP + r) * DV + wi * TPW + i] = acc[r][i] + vb[r];
      }
    }
  }
""" + BLOCK_JOIN

_INPUTS = ["q", "fs", "kc", "ks", "kb", "vc", "vsc", "vbi", "meta"] + EXACT_INPUTS


def supported(bits: int, group: int, value_group: int, d: int, dv: int, rep: int = 1) -> bool:
    """Layouts the kernel reads: b in {2, 4, 8} (codes never straddle words), G a multiple of 32, a
    value word inside one value group, a value row of at most 32 words dividing the warp, head dims
    multiples of 32, and per-lane registers for ``rep`` query heads x 32/b tokens (at most 64)."""
    tpw = 32 // bits if bits in (2, 4, 8) else 0
    wv = dv * bits // 32
    return (tpw > 0 and group % 32 == 0 and d % 32 == 0 and dv % 32 == 0 and dv % value_group == 0
            and value_group % tpw == 0 and 0 < wv <= 32 and 32 % wv == 0 and rep * tpw <= 64)


def kivi_partials(queries, scale: float, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, n: int,
                  bits: int, group: int, value_group: int, exact):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first
    ``n`` quantized tokens (a multiple of 32), then the exact rows (``exact`` as for
    ``waterfill_partials``). ``queries`` [B, H * R, 1, D] as the model gives them; the arrays are the
    cache's buffers at full capacity."""
    B, Hq, _, D = queries.shape
    H = k_codes.shape[1]
    dv = v_codes.shape[-1] * 32 // bits
    tiles = -(-n // (32 * (32 // bits)))
    S = max(1, min(MAX_SPLITS, -(-tiles // WARPS)))
    k0, v0, e0, k1, v1, e1, nk, nv = exact
    kern = cuda_kernel("vq_kivi_decode", _INPUTS, OUTPUTS, _SOURCE)
    meta = mx.array([n, e0, e1], dtype=mx.int32)
    arrays = [k0, v0, k1, v1, nk, nv]
    return launch(kern, [queries, scale_array(scale), k_codes, k_scales, k_biases, v_codes, v_scales, v_biases,
                         meta, *arrays],
                  [("D", D), ("KB", bits), ("G", group), ("GV", value_group), ("WV", v_codes.shape[-1]),
                   ("QT", queries.dtype)] + exact_template(arrays), B, H, Hq // H, S, dv)
