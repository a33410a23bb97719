"""``elementwise``: ``mx.compile(shapeless=True)`` for elementwise functions, safe on empty arrays."""

from __future__ import annotations

import functools

import mlx.core as mx


def elementwise(fn):
    """``fn`` compiled once for any shape (one fused kernel per call). A call with an empty array runs ``fn``'s
    ops uncompiled: MLX 0.32.4's CUDA backend kills the process (SIGFPE) launching a compiled kernel over no
    elements (seen on an H200 with ``bitpack.unpack_bits`` of zero codes)."""
    compiled = mx.compile(fn, shapeless=True)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if any(isinstance(a, mx.array) and a.size == 0 for a in args) else compiled(*args)

    return call
