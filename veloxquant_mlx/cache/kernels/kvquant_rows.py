"""Prefill kernels for KVQuant's layout (CUDA): a chunk's rows to codes, and the stored past back to the dense rows
the chunk's fused attention reads, one launch each. The op path (``KVQuantKVCache._encode_keys`` / ``_split_values``
and ``_keys_t`` / ``_values``) takes ~60 ops a layer and chunk over float32 copies -- RoPE undone and redone,
``argpartition`` outlier splits, ranges, level compares, bit streams, gathers, scatters, transposes, casts. H100,
llama-8b's layer, a 2048-row chunk over a 6144-row past (session 37): the op path held 572 MB of transients a
layer-chunk against the plain cache's 8 MB, which the layers in flight took to 1.15x the plain cache's whole
prefill peak (docs/RESULTS.md).

``decode_rows``: a block takes ``TT`` tokens of one (batch row, KV head) into a shared ``[TT, D]`` tile: keys are
decoded channel by channel (a channel's codes are one bit stream per group: ``bitpack`` order, codes may straddle
words), each code read as its channel's non-uniform level of the group's fit, times the group's range plus its
minimum; then the outliers of the tile's groups are written into the tile (index ``d*G + t`` of their block), then
every row is RoPE-rotated at its position (the angle ``t * omega`` in float32, as ``mx.fast.rope``; the op path sums
it from per-64-position tables: they differ by the angle's float32 rounding) and written out, sink rows replaced by
their stored rows. Values: each token's codes (KIVI's per-token groups), their outliers (index ``t*Dv + c``), sinks.

``encode``: a block per (G-token group, batch row, KV head), a thread per key channel: the keys' RoPE undone, the
block's outliers split (``vq_split``: the O-th largest |x| found by a bitwise search over its float bits, ties taken
in entry order; written in entry order, where ``argpartition``'s order is arbitrary), each channel's range and its
codes against the current fit's levels, packed; then the values' block split the same way (a thread per token),
their dense rows out to the per-token quantizer (``groupquant.quantize``, as on the op path). A chunk that fits
levels (the first; a refit) stays on the op path. CUDA only (``kernels_enabled``): no Metal build.

Both are tested against the op path (``tests/test_decode_kernels.py``) and checked once per process at first use
(``kernels.checked_call`` / ``checked_encode``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._common import checked_call, checked_encode, relative_error
from ._compile import Kernel

__all__ = ["decode_rows", "encode", "outliers_by_entry", "supported", "encode_supported"]

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


@functools.cache
def _placeholder(dtype) -> mx.array:
    """A one-element array for an input the body skips (no outliers, sinks or RoPE), made once per dtype rather
    than on every call (a decode step's rows come from ``decode_rows``)."""
    a = mx.zeros((1,), dtype=dtype)
    mx.eval(a)
    return a


def _rope_args(c):
    """(kind: 0 none, 1 halves, 2 interleaved pairs; rotated dims; angle per position of each pair) of the RoPE the
    cache ``c`` undoes on its keys."""
    spec = c.rope
    if spec is None:
        return 0, 0, _placeholder(mx.float32)
    return (2 if spec["traditional"] else 1), spec["dims"], c._rope_omega()


def decode_rows(c, n: int, dtype) -> tuple[mx.array, mx.array]:
    """Dense (keys, values) ``[B, H, n, D]`` of KVQuant cache ``c``'s first ``n`` quantized tokens in ``dtype``:
    post-RoPE keys (if a RoPE is bound), outliers and sink rows in place -- the op path's rows."""
    B, H, D, CK = c.k_codes.shape
    dv, G, b = c.res_v.shape[-1], c.group, c.qbits
    gv = c.value_group(dv)
    none, no_idx = _placeholder(mx.float16), _placeholder(mx.uint16)  # arrays the body skips
    ok_ = c._n_out(D) if c.k_oidx is not None else 0
    ov_ = c._n_out(dv) if c.v_oidx is not None else 0
    koi, kov = (c.k_oidx, c.k_oval) if ok_ else (no_idx, none)
    voi, vov = (c.v_oidx, c.v_oval) if ov_ else (no_idx, none)
    ns = c.n_sink if c.n_sink and c.sink_k is not None else 0
    sk, sv = (c.sink_k, c.sink_v) if ns else (none, none)
    rope, rd, om = _rope_args(c)
    consts = (("D", D), ("DV", dv), ("DM", max(D, dv)), ("KB", b), ("G", G), ("WK", (G * b + 31) // 32),
              ("GV", gv), ("WV", (gv * b + 31) // 32), ("OK", ok_), ("OV", ov_), ("NS", ns), ("ROPE", rope),
              ("RD", rd), ("TT", TILE))
    arrays = [c.k_codes, c.k_scales, c.k_biases, c.k_levels, c.k_fit, koi, kov, c.v_codes, c.v_scales, c.v_biases,
              voi, vov, om, sk, sv]
    scalars = [n, CK, c.k_scales.shape[-1], c.k_levels.shape[-1], koi.shape[-1], c.v_codes.shape[2],
               c.v_codes.shape[-1], c.v_scales.shape[-1], voi.shape[-1]]
    return tuple(_KERNEL(arrays, scalars, consts, [(B, H, n, D), (B, H, n, dv)], [dtype, dtype],
                         grid=(THREADS * -(-n // TILE), B * H, 1), threads=(THREADS, 1, 1)))


# The dense-and-sparse split of one block of a shared tile, in a device function: the O largest |x| of the block
# (the O-th largest's bits found by a bitwise search, then those above it and, in entry order, as many equal to it
# as make O) written out in entry order and replaced in the tile by the inliers' midrange. Each thread owns the
# NE entries x(j) = tile[j * SE + own * SO] (j = 0 .. NE-1) of entry index own * NE + j, or none (``owns``
# false): keys own a channel's G tokens, values a token's Dv channels.
_SPLIT_PRELUDE = r"""
template <int O>
__device__ void vq_split(float* tile, bool owns, int own, int NE, int SE, int SO, int* si, int* sj, float* rf,
                         unsigned short* oi, vq_f16* ov) {
  const int nt = blockDim.x, nw = nt / 32, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* x = tile + own * SO;
  const int ne = owns ? NE : 0;
  unsigned int thr = 0;
  for (int bit = 30; bit >= 0; --bit) {
    const unsigned int cand = thr | (1u << bit);
    int cnt = 0;
    for (int j = 0; j < ne; ++j) cnt += __float_as_uint(fabsf(x[j * SE])) >= cand;
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    if (lane == 0) si[warp] = cnt;
    __syncthreads();
    int total = 0;
    for (int w = 0; w < nw; ++w) total += si[w];
    __syncthreads();
    if (total >= O) thr = cand;
  }
  int gt = 0, eq = 0;
  for (int j = 0; j < ne; ++j) {
    const unsigned int u = __float_as_uint(fabsf(x[j * SE]));
    gt += u > thr;
    eq += u == thr;
  }
  si[tid] = gt;
  sj[tid] = eq;
  __syncthreads();
  int gt_all = 0, eq_before = 0;
  for (int k = 0; k < nt; ++k) { gt_all += si[k]; eq_before += k < tid ? sj[k] : 0; }
  const int ties = O - gt_all;  // entries equal to the O-th largest that are taken, the first in entry order
  const int take = gt + min(max(ties - eq_before, 0), eq);
  __syncthreads();
  si[tid] = take;
  __syncthreads();
  int k = 0;
  for (int i = 0; i < tid; ++i) k += si[i];
  int seen = eq_before;
  for (int j = 0; j < ne; ++j) {  // taken entries out, marked in the tile by a NaN
    const float v = x[j * SE];
    const unsigned int u = __float_as_uint(fabsf(v));
    const bool tie = u == thr;
    if (u > thr || (tie && seen < ties)) {
      oi[k] = (unsigned short)(own * NE + j);
      vq_store(ov + k++, v);
      x[j * SE] = __int_as_float(0x7fc00000);
    }
    seen += tie;
  }
  float hi = -VQ_INF, lo = VQ_INF;
  for (int j = 0; j < ne; ++j) {
    const float v = x[j * SE];
    if (v == v) { hi = fmaxf(hi, v); lo = fminf(lo, v); }
  }
  for (int o = 16; o > 0; o >>= 1) {
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
  }
  if (lane == 0) { rf[warp] = hi; rf[nw + warp] = lo; }
  __syncthreads();
  for (int w = 0; w < nw; ++w) { hi = fmaxf(hi, rf[w]); lo = fminf(lo, rf[nw + w]); }
  __syncthreads();
  const float mid = 0.5f * (hi + lo);
  for (int j = 0; j < ne; ++j) if (x[j * SE] != x[j * SE]) x[j * SE] = mid;
  __syncthreads();
}
"""

_ENCODE_SOURCE = r"""
  // one block per (group g of the chunk, bh): its G rows of keys, then of values; a thread per key channel
  const int g = VQ_BLOCK_X, bh = VQ_BLOCK_Y, ng = VQ_GRID_X, c = VQ_TID;
  constexpr int L = 1 << KB;
  VQ_SHARED float xs[G][DM + 1];
  VQ_SHARED int si[D], sj[D];
  VQ_SHARED float rf[D / 16];
  const size_t r0 = (size_t)bh * n + (size_t)g * G;  // the group's first row
  for (int t = 0; t < G; ++t) xs[t][c] = VQ_F(x[(r0 + t) * D + c]);
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
  const size_t ko = ((size_t)bh * ng + g) * (OK > 0 ? OK : 1);
  if (OK > 0) vq_split<OK>(&xs[0][0], true, c, G, DM + 1, 1, si, sj, rf, koi + ko, kov + ko);
  // the channel's range over the group, its codes: the nearest of the fit's levels, packed as a bit stream
  float hi = -VQ_INF, lo = VQ_INF;
  for (int t = 0; t < G; ++t) { hi = fmaxf(hi, xs[t][c]); lo = fminf(lo, xs[t][c]); }
  const size_t row = (size_t)bh * D + c, gi = row * ng + g;
  vq_store(ksc + gi, hi - lo);
  vq_store(kbi + gi, lo);
  const float s32 = VQ_F(ksc[gi]), b32 = VQ_F(kbi[gi]);
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
  for (int w = 0; w < WK; ++w) kc[gi * WK + w] = words[w];
  // values: the block's split (a thread per token row), then the dense rows out for the per-token quantizer
  VQ_SYNC();
  for (int i = c; i < G * DV; i += D) xs[i / DV][i % DV] = VQ_F(v[(r0 + i / DV) * DV + i % DV]);
  VQ_SYNC();
  const size_t vo = ((size_t)bh * ng + g) * (OV > 0 ? OV : 1);
  if (OV > 0) vq_split<OV>(&xs[0][0], c < G, c, DV, 1, DM + 1, si, sj, rf, voi + vo, vov + vo);
  for (int i = c; i < G * DV; i += D) vd[(r0 + i / DV) * DV + i % DV] = xs[i / DV][i % DV];
"""

_ENCODE = Kernel("vq_kvquant_encode", ["x", "v", "lv", "om"], ["kc", "ksc", "kbi", "koi", "kov", "voi", "vov", "vd"],
                 [("n", "int"), ("t0", "int"), ("fit", "int"), ("LC", "int")], _ENCODE_SOURCE,
                 prelude=_SPLIT_PRELUDE)


@functools.cache
def encode_supported(d: int, dv: int, group: int, bits: int) -> bool:
    """A thread per key channel in whole warps and at least one per token of a group, the group's tile within 40 KB
    of shared memory, outlier indices of a block in 16 bits."""
    return (d % 32 == 0 and 32 <= d <= 1024 and group <= d and 4 * group * (max(d, dv) + 1) <= 40 * 1024
            and max(d, dv) * group <= 65536 and bits <= 8)


def encode(c, kb: mx.array, vb: mx.array, t0: int):
    """KVQuant cache ``c``'s codes of the rows ``kb``/``vb [B, H, n, D]`` (n a multiple of G) at positions
    ``t0 ..`` with its current fit's levels: the keys' ``(codes [B, H, D, g * w], scales, biases [B, H, D, g]
    float16, outlier indices, values [B, H, g, o])``, the values' outlier ``(indices, values)`` and their dense rows
    (float32, outliers at the block's midrange) for the per-token quantizer -- the op path's arrays, outliers in
    entry order (the op path's in ``argpartition``'s); ``None`` for outliers of a side with none."""
    B, H, n, D = kb.shape
    dv, G, b = vb.shape[-1], c.group, c.qbits
    g, ok_, ov_, wk = n // G, c._n_out(D), c._n_out(dv), (G * b + 31) // 32
    rope, rd, om = _rope_args(c)
    consts = (("D", D), ("DV", dv), ("DM", max(D, dv)), ("G", G), ("KB", b), ("WK", wk), ("OK", ok_), ("OV", ov_),
              ("ROPE", rope), ("RD", rd))
    out = _ENCODE([kb, vb, c.k_levels, om], [n, t0, len(c.fit_starts) - 1, c.k_levels.shape[-1]], consts,
                  [(B, H, D, g * wk), (B, H, D, g), (B, H, D, g), (B, H, g, max(ok_, 1)), (B, H, g, max(ok_, 1)),
                   (B, H, g, max(ov_, 1)), (B, H, g, max(ov_, 1)), (B, H, n, dv)],
                  [mx.uint32, mx.float16, mx.float16, mx.uint16, mx.float16, mx.uint16, mx.float16, mx.float32],
                  grid=(D * g, B * H, 1), threads=(D, 1, 1))
    keys, values = list(out[:5]), list(out[5:])
    if not ok_:
        keys[3] = keys[4] = None
    if not ov_:
        values[0] = values[1] = None
    return tuple(keys), tuple(values)


def outliers_by_entry(idx, val):
    """Outlier indices and values ``[..., o]`` sorted by entry, the order :func:`encode` writes (the op path's is
    ``argpartition``'s); ``(None, None)`` stays."""
    if idx is None:
        return idx, val
    order = mx.argsort(idx.astype(mx.int32), axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(val, order, axis=-1)


def checked_encode_rows(c, kb: mx.array, vb: mx.array, t0: int, op_fn):
    """:func:`encode`, checked once per process against ``op_fn()`` (the op path's arrays, outliers sorted by entry
    here): the largest of the key codes' fraction differing (a rounding at a level's boundary now and then) and the
    other arrays' relative errors."""

    def error(got, want):
        (gk, gv), (wk, wv) = got, want
        wk, wv = (*wk[:3], *outliers_by_entry(*wk[3:])), (*outliers_by_entry(*wv[:2]), wv[2])
        codes = float((gk[0] != wk[0]).astype(mx.float32).mean())
        pairs = [(a, w) for a, w in zip((*gk[1:], *gv), (*wk[1:], *wv)) if w is not None]
        return max([codes] + [relative_error(a, w) for a, w in pairs])

    return checked_encode("kvquant_encode", lambda: encode(c, kb, vb, t0), op_fn, error)


def checked_decode(c, n: int, dtype, op_fn):
    """:func:`decode_rows`, checked once per process against ``op_fn()`` (the op path's dense rows)."""
    return checked_call("kvquant_rows", c, lambda: decode_rows(c, n, dtype), op_fn)
