"""Uniform per-channel key levels over calibrated ranges (waterfill's keys): the float16 grid, and how a range is
set from the calibration rows -- their min/max, widened at 8 bits (``range_margin``), or at <= 3 bits shrunk to
the squared-error optimum (``fitted_range``)."""

from __future__ import annotations

import mlx.core as mx


def range_margin(bits: int) -> float:
    """The share of each calibrated key range added on both sides before the levels are set: at 8 bits keys beyond
    the first call's range, clamped, are most of the error; below 8 the coarser levels cost more than clamping
    does (docs/RESULTS.md "Quality targets")."""
    return 0.25 if bits >= 8 else 0.0


SHRINKS = tuple(1.0 - 0.05 * i for i in range(13))  # the range fractions ``fitted_range`` tries: 1.0 .. 0.4
FIT_ROWS = 1024  # about this many calibration rows (strided) enter the fit: its cost stays bounded


def fits_ranges(bits: int) -> bool:
    """Whether calibrated key ranges are shrunk to their squared-error optimum (:func:`fitted_range`): at <= 3
    bits the few levels lose more resolution to the outliers than clamping them costs; at 4 bits the clamped
    outliers are keys attention needs (docs/RESULTS.md "Quality targets")."""
    return bits <= 3


def fit_rows(counts, n: int, sinks: int) -> mx.array:
    """[len(counts), 1, n, 1] bool: the rows :func:`fitted_range` looks at, for sequences whose first ``counts[i]``
    rows (positions 0 ..) are stored: every ``ceil(count / FIT_ROWS)``-th past the first ``sinks`` (all rows when
    there are no more; a bounded per-sequence sample, so a batch fits each sequence as a single cache does)."""
    j = mx.arange(n)[None]
    c = mx.array(counts)[:, None]
    first = mx.array([sinks if k > sinks else 0 for k in counts])[:, None]
    stride = mx.array([max(1, -(-k // FIT_ROWS)) for k in counts])[:, None]
    return ((j >= first) & (j < c) & ((j - first) % stride == 0))[:, None, :, None]


def fitted_range(rows: mx.array, lo: mx.array, hi: mx.array, widths, use: mx.array):
    """``(lo, hi)`` [.., 1, D] shrunk about their midpoint, per row of the batch, head and channel, by the
    fraction in :data:`SHRINKS` whose uniform levels at the channel's width (``widths`` [.., D], broadcast like
    ``key_grid``'s) code the ``use`` rows ([B, 1, n, 1] bool, :func:`fit_rows`) of ``rows`` [B, H, n, D] with the
    least squared error. A 0-bit channel keeps its range (it decodes to the midpoint either way)."""
    levels = (mx.left_shift(1, mx.array(widths).astype(mx.int32)) - 1).astype(mx.float32)[..., None, :]
    weight = use.astype(mx.float32)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best, best_err = mx.array(SHRINKS[0]), mx.array(mx.inf)
    for a in SHRINKS:
        low, step = mid - a * half, 2 * a * half / mx.maximum(levels, 1.0)
        codes = mx.clip(mx.round((rows - low) / mx.where(step > 0, step, 1.0)), 0, levels)
        err = (weight * (rows - low - step * codes) ** 2).sum(axis=2, keepdims=True)
        better = err < best_err
        best, best_err = mx.where(better, a, best), mx.where(better, err, best_err)
    best = mx.where(levels > 0, best, 1.0)
    return mid - best * half, mid + best * half


def key_grid(lo: mx.array, hi: mx.array, widths, margin: float = 0.0):
    """Float16 ``(k_lo, k_step)`` of uniform levels at ``widths`` ([.., D] ints, host or device, broadcast over
    ``lo``/``hi`` [.., 1, D]) over ``[lo, hi]`` widened by ``margin`` times its span on each side; a 0-bit channel
    decodes to the range's midpoint."""
    if margin:
        lo, hi = lo - margin * (hi - lo), hi + margin * (hi - lo)
    levels = (mx.left_shift(1, mx.array(widths).astype(mx.int32)) - 1).astype(mx.float32)[..., None, :]
    zero = levels == 0
    return (mx.where(zero, (lo + hi) / 2, lo).astype(mx.float16),
            mx.where(zero, 0.0, (hi - lo) / mx.maximum(levels, 1.0)).astype(mx.float16))


def calibrated_grid(rows: mx.array, lo: mx.array, hi: mx.array, widths, bits: int, use: mx.array):
    """``key_grid`` of the ranges ``[lo, hi]`` of ``rows`` at a cache's average width ``bits``: fitted at <= 3
    bits (``use``: :func:`fit_rows`), widened at 8."""
    if fits_ranges(bits):
        lo, hi = fitted_range(rows, lo, hi, widths, use)
    return key_grid(lo, hi, widths, range_margin(bits))
