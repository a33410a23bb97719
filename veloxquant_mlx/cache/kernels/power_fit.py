"""GEAR's rank-r fit (``primitives.lowrank_fit.power_lowrank``: subspace iteration, classical Gram-Schmidt twice per
column) for every small matrix of a chunk in one launch: one thread block a matrix, held in shared memory.

The op path runs each iteration as batched matrix products and a column-by-column Gram-Schmidt: ~40 small ops an
iteration, ~380 a fit, two fits a layer-chunk. On an H100 (llama-8b's shape, 512 matrices of 32 x 128 at rank 4)
one fit took 4.8 ms, launch-bound, and GEAR's prefill 0.4 s against the plain cache's 0.06 once its SVD was gone
(``scripts/gear_fit_cost.py``, docs/RESULTS.md). Here a block loads its matrix once, and its threads compute the
products from shared memory; the Gram-Schmidt of the short columns (G rows) runs in one warp, with the op path's
order: the coefficients of every earlier column from the same vector, then subtracted, twice; then the division by
max(norm, 1e-30), or 0 for a column in the span of the earlier ones (``lowrank_fit.DEPENDENT_TOL``). Same function
up to float32 rounding (the sums in another order). Checked once per process against the op path
(``kernels._common.checked_encode``: relative L2 error of the fit ``a @ bt``) and tested in
``tests/test_quant_mixed.py`` (on CUDA). On CUDA (``kernels_enabled``); on Metal opt-in with the decode kernels
(``metal_enabled``, ``VELOXQUANT_METAL_KERNELS=1``: the same body behind the macro layer, parsed here against a
stand-in for Metal by ``tests/test_metal_source.py``, never run on an Apple GPU); elsewhere, and for matrices beyond
the backend's shared memory, the op path.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..primitives.lowrank_fit import DEPENDENT_TOL
from ._common import checked_encode, relative_error, shared_limit
from ._compile import Kernel

__all__ = ["fit", "checked_fit", "supported"]

THREADS = 256
MAX_RANK = 32  # the Gram-Schmidt coefficients live in registers

_SOURCE = r"""
  constexpr float TOL = TOL_E8 * 1e-8f;
  VQ_SHARED float xs[M * N];
  VQ_SHARED float ys[M * R];
  VQ_SHARED float qs[M * R];
  VQ_SHARED float zs[N * R];
  const size_t b = VQ_BLOCK_X;
  if ((int)b >= count) return;  // the whole block: no barrier is left waiting
  const int t = VQ_TID;
  for (int i = t; i < M * N; i += VQ_NTHREADS) xs[i] = x[b * (M * N) + i];
  VQ_SYNC();
  for (int o = t; o < M * R; o += VQ_NTHREADS) {  // y = x @ omega
    const int g = o / R, j = o - (o / R) * R;
    float acc = 0.0f;
    for (int d = 0; d < N; ++d) acc = fmaf(xs[g * N + d], om[d * R + j], acc);
    ys[o] = acc;
  }
  VQ_SYNC();
  for (int it = 0; it <= ITERS; ++it) {
    if (VQ_WARP == 0) {  // q = orthonormal columns of y, one column at a time
      for (int j = 0; j < R; ++j) {
        float len = 0.0f;
        for (int g = VQ_LANE; g < M; g += 32) {
          const float v = ys[g * R + j];
          qs[g * R + j] = v;
          len = fmaf(v, v, len);
        }
        for (int s = 16; s > 0; s >>= 1) len += VQ_SHFL_XOR(len, s);
        VQ_SYNCWARP();
        for (int pass = 0; pass < (j > 0 ? 2 : 0); ++pass) {
          float c[R];
          for (int k = 0; k < j; ++k) {
            float p = 0.0f;
            for (int g = VQ_LANE; g < M; g += 32) p = fmaf(qs[g * R + k], qs[g * R + j], p);
            for (int s = 16; s > 0; s >>= 1) p += VQ_SHFL_XOR(p, s);
            c[k] = p;
          }
          for (int g = VQ_LANE; g < M; g += 32) {
            float v = qs[g * R + j];
            for (int k = 0; k < j; ++k) v = fmaf(-c[k], qs[g * R + k], v);
            qs[g * R + j] = v;
          }
          VQ_SYNCWARP();
        }
        float p = 0.0f;
        for (int g = VQ_LANE; g < M; g += 32) p = fmaf(qs[g * R + j], qs[g * R + j], p);
        for (int s = 16; s > 0; s >>= 1) p += VQ_SHFL_XOR(p, s);
        const float inv = sqrtf(p) > TOL * sqrtf(len) ? 1.0f / fmaxf(sqrtf(p), 1e-30f) : 0.0f;  // in the span: 0
        for (int g = VQ_LANE; g < M; g += 32) qs[g * R + j] *= inv;
        VQ_SYNCWARP();
      }
    }
    VQ_SYNC();
    if (it == ITERS) break;
    for (int o = t; o < N * R; o += VQ_NTHREADS) {  // z = x^T q
      const int d = o / R, j = o - (o / R) * R;
      float acc = 0.0f;
      for (int g = 0; g < M; ++g) acc = fmaf(xs[g * N + d], qs[g * R + j], acc);
      zs[o] = acc;
    }
    VQ_SYNC();
    for (int o = t; o < M * R; o += VQ_NTHREADS) {  // y = x z
      const int g = o / R, j = o - (o / R) * R;
      float acc = 0.0f;
      for (int d = 0; d < N; ++d) acc = fmaf(xs[g * N + d], zs[d * R + j], acc);
      ys[o] = acc;
    }
    VQ_SYNC();
  }
  for (int o = t; o < M * R; o += VQ_NTHREADS) a[b * (M * R) + o] = qs[o];
  for (int o = t; o < R * N; o += VQ_NTHREADS) {  // bt = q^T x
    const int j = o / N, d = o - (o / N) * N;
    float acc = 0.0f;
    for (int g = 0; g < M; ++g) acc = fmaf(qs[g * R + j], xs[g * N + d], acc);
    bt[b * (R * N) + o] = acc;
  }
"""

_KERNEL = Kernel("power_fit", ["x", "om"], ["a", "bt"], [("count", "int")], _SOURCE)


def supported(m: int, n: int, rank: int) -> bool:
    """Matrices ``[m, n]`` whose block and its three [m or n, r] panels fit the backend's shared memory (48 KB on
    CUDA, 32 KB on Metal), at a rank of at most ``MAX_RANK``."""
    return 1 <= rank <= MAX_RANK and 4 * (m * n + (2 * m + n) * rank) <= shared_limit()


def fit(x: mx.array, omega: mx.array, iters: int):
    """``(a [..., m, r], bt [..., r, n])`` float32 of every matrix of ``x [..., m, n]`` from the start ``omega
    [n, r]`` after ``iters`` iterations (``power_lowrank``'s)."""
    *lead, m, n = x.shape
    r, count = omega.shape[-1], math.prod(lead)
    blocks = max(count, 1)
    consts = (("M", m), ("N", n), ("R", r), ("ITERS", iters), ("TOL_E8", round(DEPENDENT_TOL * 1e8)))
    a, bt = _KERNEL([x.astype(mx.float32), omega.astype(mx.float32)], [count], consts,
                    [(blocks, m, r), (blocks, r, n)], [mx.float32, mx.float32], grid=(THREADS * blocks, 1, 1),
                    threads=(THREADS, 1, 1))
    return a[:count].reshape(*lead, m, r), bt[:count].reshape(*lead, r, n)


def checked_fit(x: mx.array, omega: mx.array, iters: int, op_fn):
    """:func:`fit`, checked once per process against ``op_fn()`` (the op path's ``(a, bt)``): the relative L2 error
    of the fit ``a @ bt`` (its basis may differ in sign where a column is ill-defined, its product may not)."""

    def error(got, want):
        return relative_error(got[0] @ got[1], want[0] @ want[1])

    return checked_encode("power_fit", lambda: fit(x, omega, iters), op_fn, error)
