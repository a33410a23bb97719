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

from ._common import checked_call, checked_encode, relative_error
from ._compile import Kernel

__all__ = ["decode_rows", "encode_keys", "supported", "encode_supported"]

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


_ENCODE_SOURCE = r"""
  // one block per (group g of the chunk, bh): G tokens x D channels, a thread per channel
  const int g = VQ_BLOCK_X, bh = VQ_BLOCK_Y, ng = VQ_GRID_X, c = VQ_TID;
  constexpr int L = 1 << KB, NW = D / 32;
  VQ_SHARED float xs[G][D + 1];
  VQ_SHARED int si[D], sj[D];
  VQ_SHARED float rf[2 * NW];
  for (int t = 0; t < G; ++t) xs[t][c] = VQ_F(x[((size_t)bh * n + (size_t)g * G + t) * D + c]);
  if (ROPE > 0) {  // back to pre-RoPE: rotation by -t * omega
    VQ_SYNC();
    for (int i = c; i < G * (RD / 2); i += D) {
      const int t = i / (RD / 2), p = i % (RD / 2);
      const int c1 = ROPE == 1 ? p : 2 * p, c2 = ROPE == 1 ? p + RD / 2 : 2 * p + 1;
      float sn, cs;
      sincosf((float)(t0 + g * G + t) * om[p], &sn, &cs);
      const float a = xs[t][c1], b = xs[t][c2];
      xs[t][c1] = a * cs + b * sn;
      xs[t][c2] = b * cs - a * sn;
    }
  }
  VQ_SYNC();
  // the O largest |x| of the block (entry c * G + t): the O-th largest's bits by a bitwise search, then those above
  // it and, in entry order, as many equal to it as make O
  unsigned int thr = 0xffffffffu;
  int take = 0, before = 0;
  if (O > 0) {
    thr = 0;
    for (int bit = 30; bit >= 0; --bit) {
      const unsigned int cand = thr | (1u << bit);
      int cnt = 0;
      for (int t = 0; t < G; ++t) cnt += __float_as_uint(fabsf(xs[t][c])) >= cand;
      for (int o = 16; o > 0; o >>= 1) cnt += VQ_SHFL_XOR(cnt, o);
      if (VQ_LANE == 0) si[VQ_WARP] = cnt;
      VQ_SYNC();
      int total = 0;
      for (int w = 0; w < NW; ++w) total += si[w];
      VQ_SYNC();
      if (total >= O) thr = cand;
    }
    int gt = 0, eq = 0;
    for (int t = 0; t < G; ++t) {
      const unsigned int u = __float_as_uint(fabsf(xs[t][c]));
      gt += u > thr;
      eq += u == thr;
    }
    si[c] = gt;
    sj[c] = eq;
    VQ_SYNC();
    int gt_all = 0, eq_before = 0;
    for (int k = 0; k < D; ++k) { gt_all += si[k]; eq_before += k < c ? sj[k] : 0; }
    const int ties = O - gt_all;  // equal entries taken, the first in entry order
    take = gt + min(max(ties - eq_before, 0), eq);
    VQ_SYNC();
    si[c] = take;
    VQ_SYNC();
    for (int k = 0; k < c; ++k) before += si[k];
    // entries taken: write them out in entry order, marked by a NaN in the tile
    int k = before, e_seen = eq_before;
    for (int t = 0; t < G; ++t) {
      const float v = xs[t][c];
      const unsigned int u = __float_as_uint(fabsf(v));
      const bool tie = u == thr;
      if (u > thr || (tie && e_seen < ties)) {
        const size_t o = ((size_t)bh * ng + g) * O + k++;
        oi[o] = (unsigned short)(c * G + t);
        vq_store(ovl + o, v);
        xs[t][c] = __int_as_float(0x7fc00000);
      }
      e_seen += tie;
    }
    // the inliers' range over the block: outliers become its midrange
    float hi = -VQ_INF, lo = VQ_INF;
    for (int t = 0; t < G; ++t) {
      const float v = xs[t][c];
      if (v == v) { hi = fmaxf(hi, v); lo = fminf(lo, v); }
    }
    for (int o = 16; o > 0; o >>= 1) { hi = fmaxf(hi, VQ_SHFL_XOR(hi, o)); lo = fminf(lo, VQ_SHFL_XOR(lo, o)); }
    if (VQ_LANE == 0) { rf[VQ_WARP] = hi; rf[NW + VQ_WARP] = lo; }
    VQ_SYNC();
    for (int w = 0; w < NW; ++w) { hi = fmaxf(hi, rf[w]); lo = fminf(lo, rf[NW + w]); }
    const float mid = 0.5f * (hi + lo);
    for (int t = 0; t < G; ++t) if (xs[t][c] != xs[t][c]) xs[t][c] = mid;
  }
  // the channel's range over the group, its codes: the nearest of the fit's levels, packed as a bit stream
  float hi = -VQ_INF, lo = VQ_INF;
  for (int t = 0; t < G; ++t) { hi = fmaxf(hi, xs[t][c]); lo = fminf(lo, xs[t][c]); }
  const size_t row = (size_t)bh * D + c, gi = row * ng + g;
  vq_store(osc + gi, hi - lo);
  vq_store(obi + gi, lo);
  const float s32 = VQ_F(osc[gi]), b32 = VQ_F(obi[gi]);
  const float div = s32 > 0.0f ? s32 : 1.0f;
  float bnd[L - 1];
  for (int l = 0; l < L - 1; ++l)
    bnd[l] = 0.5f * (VQ_F(lv[row * LC + fit * L + l + 1]) + VQ_F(lv[row * LC + fit * L + l]));
  vq_u32 words[WK];
  for (int w = 0; w < WK; ++w) words[w] = 0u;
  for (int t = 0; t < G; ++t) {
    const float u = fminf(fmaxf((xs[t][c] - b32) / div, 0.0f), 1.0f);
    vq_u32 code = 0u;
    for (int l = 0; l < L - 1; ++l) code += u > bnd[l];
    const int bit = t * KB, w = bit >> 5, sh = bit & 31;
    words[w] |= code << sh;
    if (sh + KB > 32) words[w + 1] |= code >> (32 - sh);
  }
  for (int w = 0; w < WK; ++w) oc[gi * WK + w] = words[w];
"""

_ENCODE = Kernel("vq_kvquant_encode_keys", ["x", "lv", "om"], ["oc", "osc", "obi", "oi", "ovl"],
                 [("n", "int"), ("t0", "int"), ("fit", "int"), ("LC", "int")], _ENCODE_SOURCE)


@functools.cache
def encode_supported(d: int, group: int, bits: int) -> bool:
    """A thread per channel in whole warps, the group's tile within 40 KB of shared memory, outlier indices of the
    block in 16 bits."""
    return d % 32 == 0 and 32 <= d <= 1024 and 4 * group * (d + 1) <= 40 * 1024 and d * group <= 65536 and bits <= 8


def encode_keys(c, kb: mx.array, t0: int):
    """KVQuant cache ``c``'s key codes of the rows ``kb [B, H, n, D]`` (n a multiple of G) at positions ``t0 ..``
    with its current fit's levels: ``(codes [B, H, D, g * w], scales, biases [B, H, D, g] float16, outlier indices
    [B, H, g, o] uint16, values [B, H, g, o] float16)`` -- what the op path of ``_append_groups`` makes (its outliers
    in entry order; the op path's in ``argpartition``'s)."""
    B, H, n, D = kb.shape
    G, b = c.group, c.qbits
    g, o, wk = n // G, c._n_out(D), (G * b + 31) // 32
    spec = c.rope
    rope = 0 if spec is None else (2 if spec["traditional"] else 1)
    om = c._rope_omega() if rope else mx.zeros((1,), dtype=mx.float32)
    consts = (("D", D), ("G", G), ("KB", b), ("WK", wk), ("O", o), ("ROPE", rope), ("RD", spec["dims"] if rope else 0))
    codes, sc, bi, idx, val = _ENCODE(
        [kb, c.k_levels, om], [n, t0, len(c.fit_starts) - 1, c.k_levels.shape[-1]], consts,
        [(B, H, D, g * wk), (B, H, D, g), (B, H, D, g), (B, H, g, max(o, 1)), (B, H, g, max(o, 1))],
        [mx.uint32, mx.float16, mx.float16, mx.uint16, mx.float16], grid=(D * g, B * H, 1), threads=(D, 1, 1))
    return codes, sc, bi, (idx if o else None), (val if o else None)


def checked_encode_keys(c, kb: mx.array, t0: int, op_fn):
    """:func:`encode_keys`, checked once per process against ``op_fn()`` (the op path's arrays, outliers sorted by
    entry): the largest of the codes' fraction differing (a rounding at a level's boundary now and then) and the
    other arrays' relative errors."""

    def error(got, want):
        got, want = list(got), list(want)
        if want[3] is not None:
            order = mx.argsort(want[3].astype(mx.int32), axis=-1)
            want[3], want[4] = (mx.take_along_axis(a, order, axis=-1) for a in want[3:])
        codes = float((got[0] != want[0]).astype(mx.float32).mean())
        return max([codes] + [relative_error(a, w) for a, w in zip(got[1:], want[1:]) if w is not None])

    return checked_encode("kvquant_encode_keys", lambda: encode_keys(c, kb, t0), op_fn, error)


def checked_decode(c, n: int, dtype, op_fn):
    """:func:`decode_rows`, checked once per process against ``op_fn()`` (the op path's dense rows)."""
    return checked_call("kvquant_rows", c, lambda: decode_rows(c, n, dtype), op_fn)
