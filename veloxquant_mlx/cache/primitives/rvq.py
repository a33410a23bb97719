"""Two-stage residual VQ codebooks for sub-vectors of rotated unit vectors (TurboQuant-RVQ's data-oblivious
codebooks): a ``bits``-bit code of an ``s``-dim piece is a stage-1 centroid ``c1[i]`` (``min(bits, 8)`` bits) plus a
cell-scaled stage-2 centroid ``sigma[i] * c2[j]`` (the other bits). Trained by seeded k-means on pieces of random
unit vectors, then ``REFINE_ITERS`` rounds of joint least squares on ``c1``, ``c2`` and ``sigma``; encoded by a beam
search over the ``BEAM`` nearest stage-1 centroids.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .bitpack import packed_words
from .blocks import block_entries, queued_row_blocks
from .codebook import cell_sums, kmeans, smallest_k
from .rotation import seeded_rng

STAGE1_MAX_BITS = 8  # stage-1 codebooks have at most 256 centroids (and codes fit bitpack's 8 bits)
BEAM = 4  # stage-1 candidates completed by stage 2 when encoding
KMEANS_ITERS = 20
REFINE_ITERS = 4  # joint refinement rounds of the two stages
SAMPLES_PER_CENTROID = 48  # training sub-vectors per stage-1 centroid
JOINT_LUT_MAX = 4096  # largest 2^B for which one joint table [S, 2^B] is built per query row
JOINT_LUT_PER_TOKEN = 16  # ... and only when 2^B <= this * the number of quantized tokens
_TAG_SAMPLES = 0x0A7E_0010


def split_bits(bits: int) -> tuple[int, int]:
    """(stage-1 bits, stage-2 bits) of a ``bits``-bit sub-vector code."""
    b1 = min(int(bits), STAGE1_MAX_BITS)
    return b1, int(bits) - b1


def row_bytes(dim: int, sub_dim: int, bits: int) -> int:
    """Stored bytes of one quantized vector: its packed code planes (whole words) and its float16 norm."""
    b1, b2 = split_bits(bits)
    n = dim // sub_dim
    return 4 * (packed_words(n, b1) + (packed_words(n, b2) if b2 else 0)) + 2


class RVQCodebook:
    """A two-stage residual VQ codebook for ``sub_dim``-dimensional pieces of rotated unit vectors
    in R^``dim``: ``c1 [K1, s]``, cell scales ``sigma [K1]`` and ``c2 [K2, s]`` (None if one stage)."""

    def __init__(self, dim: int, sub_dim: int, bits: int, c1: mx.array, sigma: mx.array, c2: mx.array | None):
        self.dim, self.sub_dim, self.bits = int(dim), int(sub_dim), int(bits)
        self.bits1, self.bits2 = split_bits(bits)
        self.n_sub = self.dim // self.sub_dim
        self.c1, self.sigma, self.c2 = c1, sigma, c2
        self.k1, self.k2 = 1 << self.bits1, 1 << self.bits2
        self.c1_sq = mx.sum(c1 * c1, axis=1)
        self.c2_sq = mx.sum(c2 * c2, axis=1) if c2 is not None else None
        # every reconstruction c1[i] + sigma[i] c2[j] at row i*K2 + j, when small enough: one gather
        # decodes a code and one matmul builds a query's joint lookup table
        small = c2 is not None and self.k1 * self.k2 <= JOINT_LUT_MAX
        self.joint = (c1[:, None] + sigma[:, None, None] * c2[None]).reshape(-1, self.sub_dim) if small else None
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.c1, self.sigma, self.c2, self.c1_sq, self.c2_sq, self.joint) if a is not None]

    nbytes = property(lambda self: sum(a.nbytes for a in self.arrays()))

    def to_array(self) -> mx.array:
        """One flat float32 array (an ArtifactStore entry)."""
        return mx.concatenate([a.reshape(-1) for a in (self.c1, self.sigma, self.c2) if a is not None])

    @classmethod
    def from_array(cls, a: mx.array, dim: int, sub_dim: int, bits: int) -> "RVQCodebook":
        b1, b2 = split_bits(bits)
        k1, k2, n1 = 1 << b1, (1 << b2) if b2 else 0, (1 << b1) * sub_dim
        a = mx.array(a).astype(mx.float32).reshape(-1)
        if a.size != n1 + k1 + k2 * sub_dim:
            raise ValueError(f"stored codebook has {a.size} values, expected {n1 + k1 + k2 * sub_dim}")
        c2 = a[n1 + k1 :].reshape(k2, sub_dim) if k2 else None
        return cls(dim, sub_dim, bits, a[:n1].reshape(k1, sub_dim), a[n1 : n1 + k1], c2)

    def encode(self, y: mx.array) -> tuple[mx.array, mx.array | None]:
        """Codes ``(i [.., S], j [.., S] or None)`` (uint8) of rotated unit vectors ``y [.., dim]``."""
        x = y.astype(mx.float32).reshape(-1, self.sub_dim)
        per_row = self.k1 + (min(BEAM, self.k1) * self.k2 if self.c2 is not None else 0)
        # bounded memory for long prefill blocks: blocks of rows queued one by one, not a loop over tokens
        outs = queued_row_blocks(lambda a, b: self._encode_rows(x[a:b]), x.shape[0],
                                 block_entries(x.shape[0] * per_row) // per_row)
        cat = lambda k: (outs[0][k] if len(outs) == 1 else mx.concatenate([o[k] for o in outs])).reshape(  # noqa: E731
            *y.shape[:-1], self.n_sub)
        return cat(0), (cat(1) if self.c2 is not None else None)

    def _encode_rows(self, x: mx.array):
        d1 = self.c1_sq[None] - 2.0 * (x @ self.c1.T)  # [m, K1] (+||x||^2, constant per row)
        if self.c2 is None:
            return mx.argmin(d1, axis=1).astype(mx.uint8), None
        beam = min(BEAM, self.k1)
        cand = smallest_k(d1, beam).astype(mx.uint32) if beam < self.k1 else \
            mx.broadcast_to(mx.arange(self.k1, dtype=mx.uint32)[None], d1.shape)
        sig = self.sigma[cand][..., None]  # [m, beam, 1]
        r = (x[:, None] - self.c1[cand]) / sig  # residual in units of its cell's scale
        d2 = (mx.sum(r * r, axis=-1, keepdims=True) + self.c2_sq - 2.0 * (r @ self.c2.T)) * (sig * sig)
        best = mx.argmin(d2.reshape(x.shape[0], -1), axis=1)
        i = mx.take_along_axis(cand, (best // self.k2)[:, None].astype(mx.uint32), axis=1)[:, 0]
        return i.astype(mx.uint8), (best % self.k2).astype(mx.uint8)

    def decode(self, i: mx.array, j: mx.array | None) -> mx.array:
        """Rotated-domain unit-vector reconstructions ``[.., dim]`` (float32) of codes ``[.., S]``."""
        ii = i.astype(mx.int32)
        if self.joint is not None and j is not None:
            out = mx.take(self.joint, ii * self.k2 + j.astype(mx.int32), axis=0)  # [.., S, s]
        else:
            out = mx.take(self.c1, ii, axis=0)
            if self.c2 is not None and j is not None:
                out = out + mx.take(self.sigma, ii)[..., None] * mx.take(self.c2, j.astype(mx.int32), axis=0)
        return out.reshape(*i.shape[:-1], self.dim)

    def lut(self, qs: mx.array, n_tokens: int):
        """Lookup tables of the query pieces ``qs [.., S, s]``: ``(table, joint)``. A joint table ``[.., S*K]``
        is indexed by ``s*K + i*K2 + j`` (one gather per code instead of three; built when ``K = K1*K2 <=
        JOINT_LUT_MAX`` and not much above the token count), else the pair (stage-1 ``[.., S*K1]``, stage-2
        ``[.., S*K2]``)."""
        lead = qs.shape[:-2]
        if self.c2 is None:
            return (qs @ self.c1.T).reshape(*lead, -1), True  # [.., S*K1]
        if self.joint is not None and self.k1 * self.k2 <= JOINT_LUT_PER_TOKEN * n_tokens:
            return (qs @ self.joint.T).reshape(*lead, -1), True  # [.., S*K1*K2]
        return ((qs @ self.c1.T).reshape(*lead, -1), (qs @ self.c2.T).reshape(*lead, -1)), False


def _train(dim: int, sub_dim: int, bits: int, seed: int) -> RVQCodebook:
    """k-means codebooks (+ joint refinement) on sub-vectors of uniform random unit vectors."""
    b1, b2 = split_bits(bits)
    k1, k2 = 1 << b1, 1 << b2
    n_sub = dim // sub_dim
    n_vec = -(-SAMPLES_PER_CENTROID * max(k1, k2) // n_sub)
    g = seeded_rng(_TAG_SAMPLES, seed).standard_normal((n_vec, dim))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    x = mx.array(g.reshape(-1, sub_dim).astype(np.float32))
    c1, labels = kmeans(x, k1, iters=KMEANS_ITERS, seed=seed)
    if not b2:
        return RVQCodebook(dim, sub_dim, bits, c1, mx.ones((k1,)), None)

    r = x - c1[labels]
    ssum, cnt = cell_sums(labels, mx.sum(r * r, axis=1, keepdims=True), k1)
    sigma = mx.sqrt(ssum[:, 0] / mx.maximum(cnt, 1.0) / sub_dim)
    sigma = mx.where(sigma > 0, sigma, mx.mean(sigma) + 1e-6)
    c2, _ = kmeans(r / sigma[labels][:, None], k2, iters=KMEANS_ITERS, seed=seed + 1)
    cb = RVQCodebook(dim, sub_dim, bits, c1, sigma, c2)
    for _ in range(REFINE_ITERS):
        i, j = cb._encode_rows(x)
        i, j = i.astype(mx.int32), j.astype(mx.int32)
        s_i = sigma[i][:, None]
        # c1 given (c2, sigma): cell means of x - sigma c2
        num, cnt1 = cell_sums(i, x - s_i * c2[j], k1)
        c1 = mx.where(cnt1[:, None] > 0, num / mx.maximum(cnt1, 1.0)[:, None], c1)
        # c2 given (c1, sigma): weighted least squares, weights sigma^2
        r = x - c1[i]
        num, _ = cell_sums(j, r * s_i, k2)
        den, _ = cell_sums(j, s_i * s_i, k2)
        c2 = mx.where(den > 0, num / mx.maximum(den, 1e-20), c2)
        # sigma given (c1, c2): per-cell least squares scale
        num, _ = cell_sums(i, mx.sum(r * c2[j], axis=1, keepdims=True), k1)
        den, _ = cell_sums(i, mx.sum(c2[j] * c2[j], axis=1, keepdims=True), k1)
        new = num[:, 0] / mx.maximum(den[:, 0], 1e-20)
        sigma = mx.where((den[:, 0] > 0) & (mx.abs(new) > 1e-12), new, sigma)
        cb = RVQCodebook(dim, sub_dim, bits, c1, sigma, c2)
    return cb


_CODEBOOKS: dict[tuple, RVQCodebook] = {}


def rvq_codebook(dim: int, sub_dim: int, bits: int, seed: int, store=None) -> RVQCodebook:
    """The codebook for ``(dim, sub_dim, bits, seed)``: cached, else from ``store``, else trained (into ``store``)."""
    key = (int(dim), int(sub_dim), int(bits), int(seed))
    name = f"tqrvq.d{dim}.s{sub_dim}.b{bits}.seed{seed}"
    stored = store.get(name) if store is not None else None
    cb = _CODEBOOKS.get(key) or (RVQCodebook.from_array(stored, *key[:3]) if stored is not None else _train(*key))
    _CODEBOOKS[key] = cb
    if store is not None and stored is None:
        store.put(name, cb.to_array())
    return cb
