"""Decode step of the eviction caches that observe their attention (H2O, TOVA, the voters, KVzip, CaM, NestedKV,
Keyformer): one launch gives the step's output and its float32 probabilities, where the op path builds the
probabilities in five kernels (two casts, the scale, the product, the softmax) beside MLX's fused attention. On a
GPU such a step is bound by the host's launches (SmolLM2 at 8k on an H100: H2O's step took twice the plain cache's).

A block takes one (batch row, KV head) and its ``REP`` query heads: a warp per stored row forms the row's logits
for the group (lanes over channels, a shuffle sum) and writes them to the probabilities' output, the block takes
each query's maximum, the exponentials and their sum, normalises in place, then each warp sums ``p v`` over its rows
(lanes over value channels: coalesced rows) and the warps' sums are joined in shared memory. (A first version with a
thread per (query, value channel) pair looping over every row was latency-bound: llama-8b's shape on an H100, H2O
decoded at 76 tok/s with it against 103 without.) The rows are read from the cache's own buffers ([B, H, capacity, D],
the first ``n`` held): no copy of a slice. Float16 / bfloat16 / float32 in, float32 sums. One block per KV head
suits an eviction budget (hundreds of rows); past ``MAX_WORK`` products a call keeps the op path. On CUDA (measured on
an H100: docs/RESULTS.md, "Eviction decode steps on a GPU"); on Metal opt-in with the decode kernels
(``metal_enabled``: the same body behind the macro layer, four warps a block, parsed here against a stand-in for Metal
in ``tests/test_metal_source.py``, never run on an Apple GPU). Checked once per process at first use against the op
path (``_common.checked_encode``), which stays the reference (``tests/test_observed_decode_kernel.py``).
"""

from __future__ import annotations

import mlx.core as mx

from ._common import checked_encode, kernels_enabled, metal_enabled
from ._compile import Kernel, on_metal

__all__ = ["attend", "supported"]

THREADS, METAL_THREADS = 256, 128  # Metal: 32 KB of threadgroup memory, so four warps' output sums
MAX_GROUP_CHANNELS = 1024  # query heads x channels of a KV head's group: the shared query rows and output sums
MAX_WORK = 1 << 21  # rows x query heads x value channels of one block past which a step keeps the op path

_SOURCE = r"""
  constexpr int NW = THREADS / 32;
  constexpr int DJ = D / 32;  // channels a lane holds of a key row
  const int bh = VQ_BLOCK_X;
  VQ_SHARED float qs[REP][D];
  VQ_SHARED float red[NW][REP];
  VQ_SHARED float stat[REP];
  for (int i = VQ_TID; i < REP * D; i += VQ_NTHREADS) qs[i / D][i % D] = VQ_F(q[(size_t)bh * REP * D + i]) * scale;
  VQ_SYNC();
  VQ_DEV float* wb = w + (size_t)bh * REP * n;
  float part[REP];
#pragma unroll
  for (int r = 0; r < REP; ++r) part[r] = -VQ_INF;
#pragma unroll 2
  for (int m = VQ_WARP; m < n; m += NW) {  // logits: a warp per row
    const size_t row = ((size_t)bh * CAP + m) * D;
    float kr[DJ];
#pragma unroll
    for (int j = 0; j < DJ; ++j) kr[j] = VQ_F(k[row + VQ_LANE + 32 * j]);
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < DJ; ++j) s = fmaf(qs[r][VQ_LANE + 32 * j], kr[j], s);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += VQ_SHFL_XOR(s, o);
      part[r] = fmaxf(part[r], s);
      if (VQ_LANE == 0) wb[r * n + m] = s;
    }
  }
  if (VQ_LANE == 0) {
#pragma unroll
    for (int r = 0; r < REP; ++r) red[VQ_WARP][r] = part[r];
  }
  VQ_SYNC();
  if (VQ_TID < REP) {
    float v = red[0][VQ_TID];
    for (int i = 1; i < NW; ++i) v = fmaxf(v, red[i][VQ_TID]);
    stat[VQ_TID] = v;
  }
  VQ_SYNC();
#pragma unroll
  for (int r = 0; r < REP; ++r) part[r] = 0.f;
  for (int m = VQ_TID; m < n; m += VQ_NTHREADS) {  // exponentials and their sums
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      const float e = VQ_EXP(wb[r * n + m] - stat[r]);
      wb[r * n + m] = e;
      part[r] += e;
    }
  }
#pragma unroll
  for (int r = 0; r < REP; ++r) {
    float s = part[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += VQ_SHFL_XOR(s, o);
    if (VQ_LANE == 0) red[VQ_WARP][r] = s;
  }
  VQ_SYNC();
  if (VQ_TID < REP) {
    float s = 0.f;
    for (int i = 0; i < NW; ++i) s += red[i][VQ_TID];
    stat[VQ_TID] = 1.f / s;
  }
  VQ_SYNC();
  for (int m = VQ_TID; m < n; m += VQ_NTHREADS) {
#pragma unroll
    for (int r = 0; r < REP; ++r) wb[r * n + m] *= stat[r];
  }
  VQ_SYNC();
  // output: warps over rows, lanes over value channels (coalesced rows); the warps' sums joined in shared memory
  constexpr int CJ = (DV + 31) / 32;
  VQ_SHARED float acc_s[NW][REP][DV];
  float acc[REP][CJ];
#pragma unroll
  for (int r = 0; r < REP; ++r) {
#pragma unroll
    for (int j = 0; j < CJ; ++j) acc[r][j] = 0.f;
  }
#pragma unroll 4
  for (int m = VQ_WARP; m < n; m += NW) {
    const size_t row = ((size_t)bh * CAP + m) * DV;
    float vr[CJ];
#pragma unroll
    for (int j = 0; j < CJ; ++j) vr[j] = VQ_LANE + 32 * j < DV ? VQ_F(v[row + VQ_LANE + 32 * j]) : 0.f;
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      const float p = wb[r * n + m];
#pragma unroll
      for (int j = 0; j < CJ; ++j) acc[r][j] = fmaf(p, vr[j], acc[r][j]);
    }
  }
#pragma unroll
  for (int r = 0; r < REP; ++r) {
#pragma unroll
    for (int j = 0; j < CJ; ++j) {
      if (VQ_LANE + 32 * j < DV) acc_s[VQ_WARP][r][VQ_LANE + 32 * j] = acc[r][j];
    }
  }
  VQ_SYNC();
  for (int i = VQ_TID; i < REP * DV; i += VQ_NTHREADS) {
    float s = 0.f;
    for (int u = 0; u < NW; ++u) s += acc_s[u][i / DV][i % DV];
    vq_store(out + (size_t)bh * REP * DV + i, s);
  }
"""

_KERNEL = Kernel("vq_observed_decode", ["q", "k", "v"], ["out", "w"], [("n", "int"), ("scale", "float")], _SOURCE)
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def supported(queries: mx.array, keys: mx.array, values: mx.array, rows: int) -> bool:
    """On the kernels' backend: one query row, a group's query heads x key (value) channels at most
    ``MAX_GROUP_CHANNELS``, key width a multiple of 32, float dtypes, at most ``MAX_WORK`` products a block."""
    B, Hq, N, D = queries.shape
    H, DV = keys.shape[1], values.shape[-1]
    rep = Hq // H if Hq % H == 0 else 0
    return ((kernels_enabled() or metal_enabled()) and N == 1 and 0 < rep and D % 32 == 0
            and rep * max(D, DV) <= MAX_GROUP_CHANNELS and keys.shape[-1] == D and 0 < rows <= keys.shape[2]
            and rows * rep * DV <= MAX_WORK
            and queries.dtype in _DTYPES and keys.dtype in _DTYPES and values.dtype in _DTYPES)


def _launch(queries, keys, values, rows, scale):
    B, Hq, _, D = queries.shape
    H, cap, DV = keys.shape[1], keys.shape[2], values.shape[-1]
    rep = Hq // H
    threads = METAL_THREADS if on_metal() else THREADS
    consts = (("D", D), ("DV", DV), ("REP", rep), ("CAP", cap), ("THREADS", threads))
    out, w = _KERNEL([queries, keys, values], [rows, float(scale)], consts, [(B, Hq, 1, DV), (B, H, rep, 1, rows)],
                     [queries.dtype, mx.float32], grid=(threads * B * H, 1, 1), threads=(threads, 1, 1))
    return out, w


def attend(queries, keys, values, rows: int, scale: float, op_fn):
    """(output [B, Hq, 1, DV] in the queries' dtype, float32 probabilities [B, H, rep, 1, rows]) of one query row
    over the first ``rows`` rows of the buffers ``keys`` / ``values`` [B, H, capacity, D]; ``op_fn()`` gives the
    same from the op path (the first-use check, and the result once the kernel is off)."""
    return checked_encode("observed_decode", lambda: _launch(queries, keys, values, rows, scale), op_fn)
