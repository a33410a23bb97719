"""Nearest-codeword search for product VQ (``primitives.vq.vq_assign``: VecInfer's and A2ATS's codes, their k-means
fits), one launch, no distance matrix.

The op path computes ``|c|^2 - 2 x.c`` for a block of rows against every codeword (a ``[Hc, rows, K]`` float32
temporary, 16 MB a block on a GPU) and takes its ``argmin``; bounding those temporaries takes hundreds of waited
blocks a layer (SmolLM2's 2047-token prompt: ~98K key pieces x 4096 codewords per layer), and even so a GPU's peak
while prefilling varied run to run from 0.8x to 2.8x the plain cache's (docs/RESULTS.md, session 35). Here one
thread holds one row in registers and scans the codebook in shared-memory tiles (every lane reads the same codeword:
a broadcast), keeping the first least distance -- the op path's formula and tie rule, so the codes are the same but
for rounding ties (the dot product summed in another order). Checked once per process against the op path
(``kernels._common.checked_encode``: the fraction of differing codes) and tested in ``tests/test_vq_methods.py`` (on
CUDA). On CUDA (``kernels_enabled``); on Metal opt-in with the decode kernels (``metal_enabled``: parsed here against
a stand-in for Metal, never run on an Apple GPU); elsewhere the op path. H200 (session 36, ``bash scripts/gpu_run.sh
install vqk``): SmolLM2, 2047 tokens in one chunk, vecinfer peaks at 0.38x the plain cache (1.02x on the op path)
in a third of the op path's time; llama-8b x 8 layers, 8192 tokens in chunks of 2048: 0.50x (0.29x) in 0.16x the op
path's time.
"""

from __future__ import annotations

import mlx.core as mx

from ._common import checked_encode
from ._compile import Kernel, on_metal

__all__ = ["nearest", "checked_nearest", "supported"]

THREADS = 256
TILE_FLOATS = 8192  # shared floats per codebook tile (32 KB): TK = TILE_FLOATS // (D + 1) codewords and their norms
METAL_TILE_FLOATS = 7936  # Metal's threadgroup memory is 32 KB in all
MAX_DIM = 64  # a thread's row lives in registers

_SOURCE = r"""
  constexpr int TK = TILE_FLOATS / (D + 1);
  VQ_SHARED float tile[TK * D];
  VQ_SHARED float tsq[TK];
  const int h = VQ_BLOCK_Y;
  const int row = VQ_BLOCK_X * VQ_NTHREADS + VQ_TID;
  const bool live = row < n;
  float xr[D];
#pragma unroll
  for (int d = 0; d < D; ++d) xr[d] = live ? x[((size_t)h * n + row) * D + d] : 0.0f;
  float best = VQ_INF;
  int arg = 0;
  for (int k0 = 0; k0 < K; k0 += TK) {
    const int m = min(TK, K - k0);
    VQ_SYNC();
    for (int i = VQ_TID; i < m * D; i += VQ_NTHREADS) tile[i] = cb[((size_t)h * K + k0) * D + i];
    for (int i = VQ_TID; i < m; i += VQ_NTHREADS) tsq[i] = sq[(size_t)h * K + k0 + i];
    VQ_SYNC();
    for (int j = 0; j < m; ++j) {
      float dot = 0.0f;
#pragma unroll
      for (int d = 0; d < D; ++d) dot = fmaf(xr[d], tile[j * D + d], dot);
      const float dist = fmaf(-2.0f, dot, tsq[j]);
      if (dist < best) { best = dist; arg = k0 + j; }  // strict: the first least, as argmin
    }
  }
  if (live) idx[(size_t)h * n + row] = arg;
"""

_KERNEL = Kernel("vq_nearest", ["x", "cb", "sq"], ["idx"], [("n", "int"), ("K", "int")], _SOURCE)


def supported(d: int) -> bool:
    """Rows of at most ``MAX_DIM`` floats (held in registers), and a tile of at least one codeword."""
    return 1 <= d <= MAX_DIM


def nearest(x: mx.array, cb: mx.array, sq_norms: mx.array) -> mx.array:
    """Index of the nearest codeword, int32 ``[Hc, n]``, for float32 rows ``x [Hc, n, d]``, codebooks
    ``cb [Hc, K, d]`` and their squared norms ``sq_norms [Hc, K]``."""
    Hc, n, d = x.shape
    K = cb.shape[1]
    tile = METAL_TILE_FLOATS if on_metal() else TILE_FLOATS
    return _KERNEL([x, cb, sq_norms], [n, K], (("D", d), ("TILE_FLOATS", tile)), [(Hc, max(n, 1))],
                   [mx.int32], grid=(THREADS * max(1, -(-n // THREADS)), Hc, 1), threads=(THREADS, 1, 1))[0][:, :n]


def checked_nearest(x: mx.array, cb: mx.array, sq_norms: mx.array, op_fn):
    """:func:`nearest`, checked once per process against ``op_fn()`` (the op path's codes): the fraction of rows
    whose code differs must stay below the check's tolerance (a rounding tie now and then; a layout error, most)."""

    def error(got, want):
        return float((got != want).astype(mx.float32).mean())

    return checked_encode("vq_nearest", lambda: nearest(x, cb, sq_norms), op_fn, error)
