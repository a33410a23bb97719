"""Tolerances for comparing two float32 runs of the same computation, derived from the run itself.

Two paths that compute the same thing (attention on the codes vs on dense rows, a batch vs each request
alone) sum in different orders, so their K/V rows differ in the last float32 bits; a cache then rounds
those rows to float16 (residual, window and sink rows), and where a row sits on a float16 rounding edge
the two stored rows differ by a whole float16 ulp. How much that moves the logits depends on the model
and the BLAS kernels, not on a fixed number. The bound used here: it is at most what rounding *every*
stored row to float16 moves them (a few rows moved by one ulp vs all rows moved by up to half an ulp),
measured on the same model and tokens with mlx_lm's plain cache -- a float32 quantity ~100x above the
float32 noise, so it does not depend on the last bits either.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class Float16RowsKVCache(KVCache):
    """mlx_lm's plain cache whose stored rows (and the rows attention sees) are rounded to float16."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.float16).astype(keys.dtype),
                                        values.astype(mx.float16).astype(values.dtype))


def _logits(model, cache_cls, tokens, chunks):
    caches, out, i = [cache_cls() for _ in model.layers], [], 0
    for n in chunks:
        out.append(model(mx.array(tokens[i : i + n])[None], cache=caches)[0].astype(mx.float32))
        i += n
    return mx.concatenate(out, axis=0)


def _chunk_end_logits(model, cache_cls, tokens, chunks) -> list:
    a = _logits(model, cache_cls, tokens, chunks)
    return [a[sum(chunks[: k + 1]) - 1] for k in range(len(chunks))]


def float16_rounding_effect(model, tokens, chunks, plain=None) -> list[float]:
    """For each chunk of ``tokens`` fed in ``chunks``: the largest change of its last position's logits
    that rounding every stored row to float16 causes (plain cache vs ``Float16RowsKVCache``). ``plain``:
    the plain cache's chunk-end logits when the caller has them already."""
    plain = _chunk_end_logits(model, KVCache, tokens, chunks) if plain is None else plain
    rounded = _chunk_end_logits(model, Float16RowsKVCache, tokens, chunks)
    return [float(mx.abs(a - b).max()) for a, b in zip(plain, rounded)]


def float16_rounding_effect_on_logprobs(model, tokens, first: int) -> float:
    """The largest change of the next-token log-probabilities at positions ``first - 1`` .. ``len(tokens)
    - 2`` (those that predicted ``tokens[first:]``) that rounding every stored row to float16 causes."""
    n = len(tokens)
    a, b = _logits(model, KVCache, tokens, [n]), _logits(model, Float16RowsKVCache, tokens, [n])
    lp = [x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (a, b)]
    return float(mx.abs(lp[0] - lp[1])[first - 1 : n - 1].max())


def rounding_bounds(model, tokens, chunks, quantized) -> list[float]:
    """Per chunk, how far two paths of a quantizing cache may legitimately differ: the float16 rounding effect,
    or -- since rows that differ in the last bits can also round a few elements to the neighbouring code (a
    whole quantization step) -- what quantizing *every* stored row moves the logits: the largest change of
    ``quantized`` (one path's last-position logits per chunk) from the plain cache's on the same tokens,
    whichever is larger. The plain cache runs once for both."""
    plain = _chunk_end_logits(model, KVCache, tokens, chunks)
    flips = [float(mx.abs(q - p).max()) for q, p in zip(quantized, plain)]
    return [max(f16, flip) for f16, flip in zip(float16_rounding_effect(model, tokens, chunks, plain), flips)]


_ALLOCATED: dict = {}


def allocation_bytes(nbytes: int) -> int:
    """The active memory MLX's allocator charges for one buffer of ``nbytes`` bytes on the default device, measured
    once per size (with the buffer cache off): the bytes themselves on the CPU; on CUDA, MLX 0.32 rounds a buffer up
    to its size classes (powers of two below 16 KB, whole 16 KB pages above), so a cache's ``nbytes`` (the bytes of
    the arrays it holds) sits below the active memory they occupy there."""
    if nbytes not in _ALLOCATED:
        previous = mx.set_cache_limit(0)
        mx.synchronize()
        before = mx.get_active_memory()
        probe = mx.zeros((nbytes,), mx.uint8)
        mx.eval(probe)
        _ALLOCATED[nbytes] = max(nbytes, mx.get_active_memory() - before)
        del probe
        mx.synchronize()
        mx.set_cache_limit(previous)
    return _ALLOCATED[nbytes]


def allocator_slack(arrays) -> int:
    """What the allocator charges for ``arrays`` beyond their ``nbytes`` (0 where it charges the bytes)."""
    return sum(allocation_bytes(a.nbytes) - a.nbytes for a in arrays if a is not None)

