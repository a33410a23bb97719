"""Prefill kernel for KVQuant's layout: the first ``n`` quantized tokens as the dense keys and values a GPU prefill
chunk's fused attention reads, in the model's dtype, one launch. The op path (``KVQuantKVCache._keys_t`` /
``_values``) takes ~20 ops a layer and chunk over float32 copies of the past -- unpack, level gather, scale, outlier
scatter, transposes, RoPE, sink rows, cast -- and on an H100 (llama-8b's layer, a 6144-token past) held 160 MB of
transients per layer against the plain cache's 8 MB, which three layers in flight took above the plain cache's
whole prefill peak (docs/RESULTS.md, session 37).

A block takes ``TT`` tokens of one (batch row, KV head) into a shared ``[TT, D]`` tile: keys are decoded channel by
channel (a channel's codes are one bit stream per group: ``bitpack`` order, codes may straddle words), each code
read as its channel's non-uniform level of the group's fit, times the group's range plus its minimum; then the
outliers of the tile's groups are written into the tile (the block's own list, ``D*G`` entries a group, index
``d*G + t``), then every row is RoPE-rotated at its position (the angle ``t * omega`` in float32, as
``mx.fast.rope``; the op path sums it from per-64-position tables: they differ by float32 rounding of the angle)
and written out, sink rows replaced by their stored rows. Values: each token's codes (KIVI's per-token groups),
their outliers (index ``t*Dv + c``), the sinks. Tested against the op path (``tests/test_decode_kernels.py``) and
checked once per process at first use (``kernels.checked_call``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._common import checked_call
from ._compile import Kernel

__all__ = ["decode_rows", "supported"]

TILE = 32  # tokens per block
THREADS = 128
SHARED_FLOATS = 8192  # the tile's floats (32 KB, within Metal's threadgroup memory)

_SOURCE = r"""
  const int t0 = VQ_BLOCK_X * TT, bh = VQ_BLOCK_Y;
  const int rows = min(TT, n - t0);
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  constexpr int L = 1 << KB;
  VQ_SHARED float xt[TT][DM + 1];
  // keys: consecutive threads take consecutive tokens of one channel (the same words, distinct shared banks)
  for (int i = VQ_TID; i < D * rows; i += VQ_NTHREADS) {
    const int c = i / rows, r = i % rows, t = t0 + r, g = t / G;
    const size_t row = (size_t)bh * D + c;
    const int bit = (t % G) * KB, w = g * WK + (bit >> 5), s = bit & 31;
    vq_u32 code = kc[row * CK + w] >> s;
    if (s + KB > 32) code |= kc[row * CK + w + 1] << (32 - s);
    code &= MASK;
    const float u = VQ_F(lv[row * LC + kf[g] * L + code]);
    xt[r][c] = u * VQ_F(ks[row * GK + g]) + VQ_F(kb[row * GK + g]);
  }
  const int g0 = t0 / G, g1 = (t0 + rows - 1) / G;
  if (OK > 0) {
    VQ_SYNC();
    for (int i = VQ_TID; i < (g1 - g0 + 1) * OK; i += VQ_NTHREADS) {
      const int g = g0 + i / OK;
      const size_t e = (size_t)bh * OKC + (size_t)g * OK + i % OK;
      const int idx = (int)koi[e], t = g * G + idx % G;
      if (t >= t0 && t < t0 + rows) xt[t - t0][idx / G] = VQ_F(kov[e]);
    }
  }
  VQ_SYNC();
  for (int i = VQ_TID; i < rows * D; i += VQ_NTHREADS) {
    const int r = i / D, c = i % D, t = t0 + r;
    float y = xt[r][c];
    if (t < NS) {
      y = VQ_F(sk[((size_t)bh * NS + t) * D + c]);
    } else if (ROPE > 0 && c < RD) {
      const bool first = ROPE == 1 ? c < RD / 2 : (c & 1) == 0;
      const int p = ROPE == 1 ? (first ? c : c - RD / 2) : c >> 1;
      const int other = ROPE == 1 ? (first ? c + RD / 2 : c - RD / 2) : c ^ 1;
      float sn, cs;
      sincosf((float)t * om[p], &sn, &cs);
      y = first ? y * cs - xt[r][other] * sn : xt[r][other] * sn + y * cs;
    }
    vq_store(ok + ((size_t)bh * n + t) * D + c, y);
  }
  VQ_SYNC();
  // values: a token's codes, its per-token groups of GV channels (WV words a group)
  for (int i = VQ_TID; i < rows * DV; i += VQ_NTHREADS) {
    const int r = i / DV, c = i % DV;
    const size_t vrow = (size_t)bh * TV + t0 + r;
    const int bit = (c % GV) * KB, w = (c / GV) * WV + (bit >> 5), s = bit & 31;
    vq_u32 code = vc[vrow * CV + w] >> s;
    if (s + KB > 32) code |= vc[vrow * CV + w + 1] << (32 - s);
    code &= MASK;
    const size_t gi = vrow * NG + c / GV;
    xt[r][c] = (float)code * VQ_F(vsc[gi]) + VQ_F(vbi[gi]);
  }
  if (OV > 0) {
    VQ_SYNC();
    for (int i = VQ_TID; i < (g1 - g0 + 1) * OV; i += VQ_NTHREADS) {
      const int g = g0 + i / OV;
      const size_t e = (size_t)bh * OVC + (size_t)g * OV + i % OV;
      const int idx = (int)voi[e], t = g * G + idx / DV;
      if (t >= t0 && t < t0 + rows) xt[t - t0][idx % DV] = VQ_F(vov[e]);
    }
  }
  VQ_SYNC();
  for (int i = VQ_TID; i < rows * DV; i += VQ_NTHREADS) {
    const int r = i / DV, c = i % DV, t = t0 + r;
    vq_store(ov + ((size_t)bh * n + t) * DV + c, t < NS ? VQ_F(sv[((size_t)bh * NS + t) * DV + c]) : xt[r][c]);
  }
"""

_KERNEL = Kernel("vq_kvquant_rows",
                 ["kc", "ks", "kb", "lv", "kf", "koi", "kov", "vc", "vsc", "vbi", "voi", "vov", "om", "sk", "sv"],
                 ["ok", "ov"],
                 [("n", "int"), ("CK", "int"), ("GK", "int"), ("LC", "int"), ("OKC", "int"), ("TV", "int"),
                  ("CV", "int"), ("NG", "int"), ("OVC", "int")], _SOURCE)


@functools.cache
def supported(d: int, dv: int, value_group: int) -> bool:
    """Channels that fit the shared tile, and value groups dividing the value rows."""
    return max(d, dv) + 1 <= SHARED_FLOATS // TILE and dv % value_group == 0


def decode_rows(c, n: int, dtype) -> tuple[mx.array, mx.array]:
    """Dense (keys, values) ``[B, H, n, D]`` of KVQuant cache ``c``'s first ``n`` quantized tokens in ``dtype``:
    post-RoPE keys (if a RoPE is bound), outliers and sink rows in place -- the op path's rows."""
    B, H, D, CK = c.k_codes.shape
    dv, G, b = c.res_v.shape[-1], c.group, c.qbits
    gv = c.value_group(dv)
    none, no_idx = mx.zeros((1,), dtype=mx.float16), mx.zeros((1,), dtype=mx.uint16)  # arrays the body skips
    ok_ = c._n_out(D) if c.k_oidx is not None else 0
    ov_ = c._n_out(dv) if c.v_oidx is not None else 0
    koi, kov = (c.k_oidx, c.k_oval) if ok_ else (no_idx, none)
    voi, vov = (c.v_oidx, c.v_oval) if ov_ else (no_idx, none)
    ns = c.n_sink if c.n_sink and c.sink_k is not None else 0
    sk, sv = (c.sink_k, c.sink_v) if ns else (none, none)
    spec = c.rope
    rope = 0 if spec is None else (2 if spec["traditional"] else 1)
    om = c._rope_omega() if rope else mx.zeros((1,), dtype=mx.float32)
    consts = (("D", D), ("DV", dv), ("DM", max(D, dv)), ("KB", b), ("G", G), ("WK", (G * b + 31) // 32),
              ("GV", gv), ("WV", (gv * b + 31) // 32), ("OK", ok_), ("OV", ov_), ("NS", ns), ("ROPE", rope),
              ("RD", spec["dims"] if rope else 0), ("TT", TILE))
    arrays = [c.k_codes, c.k_scales, c.k_biases, c.k_levels, c.k_fit, koi, kov, c.v_codes, c.v_scales, c.v_biases,
              voi, vov, om, sk, sv]
    scalars = [n, CK, c.k_scales.shape[-1], c.k_levels.shape[-1], koi.shape[-1], c.v_codes.shape[2],
               c.v_codes.shape[-1], c.v_scales.shape[-1], voi.shape[-1]]
    return tuple(_KERNEL(arrays, scalars, consts, [(B, H, n, D), (B, H, n, dv)], [dtype, dtype],
                         grid=(THREADS * -(-n // TILE), B * H, 1), threads=(THREADS, 1, 1)))


def checked_decode(c, n: int, dtype, op_fn):
    """:func:`decode_rows`, checked once per process against ``op_fn()`` (the op path's dense rows)."""
    return checked_call("kvquant_rows", c, lambda: decode_rows(c, n, dtype), op_fn)
