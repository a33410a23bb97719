"""Non-uniform per-row levels (1-D Lloyd) and the dense-and-sparse outlier split of KVQuant (arXiv
2401.18079), and token saliency for the mixed-precision (per-token width) quantizers.
"""

from __future__ import annotations

import mlx.core as mx


def fit_levels(u: mx.array, bits: int, iters: int) -> mx.array:
    """Sorted float32 levels ``[..., 2**bits]`` per row of ``u [..., T]`` (normalized to [0, 1]): ``iters``
    rounds of 1-D Lloyd from the row's quantiles (a level with no samples keeps its place), all rows at once. On the
    row sorted once, a cell is a run of it: its count from the boundaries (a [..., L-1, T] bool compare) and its sum
    from prefix sums, so no [..., T, L] float32 array is made (on a GPU, eight rounds of those for every layer of a
    prompt were all queued at once: 2-3x the plain cache's prefill peak)."""
    L = 1 << bits
    srt = mx.sort(u.astype(mx.float32), axis=-1)
    T = srt.shape[-1]
    pos = mx.minimum(((mx.arange(L, dtype=mx.float32) + 0.5) / L * T).astype(mx.int32), T - 1)
    lv = mx.take(srt, pos, axis=-1)  # row quantiles
    mid = srt[..., T // 2 : T // 2 + 1]  # prefix sums of the row less its median: smaller sums, less round-off
    prefix = mx.concatenate([mx.zeros_like(mid), mx.cumsum(srt - mid, axis=-1)], axis=-1)
    last = mx.full(srt.shape[:-1] + (1,), T, dtype=mx.int32)
    for _ in range(iters):
        bnd = 0.5 * (lv[..., 1:] + lv[..., :-1])  # entry u is in cell #(bnd < u): cell l = sorted run [c_{l-1}, c_l)
        ends = mx.concatenate([(srt[..., None, :] <= bnd[..., None]).sum(axis=-1).astype(mx.int32), last], axis=-1)
        starts = mx.concatenate([mx.zeros_like(last), ends[..., :-1]], axis=-1)
        cnt = (ends - starts).astype(mx.float32)
        total = mx.take_along_axis(prefix, ends, axis=-1) - mx.take_along_axis(prefix, starts, axis=-1)
        lv = mx.sort(mx.where(cnt > 0, mid + total / mx.maximum(cnt, 1.0), lv), axis=-1)
    return lv


def encode_levels(u: mx.array, levels: mx.array) -> mx.array:
    """Index (uint32) of the nearest of the sorted ``levels [..., L]`` for every entry of ``u [..., T]``."""
    lv = levels.astype(mx.float32)
    bnd = 0.5 * (lv[..., 1:] + lv[..., :-1])  # [..., L-1]
    return (u.astype(mx.float32)[..., None] > bnd[..., None, :]).sum(axis=-1).astype(mx.uint32)


def decode_levels(codes: mx.array, levels: mx.array, dtype=mx.float32) -> mx.array:
    """``levels[..., code]`` for codes ``[..., T]`` against ``levels [..., L]``."""
    return mx.take_along_axis(levels.astype(dtype), codes.astype(mx.int32), axis=-1)


def split_outliers(x: mx.array, k: int):
    """``(idx [..., k] uint16/32, vals [..., k] float16, x_dense)``: the k largest |x| of every row of
    ``x [..., n]`` and x with them set to the row's inlier midrange (the dense part's range shrinks)."""
    xf = x.astype(mx.float32)
    if k <= 0:
        return None, None, xf
    idx = mx.argpartition(-mx.abs(xf), kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(xf, idx, axis=-1)
    is_out = mx.put_along_axis(mx.zeros(xf.shape, dtype=mx.bool_), idx, mx.array(True), axis=-1)
    hi = mx.where(is_out, -mx.inf, xf).max(axis=-1, keepdims=True)
    lo = mx.where(is_out, mx.inf, xf).min(axis=-1, keepdims=True)
    dense = mx.where(is_out, 0.5 * (hi + lo), xf)
    return idx.astype(mx.uint16 if x.shape[-1] <= 65536 else mx.uint32), vals.astype(mx.float16), dense


def scatter_outliers(x: mx.array, idx: mx.array, vals: mx.array) -> mx.array:
    """Write the stored outliers back into rows of ``x [..., n]``."""
    return mx.put_along_axis(x, idx.astype(mx.int32), vals.astype(x.dtype), axis=-1)


def token_importance(k: mx.array, v: mx.array, kind: str) -> mx.array:
    """A score per token row of ``k``/``v [..., T, D]``: ``"norm"`` ‖k_t‖₂, ``"norm_variance"`` var(k_t) ×
    (1 + var(v_t)) (spread-out, outlier-heavy tokens lose the most to a coarse grid)."""
    kf = k.astype(mx.float32)
    if kind == "norm":
        return mx.sqrt((kf * kf).sum(axis=-1))
    if kind == "norm_variance":
        return mx.var(kf, axis=-1) * (1.0 + mx.var(v.astype(mx.float32), axis=-1))
    raise ValueError(f"unknown importance {kind!r}")


def tier_counts(target: float, lo: int, mid: int, hi: int, n: int) -> tuple[int, int, int]:
    """``(n_hi, n_mid, n_lo)`` with ``(hi*n_hi + mid*n_mid + lo*n_lo) / n`` closest to ``target``
    (|error| <= (hi - lo) / (2n))."""
    if target <= mid:
        n_mid = round((target - lo) * n / (mid - lo)) if mid > lo else 0
        return 0, n_mid, n - n_mid
    n_hi = round((target - mid) * n / (hi - mid)) if hi > mid else 0
    return n_hi, n - n_hi, 0
