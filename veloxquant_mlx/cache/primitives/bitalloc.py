"""Waterfill's per-channel key widths by reverse water-filling (channel ``c`` at ``b_c`` bits over range ``r_c`` adds
logit error ``~ E[q_c^2] r_c^2 4^-b_c / 12``: each further bit goes where that is largest), and RoPE channel pairs."""

from __future__ import annotations

import mlx.core as mx

MAX_BITS = 8
_TINY = 1e-30


def allocate_bits(sensitivity, total: int, max_bits: int = MAX_BITS) -> mx.array:
    """Int32 widths ``[G, D]`` in ``0..max_bits``, each row summing to ``total``: every bit goes to the channel
    whose ``log2(sensitivity) - 2 * (bits it has)`` is largest (ties: lower channel first). No host sync
    (calibration runs inside a prefill's graph): a channel's gains fall with its bits, so the ``total`` largest
    gains of the ``[D, max_bits]`` table per row are its first bits."""
    s = mx.array(sensitivity).astype(mx.float32)
    G, D = s.shape
    if not 0 <= total <= max_bits * D:
        raise ValueError(f"total={total} bits cannot be spread over {D} channels of at most {max_bits} bits")
    if total == 0:
        return mx.zeros((G, D), dtype=mx.int32)
    gain = (mx.log2(mx.maximum(s, _TINY))[:, :, None] - 2.0 * mx.arange(max_bits)).reshape(G, D * max_bits)
    last = mx.sort(gain, axis=1)[:, D * max_bits - total, None]  # the total-th largest gain of each row
    above, tie = gain > last, gain == last
    need = total - above.sum(axis=1, keepdims=True)
    take = above | (tie & (mx.cumsum(tie.astype(mx.int32), axis=1) <= need))
    return take.reshape(G, D, max_bits).sum(axis=2).astype(mx.int32)


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
