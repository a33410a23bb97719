"""``nbytes`` is honest: the MLX memory a method's caches keep alive is what their ``nbytes`` says.

For every mlx_lm-protocol method, caches built by ``KVCacheBuilder.for_model`` on a tiny llama are
filled the way mlx_lm fills them (a 600-token prompt in chunks of 256, then 24 decode steps); then
everything but the caches is dropped and MLX's active memory is compared with the caches' ``nbytes``.
Hidden memory -- an array that is a view into a larger buffer (MLX hands back a slice assignment's
source when it fills the whole target; ``astype`` to the same dtype returns a view), a lazy graph
holding its inputs, a forgotten reference -- shows up as active memory above ``nbytes``. Each method
runs twice (the first run short) and the second run is measured, so process-wide constants (codebooks,
rotations) built once on first use are not counted against it (a cache that counts such constants may
read lower).
MLX's buffer cache is switched off for the test: with it, a new array may be given a larger freed
buffer, and active memory would count that buffer's size. Where the allocator rounds buffers up (MLX's CUDA
backend: size classes), each counted array's rounding is allowed for, measured (``numerics.allocation_bytes``).

The model runs in float32 (the CPU's compute dtype: rows are cast to 16 bits, a copy) and in float16
(a GPU model's: a cast to float16 is then a view of the call's rows, so a few rows stored from a
256-row chunk can keep the chunk alive -- kivi_sink's and skvq's sinks did, 2.2-2.4x their ``nbytes``).
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from contract_table import COMPOSED, CONFIGS, CONTRACT_METHODS, base_method
from numerics import allocator_slack
from tiny_models import VOCAB, tiny_llama
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT, CHUNK, DECODE = 600, 256, 24
TOKENS = [(i * 53 + 7) % VOCAB for i in range(PROMPT + DECODE)]


def _fill(model, method, prompt=PROMPT, decode=DECODE):
    fields = {**CONFIGS, **COMPOSED}[method]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=base_method(method), **fields))
    for a in range(0, prompt, CHUNK):
        mx.eval(model(mx.array(TOKENS[a : min(a + CHUNK, prompt)])[None], cache=caches))
    for t in TOKENS[prompt : prompt + decode]:
        mx.eval(model(mx.array([[t]]), cache=caches))
    return caches


def _held(caches) -> list:
    out = []
    for c in caches:
        held = getattr(c, "held_arrays", None)
        out += held() if held else [a for a in (c.state if isinstance(c.state, (list, tuple)) else []) if a is not None]
    return out


@pytest.fixture(autouse=True)
def _no_buffer_cache():
    previous = mx.set_cache_limit(0)
    yield
    mx.set_cache_limit(previous)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_active_memory_of_the_caches_is_their_nbytes(method, dtype):
    model = tiny_llama(head_dim=32)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    _fill(model, method, 128, 2)  # a short first run: process-wide constants are built here
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    caches = _fill(model, method)
    held = _held(caches)
    mx.eval(held)
    gc.collect()
    mx.synchronize()  # a GPU frees the fill's temporaries when its stream finishes
    grown = mx.get_active_memory() - base
    nbytes = sum(c.nbytes for c in caches) + allocator_slack(held)
    assert grown <= nbytes, f"{method} ({dtype}): {grown} bytes alive for {nbytes} counted ({grown - nbytes} hidden)"
