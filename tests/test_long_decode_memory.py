"""Memory does not creep over a long decode: for every eviction method of the registry, a 1-layer tiny
llama prefills 64 tokens past the budget (the configurations of ``test_chunk_invariance.CONFIGS``) and
then decodes 2,000 greedy steps the way a generation loop does (``mx.eval`` of the next token only, no
evaluation of the caches' arrays). MLX's active memory minus the caches' ``nbytes`` is sampled after
every step; its maximum over the last quarter of the steps must not exceed its maximum over the second
quarter. A lazy update that nothing ever reads (StreamingLLM's ``positions`` in a full decode step
was one) stacks a pending graph node and its inputs every step and shows up here as growth; an
eviction cycle (a batch of rows dropped every few steps, accumulated scores settled every 32 calls)
repeats inside each quarter, so its peak is the same in both. Methods with a fixed budget must also
keep ``nbytes`` constant; the others are listed in ``GROWING`` with the reason, and must really grow.
MLX's buffer cache is off, as in test_memory_honesty.py, so active memory counts live arrays only (and
the allocator's rounding of the arrays held is allowed for, as there).
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from contract_table import CONFIGS
from numerics import allocator_slack
from tiny_models import VOCAB, tiny_llama
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, all_methods
from veloxquant_mlx.cache.base import MLX_LM

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EVICTION = [i.name for i in all_methods() if i.family == "eviction" and i.protocol == MLX_LM and i.implemented]
GROWING = {
    "snapkv": "compresses the prompt only, as in the paper; decode rows are appended",
    "rocketkv": "its budget is offset / compression_ratio, a fraction of the context",
}
PROMPT, STEPS = 64, 2000


@pytest.fixture(autouse=True)
def _no_buffer_cache():
    previous = mx.set_cache_limit(0)
    yield
    mx.set_cache_limit(previous)
    gc.collect()


def _held(caches) -> list:
    return [a for c in caches for a in c.held_arrays()]


def test_growing_methods_are_registered_eviction_methods():
    assert set(GROWING) <= set(EVICTION)


@pytest.mark.parametrize("method", EVICTION)
def test_active_memory_is_flat_over_a_long_decode(method):
    # chunkkv's configuration shares kept rows across 2 layers (a leader and its follower): give it both
    model = tiny_llama(n_layers=2 if method == "chunkkv" else 1)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **CONFIGS[method]))
    mx.eval(model(mx.array([[(i * 37 + 11) % VOCAB for i in range(PROMPT)]]), cache=caches))
    y = mx.array([[1]])
    over, held = [], []
    for _ in range(STEPS):
        y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
        mx.eval(y)
        mx.synchronize()  # a GPU frees a step's temporaries when its stream finishes
        nbytes = sum(c.nbytes for c in caches)
        over.append(mx.get_active_memory() - nbytes - allocator_slack(_held(caches)))
        held.append(nbytes)
    q = STEPS // 4
    early, late = max(over[q : 2 * q]), max(over[-q:])
    assert late <= early, f"{method}: {late - early} bytes beyond nbytes appeared over {2 * q} decode steps"
    if method in GROWING:
        assert held[-1] > held[q], f"{method} is listed as growing but holds {held[-1]} bytes throughout"
    else:
        assert held[-1] == held[q], f"{method}: nbytes went from {held[q]} to {held[-1]} with a fixed budget"
