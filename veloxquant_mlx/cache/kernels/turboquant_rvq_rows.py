"""Prefill kernels for TurboQuant-RVQ's codes, one launch each where the op path takes dozens of small ops:

* :func:`encode_rows` (and :func:`encode_words` for unit vectors): rotated rows to packed stage-1 (and stage-2)
  code words and float16 norms. The op path (``primitives.rvq.RVQCodebook.encode`` + ``bitpack.pack_bits``) splits
  a 2048-token chunk into ~40 blocks of ~12 ops each (a ``[rows, K1]`` distance matrix, the beam's partial
  selection, gathers) to bound its memory; on the H200 that encoder was most of a prefill 9-13x the plain cache's
  time (docs/RESULTS.md). The block first sums each row's squared sub-vector norms in shared memory (``NORM``: the
  row is scaled to a unit vector, its norm written beside the codes). One thread per sub-vector scans the stage-1
  codebook (in shared memory, read by every lane at once) keeping the ``BEAM`` smallest ``|c1|^2 - 2 x.c1`` in
  registers (as packed keys: see the kernel), then completes each candidate with its nearest cell-scaled stage-2
  centroid, ``(|r|^2 + |c2|^2 - 2 r.c2) sigma^2`` with ``r = (x - c1) / sigma``: the op path's formulas, so the
  codes are the same but for rounding ties (distances within ``2^-(23 - B1)`` relative, or summed in another
  order). The block's codes are packed in shared memory as ``bitpack`` lays them out.
* :func:`rotated_rows`: the first ``n`` stored rows in the rotated domain, ``|x| (c1[i] + sigma[i] c2[j])`` per
  sub-vector, in the model's dtype: what a GPU prefill chunk's fused attention reads (``_rotated_chunk``). One
  thread per sub-vector of a row.

Each is checked once per process against the op path (``kernels.checked_call``) and tested in
``tests/test_decode_kernels.py``.
"""

from __future__ import annotations

import mlx.core as mx

from ..primitives.bitpack import packed_words, unpack_bits
from ._common import checked_call, relative_error
from ._compile import Kernel
from .turboquant_rvq import ROW_HELPERS

__all__ = ["encode_words", "encode_rows", "checked_encode", "rotated_rows", "checked_rows", "supported"]

THREADS = 256
SUBS_PER_BLOCK = 1024  # sub-vectors a block encodes (whole rows: its codes are packed in shared memory)
SMEM_MAX = 48 * 1024
MAX_SUB_DIM = 32  # a thread holds its sub-vector and its residual in registers

_PRELUDE = ROW_HELPERS + r"""
// word w of a row of n codes of b bits (bitpack's layout: code k from bit k * b of the row's bit stream)
__device__ __forceinline__ vq_u32 vq_pack_word(const unsigned char* c, int w, int b, int n) {
  vq_u32 out = 0u;
  const int k1 = min(n - 1, (32 * w + 31) / b);
  for (int k = (32 * w) / b; k <= k1; ++k) {
    const int sh = k * b - 32 * w;  // -b < sh < 32
    const vq_u32 v = c[k];
    out |= sh >= 0 ? v << sh : v >> -sh;
  }
  return out;
}
"""

_SOURCE = r"""
  constexpr int S = D / SD, K1 = 1 << B1, K2 = TWO ? 1 << B2 : 1;
  VQ_SHARED float sc1[K1 * SD];
  VQ_SHARED float sq1[K1];
  VQ_SHARED float ssg[TWO ? K1 : 1];
  VQ_SHARED float sc2[K2 * SD];
  VQ_SHARED float sq2[K2];
  VQ_SHARED unsigned char code1[V * S];
  VQ_SHARED unsigned char code2[TWO ? V * S : 1];
  VQ_SHARED float part[NORM ? V * S : 1];
  for (int u = VQ_TID; u < K1 * SD; u += VQ_NTHREADS) sc1[u] = c1[u];
  for (int u = VQ_TID; u < K1; u += VQ_NTHREADS) {
    sq1[u] = c1q[u];
    if (TWO) ssg[u] = sig[u];
  }
  if (TWO) {
    for (int u = VQ_TID; u < K2 * SD; u += VQ_NTHREADS) sc2[u] = c2[u];
    for (int u = VQ_TID; u < K2; u += VQ_NTHREADS) sq2[u] = c2q[u];
  }
  VQ_SYNC();
  const int v0 = VQ_BLOCK_X * V;
  const int nv = min(V, M - v0);
  if (NORM) {  // each sub-vector's squared norm, summed per row below
    for (int u = VQ_TID; u < nv * S; u += VQ_NTHREADS) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < SD; ++k) {
        const float t = VQ_F(y[((size_t)v0 * S + u) * SD + k]);
        acc = fmaf(t, t, acc);
      }
      part[u] = acc;
    }
    VQ_SYNC();
  }
  for (int u = VQ_TID; u < nv * S; u += VQ_NTHREADS) {
    float x[SD];
#pragma unroll
    for (int k = 0; k < SD; ++k) x[k] = VQ_F(y[((size_t)v0 * S + u) * SD + k]);
    if (NORM) {  // the row's norm; the row scaled to a unit vector (the op path's x / max(|x|, 1e-30))
      const int r = u / S;
      float ss = 0.f;
      for (int t = 0; t < S; ++t) ss += part[r * S + t];
      const float nrm = sqrtf(ss), inv = 1.f / fmaxf(nrm, 1e-30f);
#pragma unroll
      for (int k = 0; k < SD; ++k) x[k] *= inv;
      if (u == r * S) vq_store(on + v0 + r, fminf(nrm, 65504.f));
    }
    // the beam holds keys: a distance's bits in unsigned order (the float order) with the centroid's index in its
    // low B1 bits, so an insertion is a min and a max per place; ties to 2^-(23 - B1) of the distance keep the
    // earlier centroid (the op path's distances, a GPU matmul, may round to 2^-11).
    vq_u32 bk[BEAM];
#pragma unroll
    for (int b = 0; b < BEAM; ++b) bk[b] = 0xffffffffu;
    for (int i = 0; i < K1; ++i) {
      float dot = 0.f;
#pragma unroll
      for (int k = 0; k < SD; ++k) dot = fmaf(x[k], sc1[i * SD + k], dot);
      const vq_u32 u = __float_as_uint(sq1[i] - 2.f * dot);
      vq_u32 key = ((u ^ ((vq_u32)((int)u >> 31) | 0x80000000u)) & ~(vq_u32)(K1 - 1)) | (vq_u32)i;
#pragma unroll
      for (int b = 0; b < BEAM; ++b) {  // insertion into the sorted beam
        const vq_u32 lo = min(bk[b], key);
        key = max(bk[b], key);
        bk[b] = lo;
      }
    }
    int bi[BEAM];
#pragma unroll
    for (int b = 0; b < BEAM; ++b) bi[b] = (int)(bk[b] & (vq_u32)(K1 - 1));
    int best1 = bi[0], best2 = 0;
    if (TWO) {
      float best = VQ_INF;
#pragma unroll
      for (int b = 0; b < BEAM; ++b) {
        const int c = bi[b];
        const float sg = ssg[c];
        float r[SD], rr = 0.f;
#pragma unroll
        for (int k = 0; k < SD; ++k) { r[k] = (x[k] - sc1[c * SD + k]) / sg; rr = fmaf(r[k], r[k], rr); }
#pragma unroll 2
        for (int j = 0; j < K2; ++j) {
          float dot = 0.f;
#pragma unroll
          for (int k = 0; k < SD; ++k) dot = fmaf(r[k], sc2[j * SD + k], dot);
          const float d = (rr + sq2[j] - 2.f * dot) * (sg * sg);
          if (d < best) { best = d; best1 = c; best2 = j; }
        }
      }
    }
    code1[u] = (unsigned char)best1;
    if (TWO) code2[u] = (unsigned char)best2;
  }
  VQ_SYNC();
  for (int u = VQ_TID; u < nv * W1; u += VQ_NTHREADS)
    o1[(size_t)v0 * W1 + u] = vq_pack_word(code1 + (u / W1) * S, u % W1, B1, S);
  if (TWO)
    for (int u = VQ_TID; u < nv * W2; u += VQ_NTHREADS)
      o2[(size_t)v0 * W2 + u] = vq_pack_word(code2 + (u / W2) * S, u % W2, B2, S);
"""

_ROWS_SOURCE = r"""
  constexpr int S = D / SD;
  const size_t g = (size_t)VQ_BLOCK_X * VQ_NTHREADS + VQ_TID;
  if (g >= (size_t)BH * TOT * S) return;
  const int sub = (int)(g % S);
  const size_t row = g / S;  // (batch row, head, output row) of the output
  const size_t bh = row / TOT, r = row % TOT;
  if (r < (size_t)AT || r >= (size_t)(AT + n)) {  // an exact row: copied from ``ex`` (rows before AT, then after)
    const size_t e = bh * (TOT - n) + (r < (size_t)AT ? r : r - n);
#pragma unroll
    for (int k = 0; k < SD; ++k) out[row * D + sub * SD + k] = ex[e * D + sub * SD + k];
    return;
  }
  const size_t t = r - AT;
  const unsigned int i = vq_bits<B1>(w1 + (bh * T1 + t) * W1, sub * B1);
  const float norm = VQ_F(nrm[bh * TN + t]);
  float x[SD];
#pragma unroll
  for (int k = 0; k < SD; ++k) x[k] = c1[i * SD + k];
  if (TWO) {
    const unsigned int j = vq_bits<B2>(w2 + (bh * T2 + t) * W2, sub * B2);
    const float sg = sig[i];
#pragma unroll
    for (int k = 0; k < SD; ++k) x[k] += sg * c2[j * SD + k];
  }
#pragma unroll
  for (int k = 0; k < SD; ++k) vq_store(out + row * D + sub * SD + k, x[k] * norm);
"""

_ENCODE = Kernel("vq_rvq_encode", ["y", "c1", "c1q", "sig", "c2", "c2q"], ["o1", "o2", "on"], [("M", "int")], _SOURCE,
                 prelude=_PRELUDE)


_ROWS = Kernel("vq_rvq_rows", ["w1", "w2", "nrm", "c1", "sig", "c2", "ex"], ["out"],
               [("n", "int"), ("BH", "int"), ("T1", "int"), ("T2", "int"), ("TN", "int"), ("TOT", "int"),
                ("AT", "int")], _ROWS_SOURCE, prelude=_PRELUDE)


def _rows_per_block(n_sub: int) -> int:
    return max(1, SUBS_PER_BLOCK // n_sub)


def _smem(cb) -> int:
    two = cb.c2 is not None
    floats = cb.k1 * (cb.sub_dim + 1 + two) + (cb.k2 * (cb.sub_dim + 1) if two else 1 + cb.sub_dim)
    return 4 * floats + _rows_per_block(cb.n_sub) * cb.n_sub * (1 + two + 4)  # codes, squared norms


def supported(cb, rows: bool = False) -> bool:
    """Codebooks the encode kernel takes (``rows``: the rows kernel): sub-vectors of at most ``MAX_SUB_DIM``
    coordinates, codes of at most 8 bits per stage (``bitpack``'s range); for the encoder also both stages' codebooks
    and a block's codes within 48 KB of shared memory (the rows kernel reads the codebooks from global memory)."""
    return cb.sub_dim <= MAX_SUB_DIM and cb.bits1 <= 8 and cb.bits2 <= 8 and (rows or _smem(cb) <= SMEM_MAX)


def encode_words(cb, y: mx.array) -> tuple[mx.array, mx.array | None]:
    """Packed code words ``(stage 1 [.., W1], stage 2 [.., W2] or None)`` of rotated unit vectors ``y [.., dim]``:
    ``pack_bits`` of :meth:`RVQCodebook.encode`, in one launch."""
    return _encode(cb, y.astype(mx.float32), False)[:2]


def encode_rows(cb, z: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
    """``(stage-1 words, stage-2 words or None, float16 norms [..])`` of rotated rows ``z = Pi x [.., dim]`` (any
    float dtype; the norm is ``|x|``): each row scaled to a unit vector and encoded as :func:`encode_words` does, its
    norm (clamped to float16's range) written beside, in one launch -- where the op path's norm and scaling took ~10
    small launches per keys or values of a chunk."""
    return _encode(cb, z, True)


def _encode(cb, y: mx.array, norm: bool):
    lead = y.shape[:-1]
    y2 = y.reshape(-1, cb.dim)
    m, two = y2.shape[0], cb.c2 is not None
    w1 = packed_words(cb.n_sub, cb.bits1)
    w2 = packed_words(cb.n_sub, cb.bits2) if two else 1
    v = _rows_per_block(cb.n_sub)
    consts = (("D", cb.dim), ("SD", cb.sub_dim), ("B1", cb.bits1), ("B2", cb.bits2), ("TWO", int(two)),
              ("W1", w1), ("W2", w2), ("BEAM", min(4, cb.k1) if two else 1), ("V", v), ("NORM", int(norm)))
    c2, c2q = (cb.c2, cb.c2_sq) if two else (cb.sigma[:1], cb.sigma[:1])
    o1, o2, on = _ENCODE([y2, cb.c1, cb.c1_sq, cb.sigma, c2, c2q], [m], consts,
                         [(max(m, 1), w1), (max(m, 1), w2) if two else (1,), (max(m, 1),) if norm else (1,)],
                         [mx.uint32, mx.uint32, mx.float16], grid=(THREADS * max(1, -(-m // v)), 1, 1),
                         threads=(THREADS, 1, 1))
    return o1[:m].reshape(*lead, w1), (o2[:m].reshape(*lead, w2) if two else None), (on.reshape(lead) if norm else None)


def rotated_rows(cb, planes, norms: mx.array, n: int, dtype, exact: mx.array | None = None, at: int = 0) -> mx.array:
    """``|x| * decode(codes)`` [B, H, n, dim] of the first ``n`` rows of the packed ``planes`` (stage-1 words
    [B, H, T, W1], stage-2 words or None; buffers of any capacity ``T >= n``) and float16 ``norms`` [B, H, T'], in
    ``dtype``: the rotated-domain rows (``RVQCodebook.decode`` times the norms), in one launch. With ``exact`` rows
    [B, H, E, dim] (in ``dtype``): the [B, H, E + n, dim] keys or values a chunk's attention reads, ``exact[:at]``,
    the decoded rows, ``exact[at:]``, written by the same launch (no concatenation copying the decoded past)."""
    p1, p2 = planes
    B, H, t1, w1 = p1.shape
    two = p2 is not None
    w2 = p2.shape[-1] if two else 1
    tot = n + (exact.shape[2] if exact is not None else 0)
    consts = (("D", cb.dim), ("SD", cb.sub_dim), ("B1", cb.bits1), ("B2", cb.bits2), ("TWO", int(two)),
              ("W1", w1), ("W2", w2))
    blocks = max(1, -(-(B * H * tot * cb.n_sub) // THREADS))
    ex = exact if exact is not None else mx.zeros((1,), dtype)
    (out,) = _ROWS([p1, p2 if two else p1, norms, cb.c1, cb.sigma, cb.c2 if two else cb.c1, ex],
                   [n, B * H, t1, p2.shape[2] if two else t1, norms.shape[2], tot, at], consts,
                   [(B, H, tot, cb.dim)], [dtype], grid=(THREADS * blocks, 1, 1), threads=(THREADS, 1, 1))
    return out


def checked_rows(cache, cb, planes, norms, n: int, exact: mx.array, at: int, op_fn):
    """:func:`rotated_rows` with the ``exact`` rows around the decoded ones, checked once per process against
    ``op_fn()`` (relative L2 error)."""
    return checked_call("turboquant_rvq_rows", cache,
                        lambda: rotated_rows(cb, planes, norms, n, exact.dtype, exact, at), op_fn)


def checked_encode(cache, cb, z: mx.array, op_fn, kernel=None, name: str = "turboquant_rvq_encode"):
    """``kernel(cb, z)`` (default :func:`encode_rows`; the CPU's: ``native``), checked once per process against
    ``op_fn()`` (the op path's words and norms): the fraction of differing codes plus the norms' relative error must
    stay below the check's tolerance (a rounding tie changes a code now and then; a layout or selection error changes
    most)."""

    def error(got, want):
        off = relative_error(got[2], want[2])
        for g, w, b in zip(got[:2], want[:2], (cb.bits1, cb.bits2)):
            if w is not None:
                off += float((unpack_bits(g, b, cb.n_sub) != unpack_bits(w, b, cb.n_sub)).astype(mx.float32).mean())
        return off

    return checked_call(name, cache, lambda: (kernel or encode_rows)(cb, z), op_fn, error)

