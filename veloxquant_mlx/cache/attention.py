"""Attention helpers for caches that attend themselves, in mlx_lm's layouts: queries [B, Hq, N, D],
keys/values [B, H, M, D], masks None, "causal" (bottom-right aligned) or a boolean/additive array.
"""

from __future__ import annotations

import functools
import os
import threading

import mlx.core as mx

from . import native
from .primitives import blocks
from .primitives.blocks import block_entries, queued_row_blocks


def group_queries(queries: mx.array, n_kv_heads: int) -> mx.array:
    """[B, Hq, N, D] -> [B, H, rep, N, D] so each KV head meets its query heads."""
    B, Hq, N, D = queries.shape
    return queries.reshape(B, n_kv_heads, Hq // n_kv_heads, N, D)


def ungroup(x: mx.array) -> mx.array:
    """[B, H, rep, N, D] -> [B, Hq, N, D]."""
    B, H, R, N, D = x.shape
    return x.reshape(B, H * R, N, D)


def bool_mask(mask, n_queries: int, n_keys: int, n_kv_heads: int | None = None):
    """mlx_lm's mask as a boolean array broadcastable to [B, H, rep, N, M], or None."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": query i sees keys 0 .. M - N + i
        return mx.arange(n_keys - n_queries, n_keys)[:, None] >= mx.arange(n_keys)[None]
    if mask.dtype != mx.bool_:
        # additive mask: -inf (or the dtype's minimum: float16's is -65504) marks hidden keys
        low = float(mx.finfo(mask.dtype).min) / 2 if mx.issubdtype(mask.dtype, mx.floating) else -1e30
        mask = mask > max(-1e30, low)
    if mask.ndim == 4 and n_kv_heads is not None and mask.shape[1] > 1:
        mask = mask.reshape(mask.shape[0], n_kv_heads, mask.shape[1] // n_kv_heads, n_queries, n_keys)
    elif mask.ndim == 4:
        mask = mask[:, :, None]
    return mask


#: a CPU call with at least this many query rows is attended in tiles of query rows (``dense_attention``)
CPU_TILE_MIN_ROWS = 128
#: query rows a CPU tile keeps however many keys it sees (at most 1/8 of the call): a tile of one row over 16K keys
#: made a 1024-row chunk 2.5x MLX's sdpa's time (matrix-vector products re-reading the keys); 32 rows: 1.0x
CPU_TILE_FLOOR_ROWS = 32
#: on a GPU a tile's scores may reach this many times the call's query entries (a larger model's chunk: fewer,
#: larger tiles), between ``block_entries()`` and ``GPU_TILE_MAX_ENTRIES``
GPU_TILE_QUERY_MULTIPLE, GPU_TILE_MAX_ENTRIES = 2, 1 << 24


def query_tile_rows(queries: mx.array, n_rows: int, n_keys: int) -> int:
    """Query rows per tile of ``n_rows`` rows over ``n_keys`` keys: ``block_entries()`` scores (a call that fits is
    one tile); on the CPU, where that is under ``CPU_TILE_FLOOR_ROWS`` rows, the floor or 1/8 of the call if less;
    on a GPU up to ``GPU_TILE_QUERY_MULTIPLE`` times the query entries (H2O at llama-8b's width, 2^22-entry tiles:
    twice the time of 2^24 on an H100)."""
    entries = block_entries()
    on_cpu = blocks.on_cpu()
    if not on_cpu:
        entries = min(GPU_TILE_MAX_ENTRIES, max(entries, GPU_TILE_QUERY_MULTIPLE * queries.size))
    rows = max(1, entries // (queries.shape[0] * queries.shape[1] * n_keys))
    if rows >= CPU_TILE_FLOOR_ROWS or not on_cpu:
        return rows
    return max(rows, min(CPU_TILE_FLOOR_ROWS, -(-n_rows // 8)))


def cpu_attention(queries, keys, values, *, scale, mask, sinks=None):
    """MLX's ``scaled_dot_product_attention`` on the CPU with the softmax of ``native``'s ``softmax_rows`` (vectorized
    exponentials on the pool's threads, written over the scores) where MLX's takes one scalar libm exp per element
    on one thread: the same products (BLAS), the same function. A causal mask is the kernel's own offset (no mask
    array), a boolean one hides its False keys, another dtype's adds to the scores; ``sinks`` join each head's
    normalizer. Float32 throughout, the output in the queries' dtype."""
    B, Hq, N, _ = queries.shape
    H, M = keys.shape[1], keys.shape[2]
    q = (queries.astype(mx.float32) * scale).reshape(B, H, (Hq // H) * N, -1)
    scores = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, Hq, N, M)
    offset = -1
    if isinstance(mask, str):
        if mask != "causal" or M < N:  # (the kernel reads a negative offset as no mask)
            raise ValueError(f"mask: {mask!r} over {N} query rows and {M} keys; allowed: 'causal' with at least as "
                             "many keys as query rows, an array, or None")
        offset = M - N
    elif mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32)
    weights = native.module().softmax_rows(scores, offset, sinks, Hq).reshape(B, H, -1, M)
    out = weights @ values.astype(mx.float32)
    return out.reshape(B, Hq, N, -1).astype(queries.dtype)


def dense_attention(queries, keys, values, *, scale, mask, sinks=None):
    """MLX's ``scaled_dot_product_attention``, in tiles of query rows queued one by one (``queued_row_blocks``) for
    a long call on the CPU and for one with an array mask on a GPU: a causal tile sees the keys up to its last row,
    an array mask is cut to the tile's rows. MLX's CPU attention builds the call's [Hq, N, M] float32 scores and
    probabilities at once (a prompt in one chunk peaked there; the tiles are no slower: ``CPU_TILE_FLOOR_ROWS``); on
    a GPU a causal or no mask takes the fused kernel, an array mask materialized the scores (StreamingLLM's window
    mask, a prompt in one chunk on an H100: 1.6-1.7x the plain cache's peak). Exact: each query row is attended
    alone."""
    N, M = queries.shape[2], keys.shape[2]
    rows = query_tile_rows(queries, N, M)
    if (N < CPU_TILE_MIN_ROWS if blocks.on_cpu() else not isinstance(mask, mx.array) or rows >= N):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    sdpa = cpu_attention if blocks.on_cpu() and native.available() else mx.fast.scaled_dot_product_attention

    def tile(a, b):
        seen, m = query_rows_view(mask, N, M, a, b)
        return sdpa(queries[:, :, a:b], keys[:, :, :seen], values[:, :, :seen], scale=scale, mask=m, sinks=sinks)

    return mx.concatenate(queued_row_blocks(tile, N, rows), axis=2)


def window_attention(queries, keys, values, *, scale, mask, sinks=None, n_sink: int, first: int, window: int,
                     rows: int | None = None):
    """Attention of a call whose query row i sees the first ``n_sink`` keys and the ``window`` keys ending at key
    row ``first + i`` (StreamingLLM's sinks and window, rows in position order; ``mask`` the [.., N, M] array that
    says so): in tiles of ``rows`` query rows (default ``query_tile_rows``, at most the window) queued one by one,
    each over the sinks and its own band of ``window + rows - 1`` keys, with ``mask`` cut to them. The keys a tile
    leaves out are those its mask hides, so the result is ``dense_attention``'s; a prompt chunk's work is then
    N x (sinks + window + rows) scores instead of N x M (llama-8b's shape, an H100, 8192 tokens in chunks of 2048:
    StreamingLLM's prefill 2.35x the plain cache's time over all M keys)."""
    N = queries.shape[2]
    rows = rows or min(max(1, window), query_tile_rows(queries, N, n_sink + 2 * window))

    def tile(a, b):
        lo, hi = max(n_sink, first + a - window + 1), first + b
        if lo <= n_sink:
            k, v, m = keys[:, :, :hi], values[:, :, :hi], mask[..., a:b, :hi]
        else:
            k, v = (mx.concatenate([x[:, :, :n_sink], x[:, :, lo:hi]], axis=2) for x in (keys, values))
            m = mx.concatenate([mask[..., a:b, :n_sink], mask[..., a:b, lo:hi]], axis=-1)
        return mx.fast.scaled_dot_product_attention(queries[:, :, a:b], k, v, scale=scale, mask=m, sinks=sinks)

    if N <= rows:
        return tile(0, N)
    return mx.concatenate(queued_row_blocks(tile, N, rows), axis=2)


def query_rows_view(mask, n_queries: int, n_keys: int, a: int, b: int):
    """``(seen, mask)`` for the query rows [a, b) of a call attended alone: they need the keys [0, seen) only (a
    bottom-right aligned causal mask: keys up to the last row's) and the mask's rows [a, b) (an array mask)."""
    if isinstance(mask, str):
        return n_keys - n_queries + b, mask
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == n_queries:
        return n_keys, mask[..., a:b, :]
    return n_keys, mask


def observed_attention(queries, keys, values, *, scale, mask, observe, held, first_observed: int = 0):
    """Dense attention (queries' dtype) of a call whose query rows from ``first_observed`` on hand their float32
    probabilities [B, H, rep, n, M] to ``observe(weights, first, total)`` (rows [first, first + n) of a call of
    ``total``), in tiles of query rows queued one by one with ``held()`` (the state ``observe`` updates), so no
    [N, M] float32 array of the whole call exists. Rows before ``first_observed`` take ``dense_attention``."""
    N, M = queries.shape[2], keys.shape[2]
    first = min(max(int(first_observed), 0), N - 1)
    outs = []
    if first:
        seen, m = query_rows_view(mask, N, M, 0, first)
        outs.append(dense_attention(queries[:, :, :first], keys[:, :, :seen], values[:, :, :seen], scale=scale,
                                    mask=m))

    def tile(a, b):
        seen, m = query_rows_view(mask, N, M, first + a, first + b)
        out, w = attention_with_weights(queries[:, :, first + a : first + b], keys[:, :, :seen],
                                        values[:, :, :seen], scale=scale, mask=m)
        if seen < M:  # the keys no row of the tile sees: probability 0
            w = mx.pad(w, [(0, 0)] * 4 + [(0, M - seen)])
        observe(w, first + a, N)
        return (out, *held())

    outs += [t[0] for t in queued_row_blocks(tile, N - first, query_tile_rows(queries, N - first, M))]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def attention_logits(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Scaled scores [B, H, rep, N, M] in float32."""
    q = group_queries(queries, keys.shape[1]).astype(mx.float32) * scale
    return q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)


def attention_with_weights(queries, keys, values, *, scale, mask):
    """Dense attention (queries' dtype) and its float32 probabilities [B, H, rep, N, M]. On a GPU one query row (a
    decode step) takes MLX's fused attention for the output, as the plain cache does, and builds only the
    probabilities apart: the values' float32 copy, the product and the casts were a third of an observing cache's
    decode kernels (H2O, where a GPU's step is bound by the host's launches). The CPU keeps one softmax for both (its
    fused attention forms the scores again: H2O's decode 1.35x -> 1.18x the plain cache's at 2048 tokens)."""
    logits = attention_logits(queries, keys, scale)
    m = bool_mask(mask, queries.shape[2], keys.shape[2], keys.shape[1])
    if m is not None:
        logits = mx.where(m, logits, -mx.inf)
    weights = mx.softmax(logits, axis=-1, precise=True)
    if queries.shape[2] == 1 and not blocks.on_cpu() and (mask is None or isinstance(mask, str)
                                                          or mask.dtype == mx.bool_):
        dt = queries.dtype  # (a causal mask of one row hides nothing)
        return mx.fast.scaled_dot_product_attention(queries, keys.astype(dt), values.astype(dt), scale=scale,
                                                    mask=None if isinstance(mask, str) else mask), weights
    out = weights @ values.astype(mx.float32)[:, :, None]
    return ungroup(out).astype(queries.dtype), weights


# MLX's CPU backend runs each stream's ops on one thread, and its ``quantized_matmul`` for KIVI's orientation is a
# scalar loop: a long decode step's contraction split in CPU_STREAMS parts on as many streams runs on as many cores.
CPU_STREAMS = max(1, min(2, os.cpu_count() or 1))
CPU_SPLIT_MIN_ROWS = 2048  # stored rows from which a CPU decode step splits its contraction
# ... and from which a step that decodes its whole past decodes its keys and values on two streams (one layer of
# SmolLM2's shape: GEAR 3.6 -> 2.6 ms at 2048 rows, 2.1 -> 1.8 at 1024, none saved at 512)
CPU_SPLIT_DECODE_MIN_ROWS = 1024
_thread = threading.local()  # MLX 0.32's streams belong to the thread that made them (a server generates in its own)


def _helper_streams(n: int) -> list:
    """``n`` extra CPU streams of the calling thread, made at its first need and kept."""
    streams = _thread.__dict__.setdefault("streams", [])
    while len(streams) < n:
        streams.append(mx.new_stream(mx.cpu))
    return streams


def on_cpu_streams(builders, rows: int | None = None, min_rows: int | None = None) -> list:
    """``[b() for b in builders]``, each built on its own CPU stream (the current one first) so that MLX runs them
    on as many threads; given ``rows``, only when ``cpu_cuts(rows, rows, min_rows)`` splits. On a GPU device, all
    on the current stream."""
    if (mx.default_device().type != mx.DeviceType.cpu or len(builders) == 1
            or (rows is not None and len(cpu_cuts(rows, rows, min_rows)) == 1)):
        return [b() for b in builders]
    out = [builders[0]()]
    for b, s in zip(builders[1:], _helper_streams(len(builders) - 1)):
        with mx.stream(s):
            out.append(b())
    return out


def split_on_cpu_streams(terms):
    """``sum(t() for t in terms)``, each term built on its own CPU stream (``on_cpu_streams``); the terms of a
    split contraction, added on the current stream."""
    return functools.reduce(mx.add, on_cpu_streams(terms))


def cpu_cuts(rows: int, size: int, min_rows: int | None = None) -> list:
    """``[(a, b)]``: ``[0, size)`` in CPU_STREAMS contiguous parts when ``rows`` stored rows (at least ``min_rows``,
    by default CPU_SPLIT_MIN_ROWS) are worth a split on the CPU, else the one range."""
    least = CPU_SPLIT_MIN_ROWS if min_rows is None else min_rows
    parts = CPU_STREAMS if rows >= least and mx.default_device().type == mx.DeviceType.cpu else 1
    cuts = [size * i // parts for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


def cpu_parts(rows: int, size: int, fn, *args) -> list:
    """Terms for ``split_on_cpu_streams``: ``fn`` of the ``(array, axis)`` pairs ``args`` each cut along its axis
    into the ``cpu_cuts(rows, size)`` ranges."""
    cuts = cpu_cuts(rows, size)
    if len(cuts) == 1:
        return [lambda: fn(*(x for x, _ in args))]
    cut = lambda x, axis, a, c: x[(slice(None),) * (axis % x.ndim) + (slice(a, c),)]  # noqa: E731
    return [lambda a=a, c=c: fn(*(cut(x, axis, a, c) for x, axis in args)) for a, c in cuts]


# Tiled attention: a prefill chunk's dense scores [B, Hq, N, M] peak well above mlx_lm's plain cache, so
# ``online_softmax_attention`` visits keys in tiles with a running max, sum and output per query row
# (FlashAttention's online softmax, arXiv 2205.14135): 1/TILE_FRACTION of the scores, <= TILE_MAX_ELEMENTS.
TILE_FRACTION = 16
TILE_MAX_ELEMENTS = 1 << 24
TILE_MIN_ROWS = 64


def tile_rows(query_rows: int, n_keys: int, multiple: int = 1) -> int:
    """Key rows per tile for ``query_rows`` (B * Hq * N) queries over ``n_keys`` keys (at least TILE_MIN_ROWS),
    a multiple of ``multiple`` (quantization groups)."""
    budget = min(query_rows * n_keys // TILE_FRACTION, TILE_MAX_ELEMENTS)
    rows = max(TILE_MIN_ROWS, budget // max(query_rows, 1))
    return max(multiple, rows // multiple * multiple)


def tile_ranges(start: int, stop: int, tile: int):
    return [(a, min(a + tile, stop)) for a in range(start, stop, tile)]


def online_softmax_attention(shape, blocks, n_keys: int, mask, sinks, out_dtype):
    """One softmax over blocks of keys in turn, without an [N, M] score matrix: ``[B, Hq, N, Dv]`` in
    ``out_dtype``. ``shape`` = (B, H, rep, N); ``blocks``: ``(start, stop, scores_fn, values_fn)`` over key
    columns ``start .. stop``, ``scores_fn()`` -> scaled float32 ``[B, H, rep*N, m]``, ``values_fn(p)`` ->
    ``[B, H, rep*N, Dv]``; ``sinks``: [Hq] sink logits or None."""
    B, H, rep, N = shape
    full = None if mask is None or isinstance(mask, str) else bool_mask(mask, N, n_keys, H)
    causal = isinstance(mask, str) and N > 1
    m = l = o = None
    if sinks is not None:  # the sink logit starts the running max with weight exp(0) = 1 and no value
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, rep, 1, 1), (B, H, rep, N, 1))
        l = mx.ones_like(m)
    for start, stop, scores_fn, values_fn in blocks:
        w = stop - start
        s = scores_fn().reshape(B, H, rep, N, w)
        if causal and stop - 1 > n_keys - N:  # query i sees the keys 0 .. n_keys - N + i
            visible = mx.arange(start, stop)[None] <= (n_keys - N + mx.arange(N))[:, None]
            s = mx.where(visible, s, -mx.inf)
        elif full is not None:
            s = mx.where(full[..., start:stop], s, -mx.inf)
        peak = s.max(axis=-1, keepdims=True)
        m_new = peak if m is None else mx.maximum(m, peak)
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows with every key so far hidden
        p = mx.exp(s - m_safe)
        pv = values_fn(p.reshape(B, H, rep * N, w))
        pv = pv.reshape(B, H, rep, N, pv.shape[-1])
        if m is None:
            l, o = p.sum(axis=-1, keepdims=True), pv
        else:
            alpha = mx.exp(m - m_safe)
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            o = pv if o is None else o * alpha + pv
        m = m_new
    return ungroup(o / l).astype(out_dtype)


def dense_blocks(q: mx.array, keys: mx.array, values: mx.array, start: int, tile: int):
    """``online_softmax_attention`` blocks of ``tile`` rows over ``keys``/``values [B, H, m, D]`` (columns
    ``start ..``), for scaled float32 queries ``q [B, H, R, D]``."""
    out = []
    for a, b in tile_ranges(0, keys.shape[2], tile):
        k, v = keys[:, :, a:b], values[:, :, a:b]
        out.append((start + a, start + b,
                    lambda k=k: q @ k.astype(mx.float32).swapaxes(-1, -2),
                    lambda p, v=v: p @ v.astype(mx.float32)))
    return out
