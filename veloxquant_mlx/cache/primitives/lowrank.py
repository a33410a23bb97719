"""Batched low-rank fits of small matrices (GEAR's residual, arXiv 2403.05527): one CPU SVD (MLX's SVD is
CPU-only) per call."""

from __future__ import annotations

import mlx.core as mx


def _svd(r):
    return mx.linalg.svd(r.astype(mx.float32), stream=mx.cpu)


def lowrank_factors(r: mx.array, rank: int):
    """``(A = U·diag(σ) [..., m, rank], Bt [..., rank, n])``: the best rank-``rank`` approximation of each
    ``r [..., m, n]`` (Eckart–Young)."""
    u, s, vt = _svd(r)
    k = min(rank, s.shape[-1])
    return u[..., :k] * s[..., None, :k], vt[..., :k, :]


def energy_rank(r: mx.array, threshold: float) -> mx.array:
    """Smallest rank keeping ``threshold`` of each matrix's squared Frobenius norm."""
    s2 = _svd(r)[1] ** 2
    cum = mx.cumsum(s2, axis=-1) / mx.maximum(s2.sum(axis=-1, keepdims=True), 1e-30)
    return ((cum < threshold).sum(axis=-1) + 1).astype(mx.int32)
