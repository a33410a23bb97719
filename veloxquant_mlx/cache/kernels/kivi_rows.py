"""Prefill kernel for KIVI's layout: the first ``n`` quantized tokens as dense keys and values in the model's dtype,
one launch, where the op path dequantizes to float32 (keys transposed, then swapped) and casts again -- three
float32 passes over the past per layer and chunk. These are the rows a GPU prefill chunk's fused attention reads.

A block takes 64 tokens of one (batch row, KV head): its threads read the tile's key words channel by channel
(``k_codes [.., D, words]``: a channel's run of words is contiguous), decode them into a shared [64, D] tile and
write it row by row (coalesced); the value rows, already per token, are decoded straight to the output. Same
layouts as ``kernels.kivi`` (b in {2, 4, 8}: codes never straddle words). Tested against the op path
(``tests/test_decode_kernels.py``) and checked once per process at first use (``kernels.checked_call``).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._common import checked_call
from ._compile import Kernel

__all__ = ["decode_rows", "supported"]

TILE = 64  # tokens per block
THREADS = 128

_SOURCE = r"""
  const int tile = VQ_BLOCK_X, bh = VQ_BLOCK_Y;
  const int t0 = tile * TT;
  constexpr int TPW = 32 / KB;   // codes per word
  constexpr int WT = TT / TPW;   // key words per channel in the tile
  constexpr vq_u32 MASK = (1u << KB) - 1u;
  VQ_SHARED float kt[TT][D + 1];
  for (int i = VQ_TID; i < D * WT; i += VQ_NTHREADS) {
    const int c = i / WT, w = i % WT;
    const int t = t0 + w * TPW;
    if (t >= n) continue;
    const size_t row = (size_t)bh * D + c;
    const vq_u32 word = kc[row * CK + t / TPW];
    const size_t gi = row * GK + t / G;
    const float sc = VQ_F(ks[gi]), bi = VQ_F(kb[gi]);
#pragma unroll
    for (int k = 0; k < TPW; ++k) kt[w * TPW + k][c] = (float)((word >> (k * KB)) & MASK) * sc + bi;
  }
  VQ_SYNC();
  const int rows = min(TT, n - t0);
  for (int i = VQ_TID; i < rows * D; i += VQ_NTHREADS) {
    const int r = i / D, c = i % D;
    vq_store(ok + ((size_t)bh * n + t0 + r) * D + c, kt[r][c]);
  }
  for (int i = VQ_TID; i < rows * DV; i += VQ_NTHREADS) {
    const int r = i / DV, c = i % DV;
    const size_t vrow = (size_t)bh * TV + t0 + r;
    const vq_u32 word = vc[vrow * WV + c / TPW];
    const size_t gi = vrow * NG + c / GV;
    vq_store(ov + ((size_t)bh * n + t0 + r) * DV + c,
             (float)((word >> ((c % TPW) * KB)) & MASK) * VQ_F(vsc[gi]) + VQ_F(vbi[gi]));
  }
"""

_KERNEL = Kernel("vq_kivi_rows", ["kc", "ks", "kb", "vc", "vsc", "vbi"], ["ok", "ov"],
                 [("n", "int"), ("CK", "int"), ("GK", "int"), ("TV", "int"), ("NG", "int")], _SOURCE)


@functools.cache
def supported(bits: int, group: int, value_group: int, d: int, dv: int) -> bool:
    """b in {2, 4, 8}, key groups of whole tiles' words (G a multiple of 32/b), value groups of whole words, and
    the shared tile within 48 KB."""
    tpw = 32 // bits if bits in (2, 4, 8) else 0
    return (tpw > 0 and group % tpw == 0 and value_group % tpw == 0 and dv % value_group == 0
            and TILE % tpw == 0 and 4 * TILE * (d + 1) <= 48 * 1024)


def decode_rows(c, n: int, dtype) -> tuple[mx.array, mx.array]:
    """Dense (keys, values) [B, H, n, D] of KIVI cache ``c``'s first ``n`` quantized tokens, in ``dtype``."""
    B, H, D, CK = c.k_codes.shape
    dv = c.res_v.shape[-1]
    consts = (("D", D), ("DV", dv), ("KB", c.qbits), ("G", c.group), ("GV", c.value_group(dv)),
              ("WV", c.v_codes.shape[-1]), ("TT", TILE))
    return tuple(_KERNEL([c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales, c.v_biases],
                         [n, CK, c.k_scales.shape[-1], c.v_codes.shape[2], c.v_scales.shape[-1]], consts,
                         [(B, H, n, D), (B, H, n, dv)], [dtype, dtype],
                         grid=(THREADS * -(-n // TILE), B * H, 1), threads=(THREADS, 1, 1)))


def checked_decode(c, n: int, dtype, op_fn):
    """:func:`decode_rows`, checked once per process against ``op_fn()`` (the op path's dense rows)."""
    return checked_call("kivi_rows", c, lambda: decode_rows(c, n, dtype), op_fn)
