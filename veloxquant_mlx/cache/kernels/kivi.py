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

A code becomes a float without an int-to-float conversion (``VQ_CODE``, the offset folded into the bias: ``TOP``):
the kernel is bound by instruction issue (docs/RESULTS.md "Decode: what bounds a step").

Tensor cores (4-bit codes, float16/bfloat16 queries, sm_80+: ``uses_tensor_cores``): the same tiles of 64 tokens,
but both products are ``mma.m16n8k16`` (float16 in, float32 sums) with the query heads as the mma's n (up to 8).
A lane forms each float16 pair of two codes at once: ``prmt`` puts byte j of two words side by side, one ``lop3``
ORs a nibble of each into the mantissa of 1024 (low nibble) or 64 (high: its unit is 1/16), an exact ``sub``
leaves the codes and one ``fma`` applies the pair's scales and biases. Keys: a lane's four words are channels
2t, 2t + 1, 2t + 8, 2t + 9 of a 16-channel slice at the tile's word column g, so mma j's rows are the tokens of
byte j; values alike with two tokens' words per pair. The weights go through shared memory as float16 pairs.
Deviation from the float32 kernel: dequantized keys and values, the scaled query and the softmax weights are
rounded to float16 (relative 2^-11 each; the model's own rows are 2-byte floats), sums stay float32; float32
models keep the float32 kernel (H200 timings and its error against that kernel: docs/RESULTS.md).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._compile import HALF_FLOATS, TENSOR_PRELUDE, tensor_cores_here
from ._common import (BLOCK_JOIN, BLOCK_SHARED, KERNEL_HEAD, MAX_SPLITS, ML_STORE, MMA_STORE, SQ_EXACT, WARPS,
                      exact_args, kernel_variants, launch, shared_limit)

__all__ = ["kivi_partials", "supported", "TILE_WORDS", "tensor_core_layout", "uses_tensor_cores"]

TILE_WORDS = 8  # key words per channel in a warp's tile; 32 / TILE_WORDS channel quarters per warp
BLOCKS = 512  # grid size past which splits take several tiles (~4 blocks per SM on an H200: one wave)

_HEAD = KERNEL_HEAD + r"""  constexpr int VJ = DV / 32;
  constexpr int TPW = 32 / KB;        // tokens (or value channels) per code word
  constexpr int CQ = 32 / TW;         // channel quarters per warp
  constexpr int TOK = TW * TPW;       // tokens per warp tile
  constexpr int LPR = WV;             // lanes per value row (one word each)
  constexpr int RPW = 32 / LPR;       // value rows per warp load
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  constexpr float TOP = (float)(1u << KB);  // code c of a word reads as 1 + c / TOP (VQ_CODE), so x = s c + z
                                            // = (s TOP) (1 + c / TOP) + (z - s TOP): no int-to-float conversion
  VQ_SHARED float sq[REP * D];
VQ_KERNEL_SHARED
""" + BLOCK_SHARED + r"""
  for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) sq[i] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
  VQ_SYNC();
  if (s == S) {
""" + SQ_EXACT

_FFMA = r"""  } else {
    const int ntiles = (n + TOK - 1) / TOK;
    const int kq = lane / TW, kw = lane % TW;     // key lanes: channel quarter, word in the tile
    const int vw = lane % LPR, ro = lane / LPR;   // value lanes: word in the row, row offset
    VQ_TG float* wp = sp + warp * REP * TOK;
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
""" + ML_STORE + r"""    if (ro == 0) {
#pragma unroll
      for (int r = 0; r < REP; ++r) {
#pragma unroll
        for (int i = 0; i < TPW; ++i) sm_a[(warp * REP + r) * DV + vw * TPW + i] = acc[r][i] + vb[r];
      }
    }
  }
""" + BLOCK_JOIN

_MMA = r"""  } else {
    // tensor cores (4-bit codes): thread (g, t) = (lane / 4, lane % 4) of mma.m16n8k16; n = the query heads (REP <= 8)
    VQ_SHARED vq_u32 sp2[NW * 8 * PRS];  // a warp's tile weights as float16 pairs: [head][token / 2], rows PRS words
    constexpr int KS = D / 16, VS = DV / 64;  // key k-slices of 16 channels; value sets of 64 channels
    const int g = lane >> 2, t = lane & 3;
    // the query fragments (float16, scale folded in) of lane (g, t) and slice k: head g, channels 16 k + 2 t (+1, +8,
    // +9); in shared memory, read once per slice (in registers they pushed the kernel past its 128)
    VQ_SHARED vq_u32 sbq[KS * 32 * 2];
    for (int i = VQ_TID; i < KS * 32; i += VQ_NTHREADS) {
      const int k = i / 32, gi = (i % 32) >> 2, ti = i & 3;
      const float* qg = sq + (gi < REP ? gi : 0) * D + 16 * k + 2 * ti;
      sbq[2 * i] = gi < REP ? vq_h2(qg[0], qg[1]) : 0u;
      sbq[2 * i + 1] = gi < REP ? vq_h2(qg[8], qg[9]) : 0u;
    }
    VQ_SYNC();
    float m2[2] = {-VQ_INF, -VQ_INF}, l2[2] = {0.f, 0.f};  // heads 2 t + u
    float acc[VS][4][4];  // channel 64 v + 8 g + 2 j (+1 for [2], [3]), heads 2 t, 2 t + 1
#pragma unroll
    for (int v = 0; v < VS; ++v)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[v][j][e] = 0.f;
    vq_u32* wp = sp2 + warp * 8 * PRS;
    const int ntiles = (n + 63) / 64;
    const int nw = n / 8;  // key words per channel holding quantized tokens (n is a multiple of 32)
    const size_t cbase = (size_t)bh * D;
    for (int ti = s * NW + warp; ti < ntiles; ti += S * NW) {
      const int tt0 = ti * 64;
      // keys: the thread's word column holds tokens 8 g .. 8 g + 7 of the tile; mma j has rows g <-> token
      // 8 g + 2 j and g + 8 <-> token 8 g + 2 j + 1 (the low and high nibbles of byte j of each word)
      const int col = min(ti * 8 + g, nw - 1);
      const int grp = (col * 8) / G;
      float sc[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[j][e] = 0.f;
#pragma unroll 2
      for (int k = 0; k < KS; ++k) {
        const size_t c0 = cbase + 16 * k + 2 * t;
        const vq_u32 wa = kc[c0 * CK + col], wb = kc[(c0 + 1) * CK + col];
        const vq_u32 wc = kc[(c0 + 8) * CK + col], wd = kc[(c0 + 9) * CK + col];
        const vq_u32 sab = vq_hpair(ks[c0 * GK + grp], ks[(c0 + 1) * GK + grp]);
        const vq_u32 zab = vq_hpair(kb[c0 * GK + grp], kb[(c0 + 1) * GK + grp]);
        const vq_u32 scd = vq_hpair(ks[(c0 + 8) * GK + grp], ks[(c0 + 9) * GK + grp]);
        const vq_u32 zcd = vq_hpair(kb[(c0 + 8) * GK + grp], kb[(c0 + 9) * GK + grp]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const vq_u32 pab = __byte_perm(wa, wb, 0x4400u + 0x1111u * j);
          const vq_u32 pcd = __byte_perm(wc, wd, 0x4400u + 0x1111u * j);
          vq_mma(sc[j], vq_deq_lo(pab, sab, zab), vq_deq_hi(pab, sab, zab), vq_deq_lo(pcd, scd, zcd),
                 vq_deq_hi(pcd, scd, zcd), sbq[(k * 32 + lane) * 2], sbq[(k * 32 + lane) * 2 + 1]);
        }
      }
      // online softmax of the tile for heads 2 t + u: sc[j][2 v + u] is token 8 g + 2 j + v
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float mt = -VQ_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            if (tt0 + 8 * g + 2 * j + v >= n) sc[j][2 * v + u] = -VQ_INF;
            mt = fmaxf(mt, sc[j][2 * v + u]);
          }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) mt = fmaxf(mt, VQ_SHFL_XOR(mt, o));
        const float mn = fmaxf(m2[u], mt);  // finite: the tile's first token is < n
        const float corr = VQ_EXP(m2[u] - mn);
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float p0 = VQ_EXP(sc[j][u] - mn), p1 = VQ_EXP(sc[j][2 + u] - mn);
          ps += p0 + p1;
          wp[(2 * t + u) * PRS + 4 * g + j] = vq_h2(p0, p1);
        }
        l2[u] = l2[u] * corr + ps;  // this lane's tokens; summed over the lanes at the end
#pragma unroll
        for (int v = 0; v < VS; ++v)
#pragma unroll
          for (int j = 0; j < 4; ++j) { acc[v][j][u] *= corr; acc[v][j][2 + u] *= corr; }
        m2[u] = mn;
      }
      VQ_SYNCWARP();
      // values: mma over 16 tokens (k) at a time; rows g <-> channel 64 v + 8 g + 2 j, g + 8 <-> the next channel
      // (nibbles 2 j, 2 j + 1 of word 8 v + g of a row); k 2 t, 2 t + 1, 2 t + 8, 2 t + 9 <-> the tokens
#pragma unroll 2
      for (int kk = 0; kk < 4; ++kk) {
        const int tk = tt0 + 16 * kk + 2 * t;
        const size_t ra = (size_t)bh * TV + min(tk, n - 1), rb = (size_t)bh * TV + min(tk + 1, n - 1);
        const size_t rc = (size_t)bh * TV + min(tk + 8, n - 1), rd = (size_t)bh * TV + min(tk + 9, n - 1);
        const vq_u32 b0 = g < REP ? wp[g * PRS + 8 * kk + t] : 0u, b1 = g < REP ? wp[g * PRS + 8 * kk + t + 4] : 0u;
#pragma unroll
        for (int v = 0; v < VS; ++v) {
          const int wi = 8 * v + g, gv = (wi * 8) / GV;
          const vq_u32 wa = vc[ra * WV + wi], wb = vc[rb * WV + wi], wc = vc[rc * WV + wi], wd = vc[rd * WV + wi];
          const vq_u32 sab = vq_hpair(vsc[ra * NG + gv], vsc[rb * NG + gv]);
          const vq_u32 zab = vq_hpair(vbi[ra * NG + gv], vbi[rb * NG + gv]);
          const vq_u32 scd = vq_hpair(vsc[rc * NG + gv], vsc[rd * NG + gv]);
          const vq_u32 zcd = vq_hpair(vbi[rc * NG + gv], vbi[rd * NG + gv]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const vq_u32 pab = __byte_perm(wa, wb, 0x4400u + 0x1111u * j);
            const vq_u32 pcd = __byte_perm(wc, wd, 0x4400u + 0x1111u * j);
            vq_mma(acc[v][j], vq_deq_lo(pab, sab, zab), vq_deq_hi(pab, sab, zab), vq_deq_lo(pcd, scd, zcd),
                   vq_deq_hi(pcd, scd, zcd), b0, b1);
          }
        }
      }
      VQ_SYNCWARP();
    }
#define VQ_MMA_CH(v, j) (64 * (v) + 8 * g + 2 * (j))
""" + MMA_STORE + r"""#undef VQ_MMA_CH
  }
""" + BLOCK_JOIN

# CK / GK: key words / groups per channel row; TV: value rows; NG: value groups per row (buffer capacities)
# four blocks an SM (the fused tail would otherwise take a few more registers than the 128 that allows)
_INPUTS = ["q", "kc", "ks", "kb", "vc", "vsc", "vbi"]
_SCALARS = [("n_all", "int"), ("scale", "float"), ("CK", "int"), ("GK", "int"), ("TV", "int"), ("NG", "int")]
# each kernel's own shared arrays, declared at the kernel's outer scope (as Metal wants threadgroup arrays)
_KERNELS = kernel_variants("vq_kivi_decode", _INPUTS, _SCALARS, (_HEAD + _FFMA).replace(
    "VQ_KERNEL_SHARED", "  VQ_SHARED float sp[NW * REP * TOK];  // the warps' tile weights"), bounds=(32 * WARPS, 4))

_MMA_KERNELS = kernel_variants("vq_kivi_decode_mma", _INPUTS, _SCALARS,
                               (_HEAD + _MMA).replace("VQ_KERNEL_SHARED\n", ""), bounds=(32 * WARPS, 4),
                               prelude=TENSOR_PRELUDE)
TENSOR_CORES = True  # 4-bit layouts on sm_80+ take the tensor-core kernel (tests switch it off to test the other)
PAIR_ROW_WORDS = 36  # a head's row of tile weights in shared memory: 32 float16 pairs + 4 (no bank conflicts)


@functools.cache
def tensor_core_layout(bits: int, group: int, value_group: int, d: int, dv: int, rep: int) -> bool:
    """Layouts the tensor-core kernel reads: 4-bit codes, head dims multiples of 16 (keys) and 64 (values) up to
    128 (its registers), at most 8 query heads per KV head (the mma's n), whole bytes per value group."""
    return (bits == 4 and d % 16 == 0 and d <= 128 and dv % 64 == 0 and dv <= 128 and rep <= 8
            and value_group % 8 == 0 and group % 8 == 0)


def uses_tensor_cores(bits: int, group: int, value_group: int, d: int, dv: int, rep: int, dtype) -> bool:
    """Whether a decode step of this layout runs the tensor-core kernel: ``TENSOR_CORES``, the layout, queries in a
    2-byte float (its float16 rounding is then no coarser than the model's own: float32 models keep the float32
    kernel), an sm_80+ device."""
    return (TENSOR_CORES and dtype in HALF_FLOATS and tensor_core_layout(bits, group, value_group, d, dv, rep)
            and tensor_cores_here())


@functools.cache
def supported(bits: int, group: int, value_group: int, d: int, dv: int, rep: int = 1) -> bool:
    """Layouts the kernel reads: b in {2, 4, 8} (codes never straddle words), G a multiple of 32, a
    value word inside one value group, a value row of at most 32 words dividing the warp, head dims
    multiples of 32, per-lane registers for ``rep`` query heads x 32/b tokens (at most 64), and the
    block's shared memory (query, tile weights, warp partials) within ``_common.shared_limit``."""
    tpw = 32 // bits if bits in (2, 4, 8) else 0
    wv = dv * bits // 32
    smem = 4 * rep * (d + WARPS * (TILE_WORDS * tpw + dv + 2) + 32)  # + the fused merge's split weights
    return (tpw > 0 and group % 32 == 0 and d % 32 == 0 and dv % 32 == 0 and dv % value_group == 0
            and value_group % tpw == 0 and 0 < wv <= 32 and 32 % wv == 0 and rep * tpw <= 64
            and smem <= shared_limit())


def kivi_partials(queries, scale: float, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, n: int,
                  bits: int, group: int, value_group: int, exact, counts=None, merge=None):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first
    ``n`` quantized tokens (a multiple of 32), then the exact rows (``exact`` as for
    ``waterfill_partials``). ``queries`` [B, H * R, 1, D] as the model gives them; the arrays are the
    cache's buffers at full capacity. A batch form passes ``counts`` (int32 [B, 5]: quantized tokens, then
    first row and rows taken of each exact buffer, per sequence; ``_common.kernel_variants``), ``n`` their
    maximum. With ``merge`` (``_common.Merge``): the attention output [B, H * R, 1, Dv] (``_common.launch``)."""
    B, Hq, _, D = queries.shape
    H = k_codes.shape[1]
    dv = v_codes.shape[-1] * 32 // bits
    tiles = -(-n // (TILE_WORDS * (32 // bits)))
    # one tile per warp while the grid stays under ~BLOCKS blocks; past that, warps take several tiles
    S = max(1, min(MAX_SPLITS, -(-tiles // WARPS), -(-BLOCKS // (B * H))))
    arrays, scalars, consts = exact_args(exact, counts, H)
    mma = uses_tensor_cores(bits, group, value_group, D, dv, Hq // H, queries.dtype)
    return launch(_MMA_KERNELS if mma else _KERNELS, counts is not None,
                  [queries, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, *arrays],
                  [int(n), float(scale), k_codes.shape[3], k_scales.shape[3], v_codes.shape[2], v_scales.shape[3],
                   *scalars],
                  (("D", D), ("KB", bits), ("G", group), ("GV", value_group), ("WV", v_codes.shape[-1]),
                   ("TW", TILE_WORDS)) + ((("PRS", PAIR_ROW_WORDS),) if mma else ()) + consts, B, H, Hq // H, S, dv,
                  merge)
