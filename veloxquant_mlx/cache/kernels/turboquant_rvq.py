"""Decode kernel for TurboQuant-RVQ's layout: per token a bit-packed stage-1 code (and, with more than 8 bits, a
stage-2 code) per key sub-vector and per value sub-vector, float16 norms, all in the rotated domain ``y = Pi x / |x|``.

One lane per token for the scores: a warp takes a tile of 32 tokens, each lane reads its token's key words (whole
rows, vector loads) and sums ``qr_s . c1[i_s] + sigma[i_s] * (qr_s . c2[j_s])`` over the sub-vectors ``s``, the
rotated query ``qr = q Pi^T`` and the stage-1 codebook in shared memory, the stage-2 products ``qr_s . c2[j]`` a
table the block builds once (``REP * S * K2`` entries). No cross-lane sum per token: the tile's online-softmax update
is one warp max per query head, and each lane's weight ``p * |v|`` goes to shared memory with its token's value
words. Then the warp walks the tile's tokens: lane ``l`` owns value channels ``l * DV/32 ..`` (inside one
sub-vector), reads the token's code from shared memory and its centroid slice from the shared value codebook. The
weighted value sum stays in the rotated domain; the fused launch's last block rotates it back once with the dense
matrix (``_common.FUSED_TAIL``, ``ROT == 2``; the split count is kept within ``FUSED_MAX_S1`` partials so a step is
always one launch).
"""

from __future__ import annotations

import functools

from ..primitives.bitpack import packed_words
from ..primitives.rvq import split_bits
from . import _common
from ._common import (ACC_INIT, BLOCK_JOIN, BLOCK_SHARED, KERNEL_HEAD, MAX_SPLITS, ML_STORE, SQ_EXACT, WARPS, Merge,
                      exact_args, kernel_variants, launch, window_exact)

__all__ = ["tq_partials", "supported", "decode_attend"]

BLOCKS = 512  # grid size past which a split's warps take several tiles (as KIVI's kernel)
SMEM_MAX = 48 * 1024

_SOURCE = KERNEL_HEAD + r"""  constexpr int VJ = DV / 32;  // value channels per lane (one sub-vector's slice)
  constexpr int NS = D / SK, NVS = DV / VS;
  constexpr int K1 = 1 << B1, K2 = B2 ? 1 << B2 : 1, VK1 = 1 << VB1, VK2 = VB2 ? 1 << VB2 : 1;
  constexpr int WVR = WV1 + (VB2 ? WV2 : 0);  // value words per token kept in shared memory
  VQ_SHARED float sq[REP * D];
  VQ_SHARED float c1s[K1 * SK];
  VQ_SHARED float sg1[B2 ? K1 : 1];
  VQ_SHARED float lut2[B2 ? REP * NS * K2 : 1];
  VQ_SHARED float vc1s[VK1 * VS];
  VQ_SHARED float vsg[VB2 ? VK1 : 1];
  VQ_SHARED float vc2s[VB2 ? VK2 * VS : 1];
  VQ_SHARED float sw[NW * 32 * REP];
  VQ_SHARED vq_u32 scode[NW * 32 * WVR];
""" + BLOCK_SHARED + r"""
#define VQ_VROT vrot
  if (s == S) {
    for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) sq[i] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
    VQ_SYNC();
""" + SQ_EXACT + r"""  } else {
    // the tables, with the thread count a constant: unrolled copies whose loads are all in flight at once
    constexpr int NT = 32 * NW;
    VQ_SHARED float c2s[B2 ? K2 * SK : 1];
#pragma unroll
    for (int i = VQ_TID; i < REP * D; i += NT) sq[i] = qr[(size_t)bh * REP * D + i] * scale;
#pragma unroll
    for (int i = VQ_TID; i < K1 * SK; i += NT) c1s[i] = kc1[i];
#pragma unroll
    for (int i = VQ_TID; i < VK1 * VS; i += NT) vc1s[i] = vc1[i];
    if (B2) {
#pragma unroll
      for (int i = VQ_TID; i < K1; i += NT) sg1[i] = ksg[i];
#pragma unroll
      for (int i = VQ_TID; i < K2 * SK; i += NT) c2s[i] = kc2[i];
    }
    if (VB2) {
#pragma unroll
      for (int i = VQ_TID; i < VK1; i += NT) vsg[i] = vsgm[i];
#pragma unroll
      for (int i = VQ_TID; i < VK2 * VS; i += NT) vc2s[i] = vc2[i];
    }
    VQ_SYNC();
    if (B2) {  // qr_s . c2[j] for every query head, sub-vector and stage-2 centroid
#pragma unroll 4
      for (int i = VQ_TID; i < REP * NS * K2; i += NT) {
        const int j = i % K2, rs = i / K2;  // rs = r * NS + sub
        const float* qs = sq + (rs / NS) * D + (rs % NS) * SK;
        float a = 0.f;
#pragma unroll
        for (int d = 0; d < SK; ++d) a += qs[d] * c2s[j * SK + d];
        lut2[i] = a;
      }
      VQ_SYNC();
    }
""" + ACC_INIT + r"""    const int ntiles = (n + 31) / 32;
    const int vsub = lane * VJ / VS, voff = lane * VJ % VS;  // this lane's value sub-vector and first channel in it
    float* wts = sw + warp * 32 * REP;
    vq_u32* codes = scode + warp * 32 * WVR;
    for (int ti = s * NW + warp; ti < ntiles; ti += S * NW) {
      const int t = ti * 32 + lane;
      const bool valid = t < n;
      const size_t tc = (size_t)(valid ? t : n - 1);
      vq_u32 w1[W1], w2[B2 ? W2 : 1];
      vq_row<W1>(k1 + ((size_t)bh * TK1 + tc) * W1, w1);
      if (B2) vq_row<B2 ? W2 : 1>(k2 + ((size_t)bh * TK2 + tc) * W2, w2);
      const float kn = VQ_F(kn_[(size_t)bh * TKN + tc]);
      const float vn = VQ_F(vn_[(size_t)bh * TVN + tc]);
      {
        vq_u32 vw[WVR];
        vq_row<WV1>(v1 + ((size_t)bh * TV1 + tc) * WV1, vw);
        if (VB2) vq_row<VB2 ? WV2 : 1>(v2 + ((size_t)bh * TV2 + tc) * WV2, vw + (VB2 ? WV1 : 0));
#pragma unroll
        for (int i = 0; i < WVR; ++i) codes[lane * WVR + i] = vw[i];
      }
      float sc[REP];
#pragma unroll
      for (int r = 0; r < REP; ++r) sc[r] = 0.f;
#pragma unroll
      for (int sub = 0; sub < NS; ++sub) {
        const vq_u32 i1 = vq_bits<B1>(w1, sub * B1);
        float c[SK];
#pragma unroll
        for (int d = 0; d < SK; ++d) c[d] = c1s[i1 * SK + d];
        float g2 = 0.f;
        vq_u32 i2 = 0;
        if (B2) { g2 = sg1[i1]; i2 = vq_bits<B2 ? B2 : 1>(w2, sub * B2); }
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float* qs = sq + r * D + sub * SK;
          float a = 0.f;
#pragma unroll
          for (int d = 0; d < SK; ++d) a += qs[d] * c[d];
          if (B2) a += g2 * lut2[(r * NS + sub) * K2 + i2];
          sc[r] += a;
        }
      }
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        const float x = valid ? sc[r] * kn : -VQ_INF;
        float tm = x;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, VQ_SHFL_XOR(tm, o));
        const float mn = fmaxf(m[r], tm);
        const float corr = VQ_EXP(m[r] - mn);
        const float p = VQ_EXP(x - mn);
        l[r] = l[r] * corr + p;
#pragma unroll
        for (int j = 0; j < VJ; ++j) acc[r][j] *= corr;
        m[r] = mn;
        wts[lane * REP + r] = p * vn;
      }
      VQ_SYNCWARP();
      const int nt = min(32, n - ti * 32);
      for (int u = 0; u < nt; ++u) {
        const vq_u32* cw = codes + u * WVR;
        const vq_u32 a1 = vq_bits_at<VB1>(cw, vsub * VB1);
        float v[VJ];
#pragma unroll
        for (int j = 0; j < VJ; ++j) v[j] = vc1s[a1 * VS + voff + j];
        if (VB2) {
          const vq_u32 a2 = vq_bits_at<VB2 ? VB2 : 1>(cw + WV1, vsub * VB2);
          const float g = vsg[a1];
#pragma unroll
          for (int j = 0; j < VJ; ++j) v[j] += g * vc2s[a2 * VS + voff + j];
        }
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float w = wts[u * REP + r];
#pragma unroll
          for (int j = 0; j < VJ; ++j) acc[r][j] += w * v[j];
        }
      }
      VQ_SYNCWARP();
    }
#pragma unroll
    for (int r = 0; r < REP; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l[r] += VQ_SHFL_XOR(l[r], o);
    }
""" + ML_STORE + r"""#pragma unroll
    for (int r = 0; r < REP; ++r) {
#pragma unroll
      for (int j = 0; j < VJ; ++j) sm_a[(warp * REP + r) * DV + lane * VJ + j] = acc[r][j];
    }
  }
""" + BLOCK_JOIN

# Row loads and bit fields (device functions ahead of the kernel): a row of W words (vector loads when W is a
# multiple of 4: the rows are 16-byte aligned then), code ``nb`` bits from stream bit ``pos`` of a row (constant
# ``pos`` when unrolled; codes may straddle two words). Also the prefill kernels' (``turboquant_rvq_rows``).
ROW_HELPERS = r"""
struct alignas(16) vq_u4 { unsigned int x, y, z, w; };
template <int W> __device__ __forceinline__ void vq_row(const unsigned int* p, unsigned int* w) {
  if (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const vq_u4 x = reinterpret_cast<const vq_u4*>(p)[i];
      w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = p[i];
  }
}
template <int NB> __device__ __forceinline__ unsigned int vq_bits(const unsigned int* w, int pos) {
  const int i = pos >> 5, sh = pos & 31;
  unsigned int x = w[i] >> sh;
  if (sh + NB > 32) x |= w[i + 1] << (32 - sh);
  return x & ((1u << NB) - 1u);
}
#define vq_bits_at vq_bits
"""

_INPUTS = ["q", "qr", "k1", "k2", "kn_", "v1", "v2", "vn_", "kc1", "ksg", "kc2", "vc1", "vsgm", "vc2", "vrot"]
# TK1 / TK2 / TKN / TV1 / TV2 / TVN: rows (capacities) of the key planes, key norms, value planes, value norms
_KERNELS = kernel_variants("vq_tqrvq_decode", _INPUTS,
                           [("n_all", "int"), ("scale", "float"), ("TK1", "int"), ("TK2", "int"), ("TKN", "int"),
                            ("TV1", "int"), ("TV2", "int"), ("TVN", "int")], _SOURCE, prelude=ROW_HELPERS)


@functools.cache
def supported(d: int, dv: int, rep: int, key_sub: int, key_bits: int, value_sub: int, value_bits: int) -> bool:
    """Shapes the kernel reads: head dims multiples of 32, a lane's DV/32 value channels inside one value
    sub-vector, at most 8 stage-1 bits (bit-packed planes as ``primitives.rvq``), and shared memory within 48 KB."""
    (b1, b2), (vb1, vb2) = split_bits(key_bits), split_bits(value_bits)
    vj = dv // 32 if dv % 32 == 0 else 0
    if d % 32 or not vj or d % key_sub or dv % value_sub or value_sub % vj or b1 > 8 or vb1 > 8:
        return False
    sk, vs = key_sub, value_sub
    wvr = packed_words(dv // vs, vb1) + (packed_words(dv // vs, vb2) if vb2 else 0)
    # the block's shared floats: the kernel's tables, the warps' tiles and partials, the fused tail's
    floats = (rep * d + (1 << b1) * sk + ((1 << b1) + (rep * (d // sk) + sk) * (1 << b2) if b2 else 3) + (1 << vb1) * vs
              + ((1 << vb1) + (1 << vb2) * vs if vb2 else 2) + WARPS * 32 * (rep + wvr) + WARPS * rep * (dv + 2)
              + rep * 32 + 1)
    return 4 * floats <= SMEM_MAX


def tq_partials(queries, rotated, scale: float, k_planes, k_norms, v_planes, v_norms, key_book, value_book, rotation,
                n: int, exact, counts=None, merge=None):
    """Split-K partials (m, l, acc) [B, H, R, S + 1(, Dv)] of one decode step: S splits of the first ``n`` quantized
    rows (``acc`` in the rotated value domain, norms applied), then the exact rows (``exact`` as for
    ``waterfill_partials``). ``queries`` [B, H * R, 1, D] as the model gives them, ``rotated`` the same times the key
    rotation (float32, ``q @ rot_t``); ``k_planes``/``v_planes`` (stage-1 words, stage-2 words or None) and the norms
    are the cache's buffers at full capacity; ``key_book``/``value_book`` the ``RVQCodebook``s; ``rotation`` the
    values' dense matrix back (``acc @ rotation``). With ``merge`` (``_common.Merge``, its ``rotation`` set): the
    attention output [B, H * R, 1, Dv]."""
    B, Hq, _, D = queries.shape
    H = k_planes[0].shape[1]
    dv = value_book.dim
    tiles = -(-n // 32)
    S = max(1, min(MAX_SPLITS, -(-tiles // WARPS), -(-BLOCKS // (B * H))))
    if merge is not None:
        S = min(S, _common.FUSED_MAX_S1 - 1)  # the dense rotation is in the fused tail: always one launch
    arrays, scalars, consts = exact_args(exact, counts, H)
    (k1, k2), (v1, v2) = k_planes, v_planes
    k2, v2 = (k1 if k2 is None else k2), (v1 if v2 is None else v2)  # stand-ins when one stage (never read)

    def book(cb):  # (c1, sigma, c2, stage-2 bits); c1 stands in for a one-stage codebook's absent arrays
        two = cb.c2 is not None
        return cb.c1, cb.sigma if two else cb.c1, cb.c2 if two else cb.c1, cb.bits2 if two else 0

    *kbook, b2 = book(key_book)
    *vbook, vb2 = book(value_book)
    ins = [queries, rotated, k1, k2, k_norms, v1, v2, v_norms, *kbook, *vbook, rotation]
    caps = [a.shape[2] for a in (k1, k2, k_norms, v1, v2, v_norms)]
    consts = (("D", D), ("SK", key_book.sub_dim), ("B1", key_book.bits1), ("B2", b2), ("W1", k1.shape[-1]),
              ("W2", k2.shape[-1]), ("VS", value_book.sub_dim), ("VB1", value_book.bits1), ("VB2", vb2),
              ("WV1", v1.shape[-1]), ("WV2", v2.shape[-1])) + consts
    return launch(_KERNELS, counts is not None, ins + arrays, [int(n), float(scale), *caps, *scalars], consts, B, H,
                  Hq // H, S, dv, merge)


def decode_attend(c, queries, scale: float, sinks=None):
    """One query row of TurboQuant-RVQ cache ``c``: the codes' split-K partials plus the float16 sinks, the window and
    the call's own row, merged in one softmax (the values rotated back once) by the launch's last block per head."""
    call, c._call = c._call, None
    kq, vq = c._qs()
    rot = vq.rotation_back()  # kept on the shared quantizer, counted in the cache's constant_nbytes
    return tq_partials(queries, queries @ kq.rot_t, scale, (c.k_codes1, getattr(c, "k_codes2", None)), c.k_norms,
                       (c.v_codes1, getattr(c, "v_codes2", None)), c.v_norms, kq.cb, vq.cb, rot, call.q0,
                       window_exact(c, call), merge=Merge(sinks, False, queries.dtype, c, rot))
