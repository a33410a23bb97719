"""Decode kernel for KIVI's layout (and its family through the shared layout): keys per channel,
stored transposed (``k_codes [B, H, D, groups * words]``, token ``t`` of channel ``c`` at bits
``t*b .. t*b + b - 1`` of the channel's word stream, float16 scale/bias per channel and group of G
tokens), values per token (``v_codes [B, H, T, Dv*b/32]``, float16 scale/bias per token and group of
Gv channels); MLX's affine layout ``x = code * scale + bias`` with b in {2, 4, 8}.

A warp takes 32 tokens at a time, one per lane: each lane decodes its token's key channel by channel
(the channel's word for 32 consecutive tokens is 1-4 words, read once by the warp) against the
block's queries in shared memory; an online-softmax update over the 32 scores; then the 32 value
rows are accumulated with each lane owning Dv/32 channels (each row's words read once).
"""

from __future__ import annotations

import mlx.core as mx

from ._common import (BLOCK_MERGE, EXACT_INPUTS, EXACT_ROWS, OUTPUTS, cuda_kernel, exact_template, launch,
                      scale_array, split_count)

__all__ = ["kivi_partials", "supported"]

_SOURCE = r"""
  const int n = meta[0];
  const int e0 = meta[1];
  const int e1 = meta[2];
  const float scale = fs[0];
  const int H = kc_shape[1];
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
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  VQ_SHARED float sq[REP * D];
  for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) sq[i] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
  VQ_SYNC();
  const int per = (((n + S - 1) / S) + 31) / 32 * 32;
  const int t_begin = min(n, s * per);
  const int t_end = min(n, t_begin + per);
  const int wper = (((t_end - t_begin + NW - 1) / NW) + 31) / 32 * 32;
  const int w0 = min(t_end, t_begin + warp * wper);
  const int w1 = min(t_end, w0 + wper);
  float m[REP], l[REP], acc[REP][VJ];
#pragma unroll
  for (int r = 0; r < REP; ++r) {
    m[r] = -VQ_INF; l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < VJ; ++j) acc[r][j] = 0.f;
  }
  const size_t cbase = (size_t)bh * D;
  if (s == S) {
#define QV(r, j) sq[(r) * D + lane + 32 * (j)]
""" + EXACT_ROWS + r"""
#undef QV
  } else for (int t0 = w0; t0 < w1; t0 += 32) {
    const int t = t0 + lane;
    const bool ok = t < w1;
    const int tt = ok ? t : t0;
    const int col = (tt * KB) >> 5;
    const vq_u32 sft = (vq_u32)((tt * KB) & 31);
    const int g = tt / G;
    float sc[REP];
#pragma unroll
    for (int r = 0; r < REP; ++r) sc[r] = 0.f;
#pragma unroll 8
    for (int c = 0; c < D; ++c) {
      const vq_u32 w = kc[(cbase + c) * CK + col];
      const size_t gi = (cbase + c) * GK + g;
      const float kv = (float)((w >> sft) & MASK) * VQ_F(ks[gi]) + VQ_F(kb[gi]);
#pragma unroll
      for (int r = 0; r < REP; ++r) sc[r] += sq[r * D + c] * kv;
    }
    float p[REP];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      const float sr = ok ? sc[r] : -VQ_INF;
      float mt = sr;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, VQ_SHFL_XOR(mt, o));
      const float mn = fmaxf(m[r], mt);
      const float corr = VQ_EXP(m[r] - mn);
      p[r] = ok ? VQ_EXP(sr - mn) : 0.f;
      l[r] = l[r] * corr + p[r];
#pragma unroll
      for (int j = 0; j < VJ; ++j) acc[r][j] *= corr;
      m[r] = mn;
    }
    const int cnt = min(32, w1 - t0);
    for (int i = 0; i < cnt; ++i) {
      const size_t vrow = (size_t)bh * TV + (size_t)(t0 + i);
      float pi[REP];
#pragma unroll
      for (int r = 0; r < REP; ++r) pi[r] = VQ_SHFL(p[r], i);
#pragma unroll
      for (int j = 0; j < VJ; ++j) {
        const int c = lane + 32 * j;
        const int bit = c * KB;
        const vq_u32 w = vc[vrow * WV + (bit >> 5)];
        const size_t gi = vrow * NG + c / GV;
        const float val = (float)((w >> (bit & 31)) & MASK) * VQ_F(vsc[gi]) + VQ_F(vbi[gi]);
#pragma unroll
        for (int r = 0; r < REP; ++r) acc[r][j] += pi[r] * val;
      }
    }
  }
  if (s != S) {  // the token loop keeps per-lane sums of p (the exact rows' are warp-uniform already)
#pragma unroll
    for (int r = 0; r < REP; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l[r] += VQ_SHFL_XOR(l[r], o);
    }
  }
""" + BLOCK_MERGE

_INPUTS = ["q", "fs", "kc", "ks", "kb", "vc", "vsc", "vbi", "meta"] + EXACT_INPUTS


def supported(bits: int, group: int, value_group: int, d: int, dv: int) -> bool:
    """Layouts the kernel reads: b in {2, 4, 8} (codes never straddle words), G a multiple of 32
    (key groups whole words, splits aligned to them), head dims multiples of 32."""
    return bits in (2, 4, 8) and group % 32 == 0 and d % 32 == 0 and dv % 32 == 0 and dv % value_group == 0


def kivi_partials(queries, scale: float, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, n: int,
                  bits: int, group: int, value_group: int, exact):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first
    ``n`` quantized tokens (a multiple of 32), then the exact rows (``exact`` as for
    ``waterfill_partials``). ``queries`` [B, H * R, 1, D] as the model gives them; the arrays are the
    cache's buffers at full capacity."""
    B, Hq, _, D = queries.shape
    H = k_codes.shape[1]
    dv = v_codes.shape[-1] * 32 // bits
    S = split_count(n)
    k0, v0, e0, k1, v1, e1, nk, nv = exact
    kern = cuda_kernel("vq_kivi_decode", _INPUTS, OUTPUTS, _SOURCE)
    meta = mx.array([n, e0, e1], dtype=mx.int32)
    arrays = [k0, v0, k1, v1, nk, nv]
    return launch(kern, [queries, scale_array(scale), k_codes, k_scales, k_biases, v_codes, v_scales, v_biases,
                         meta, *arrays],
                  [("D", D), ("KB", bits), ("G", group), ("GV", value_group), ("WV", v_codes.shape[-1]),
                   ("QT", queries.dtype)] + exact_template(arrays), B, H, Hq // H, S, dv)
