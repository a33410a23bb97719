"""Batched low-rank fitting of small matrices (GEAR's error-feedback residual, arXiv 2403.05527).

``lowrank_factors(r, rank)``: for every matrix of ``r [..., m, n]``, the best rank-``rank``
approximation ``A @ Bt`` (Eckart–Young, from one batched SVD on the CPU stream: MLX's SVD is a CPU
kernel), ``A [..., m, rank]`` = U·diag(σ), ``Bt [..., rank, n]`` = the top right singular vectors.
``energy_rank(r, threshold)`` is the smallest rank whose singular values keep ``threshold`` of
``||r||_F^2``, per matrix (int32 array).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["lowrank_factors", "energy_rank"]


def _svd(r):
    return mx.linalg.svd(r.astype(mx.float32), stream=mx.cpu)


def lowrank_factors(r: mx.array, rank: int):
    """``(A, Bt)`` with ``A @ Bt`` the best rank-``rank`` approximation of each ``r [..., m, n]``."""
    u, s, vt = _svd(r)
    k = min(rank, s.shape[-1])
    return u[..., :k] * s[..., None, :k], vt[..., :k, :]


def energy_rank(r: mx.array, threshold: float) -> mx.array:
    """Smallest rank keeping ``threshold`` of each matrix's squared Frobenius norm."""
    s2 = _svd(r)[1] ** 2
    cum = mx.cumsum(s2, axis=-1) / mx.maximum(s2.sum(axis=-1, keepdims=True), 1e-30)
    return ((cum < threshold).sum(axis=-1) + 1).astype(mx.int32)
