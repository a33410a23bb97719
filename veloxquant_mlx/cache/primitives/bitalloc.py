"""Waterfill's per-channel key widths by reverse water-filling (channel ``c`` at ``b_c`` bits over range ``r_c`` adds
logit error ``~ E[q_c^2] r_c^2 4^-b_c / 12``: each further bit goes where that is largest), and RoPE channel pairs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MAX_BITS = 8
_TINY = 1e-30


def allocate_bits(sensitivity, total: int, max_bits: int = MAX_BITS) -> np.ndarray:
    """Int widths ``[G, D]`` in ``0..max_bits``, each row summing to ``total``: every bit goes to the channel
    whose ``log2(sensitivity) - 2 * (bits it has)`` is largest."""
    s = np.asarray(sensitivity, dtype=np.float64)
    G, D = s.shape
    if not 0 <= total <= max_bits * D:
        raise ValueError(f"total={total} bits cannot be spread over {D} channels of at most {max_bits} bits")
    gain = np.log2(np.maximum(s, _TINY))[:, :, None] - 2.0 * np.arange(max_bits)[None, None, :]
    flat = gain.reshape(G, D * max_bits)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :total]  # ties: lower channel / bit first
    widths = np.zeros(G * D, dtype=np.int64)
    np.add.at(widths, (np.arange(G)[:, None] * D + order // max_bits).reshape(-1), 1)
    return widths.reshape(G, D)


def rope_pair_mean(w: mx.array, spec: dict) -> mx.array:
    """Average ``w [H, D]`` over the channel pairs RoPE rotates together (its first ``dims`` channels:
    adjacent pairs when ``traditional``, else channel i with i + dims/2)."""
    dims, H = spec["dims"], w.shape[0]
    head, tail = w[:, :dims], w[:, dims:]
    if spec["traditional"]:
        m = head.reshape(H, dims // 2, 2).mean(axis=-1, keepdims=True)
        head = mx.broadcast_to(m, (H, dims // 2, 2)).reshape(H, dims)
    else:
        m = (head[:, : dims // 2] + head[:, dims // 2 :]) / 2
        head = mx.concatenate([m, m], axis=1)
    return mx.concatenate([head, tail], axis=1) if tail.shape[1] else head
