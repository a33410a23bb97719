"""The one-row drop of an eviction cache that evicts a row every decode step (TOVA, MorphKV): each KV head drops its
lowest-scoring unprotected row, in one launch. The op path takes nine kernels for it (the protected rows' test and
their guard, the argmin, the shifted index, the spare rows' padding, three gathers), on a step bound by the host's
launches on a GPU.

A block takes one (batch row, KV head): it finds the first row of least score among the unprotected ones (protected:
position below ``n_sink`` or at least ``recent_start``; ``mx.argmin``'s choice, ties to the lowest row), then copies
the rows after it down one (keys, values, positions) into buffers of ``rows - 1 + spare`` rows; the spare rows
repeat the last held row (never read). CUDA; on the CPU the same in C++ (``native/drop_row_cpu.cpp``); each checked
once per process against the op path (``checked_encode``).
"""

from __future__ import annotations

import mlx.core as mx

from .. import native
from ._common import checked_encode, kernels_enabled
from ._compile import Kernel

__all__ = ["drop", "supported"]

THREADS = 256

_SOURCE = r"""
  constexpr int NW = THREADS / 32;
  const int bh = VQ_BLOCK_X;
  VQ_SHARED float best_s[NW];
  VQ_SHARED int best_i[NW];
  VQ_SHARED int drop_at;
  float bs = VQ_INF;
  int bi = 0x7fffffff;
  for (int m = VQ_TID; m < n; m += VQ_NTHREADS) {  // threads take rows in order: a thread's first least is its least
    const int p = pos[(size_t)bh * CAP + m];
    const float x = (p < n_sink || p >= recent_start) ? VQ_INF : s[(size_t)bh * n + m];
    if (x < bs || (x == bs && m < bi)) { bs = x; bi = m; }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float os = VQ_SHFL_XOR(bs, o);
    const int oi = VQ_SHFL_XOR(bi, o);
    if (os < bs || (os == bs && oi < bi)) { bs = os; bi = oi; }
  }
  if (VQ_LANE == 0) { best_s[VQ_WARP] = bs; best_i[VQ_WARP] = bi; }
  VQ_SYNC();
  if (VQ_TID == 0) {
    float x = best_s[0];
    int j = best_i[0];
    for (int u = 1; u < NW; ++u) {
      if (best_s[u] < x || (best_s[u] == x && best_i[u] < j)) { x = best_s[u]; j = best_i[u]; }
    }
    drop_at = j < n ? j : 0;  // every row protected (all +inf): the first, as argmin
  }
  VQ_SYNC();
  const int j = drop_at;
  const int rows_out = out_rows;
  for (int i = VQ_TID; i < rows_out * D; i += VQ_NTHREADS) {
    const int r = i / D, c = i % D;
    const int src = min(r + (r >= j ? 1 : 0), n - 1);
    ok[((size_t)bh * rows_out + r) * D + c] = k[((size_t)bh * CAP + src) * D + c];
  }
  for (int i = VQ_TID; i < rows_out * DV; i += VQ_NTHREADS) {
    const int r = i / DV, c = i % DV;
    const int src = min(r + (r >= j ? 1 : 0), n - 1);
    ov[((size_t)bh * rows_out + r) * DV + c] = v[((size_t)bh * CAP + src) * DV + c];
  }
  for (int r = VQ_TID; r < rows_out; r += VQ_NTHREADS) {
    const int src = min(r + (r >= j ? 1 : 0), n - 1);
    opos[(size_t)bh * rows_out + r] = pos[(size_t)bh * CAP + src];
  }
"""

_KERNEL = Kernel("vq_drop_row", ["k", "v", "pos", "s"], ["ok", "ov", "opos"],
                 [("n", "int"), ("CAP", "int"), ("out_rows", "int"), ("n_sink", "int"), ("recent_start", "int")],
                 _SOURCE)
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def supported(keys: mx.array, values: mx.array, positions: mx.array, rows: int) -> bool:
    """On the kernels' backend (CUDA) or the CPU kernels', float rows, int32 positions, at least two rows held."""
    return ((kernels_enabled() or native.available()) and keys.dtype in _DTYPES and values.dtype == keys.dtype
            and positions.dtype == mx.int32 and 2 <= rows <= keys.shape[2])


def _launch(keys, values, positions, scores, rows, spare, n_sink, recent_start):
    B, H, cap, D = keys.shape
    DV, out_rows = values.shape[-1], rows - 1 + spare
    consts = (("D", D), ("DV", DV), ("THREADS", THREADS))
    return _KERNEL([keys, values, positions, scores.astype(mx.float32)], [rows, cap, out_rows, n_sink, recent_start],
                   consts,
                   [(B, H, out_rows, D), (B, H, out_rows, DV), (B, H, out_rows)],
                   [keys.dtype, values.dtype, mx.int32], grid=(THREADS * B * H, 1, 1), threads=(THREADS, 1, 1))


def drop(keys, values, positions, scores, rows: int, spare: int, n_sink: int, recent_start: int, op_fn):
    """(keys, values, positions) with each head's lowest-scoring unprotected row of the first ``rows`` dropped and
    ``spare`` rows after the ``rows - 1`` kept; ``op_fn()`` gives the same from the op path."""
    if native.available():
        return checked_encode("drop_row_cpu", lambda: tuple(native.module().drop_row(
            keys, values, positions, scores, rows, spare, n_sink, recent_start)), op_fn)
    return checked_encode("drop_row", lambda: _launch(keys, values, positions, scores, rows, spare, n_sink,
                                                      recent_start), op_fn)
