"""Edge cases of the batch forms (KIVI, TurboQuant-RVQ, waterfill, StreamingLLM) against mlx_lm's batch-cache
protocol: ``filter`` with indices out of order, repeated or none, then decoding as each kept single cache;
``extract(i)`` giving a single cache that goes on exactly as the single cache fed the same rows; a cache trimmed
to empty in a merge; a saved and loaded batch decoding on; ``extend`` refusing other settings; and what a batch
holds after ``filter``/``extend`` being what ``nbytes`` counts (nothing of the old batch kept alive)."""

from __future__ import annotations

import copy
import os
import types

import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache import BatchingNotSupported, KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache.kernels import waterfill as wf_kernel
from veloxquant_mlx.cache.options import StreamingLLMOptions, TurboQuantRVQOptions, WaterfillOptions

from batch_helpers import attend_steps_equal_singles

D, H, HQ = 64, 2, 6
CONFIGS = {
    "kivi": lambda **kw: KVCacheConfig(method="kivi", bit_width_inlier=kw.get("bits", 4), head_dim=D),
    "turboquant_rvq": lambda **kw: KVCacheConfig(method="turboquant_rvq", head_dim=D,
                                                 options=TurboQuantRVQOptions(residual_length=32)),
    "waterfill": lambda **kw: KVCacheConfig(method="waterfill", head_dim=D, bit_width_inlier=kw.get("bits", 4),
                                            options=WaterfillOptions(residual_length=16)),
    "streaming_llm": lambda **kw: KVCacheConfig(method="streaming_llm", head_dim=D,
                                                options=StreamingLLMOptions(n_sink=4, window_size=24)),
}
# float32 rows of unit scale: batched and single attention differ only in summation order over <= ~300 keys
# (a few float32 ulps of outputs of magnitude <= ~3); waterfill's float16 key grid moves a code where a row's
# float32 RoPE differs in its last bit (one level of a 4-bit step on one key of hundreds): ~1e-4.
TOL = {"kivi": 1e-5, "turboquant_rvq": 1e-5, "waterfill": 1e-4, "streaming_llm": 1e-5}
METHODS = list(CONFIGS)


def _bind(c):
    if hasattr(c, "bind_attention"):  # waterfill quantizes keys before the layer's RoPE
        c.bind_attention(types.SimpleNamespace(rope=nn.RoPE(D, base=10000.0)))
    return c


def _singles(method, held, **kw):
    """Single caches holding ``held`` random rows each, attended once as the dispatch point does."""
    out = []
    for n in held:
        c = _bind(KVCacheFactory.create(CONFIGS[method](**kw)))
        if n:
            K, V = c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
            c.attend(mx.random.normal((1, HQ, n, D)), K, V, scale=0.125, mask="causal")
        out.append(c)
    return out


def _merge(singles):
    return type(singles[0]).merge([copy.deepcopy(c) for c in singles])


def _steps(batch, singles, method, steps=None):
    """Decode steps, a full chunk, more decode steps (windows flush, rings wrap): each sequence as alone."""
    steps = steps or [(1, None)] * 3 + [(23, None)] + [(1, None)] * 20
    attend_steps_equal_singles(batch, singles, steps, H, HQ, D, TOL[method], 10 * TOL[method])


def _go_on_alike(a, b, method, n_steps=24):
    """Feed single caches ``a`` and ``b`` the same rows (decode steps and a chunk): the same attention."""
    for N in [1] * 3 + [23] + [1] * (n_steps - 4):
        k, v, q = (mx.random.normal((1, h, N, D)) for h in (H, H, HQ))
        outs = []
        for c in (a, b):
            m = c.make_mask(N)
            K, V = c.update_and_fetch(k, v)
            outs.append(c.attend(q, K, V, scale=0.125, mask=m))
        assert a.offset == b.offset
        assert float(mx.abs(outs[0] - outs[1]).max()) < TOL[method]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("keep", [[2, 0, 3], [1, 1], [3, 2, 1, 0]])
def test_filter_out_of_order_and_repeated_decodes_as_each_kept_single(method, keep):
    mx.random.seed(0)
    singles = _singles(method, (70, 130, 5, 0))
    batch = _merge(singles)
    batch.filter(keep)
    assert batch.lens == [singles[i].offset for i in keep] and batch.offset.tolist() == batch.lens
    _steps(batch, [copy.deepcopy(singles[i]) for i in keep], method)


@pytest.mark.parametrize("method", METHODS)
def test_filter_to_none_then_extend_holds_only_the_joiners(method):
    mx.random.seed(1)
    batch = _merge(_singles(method, (70, 5)))
    batch.filter([])
    assert batch.batch_size == 0 and batch.lens == []
    assert sum(getattr(batch, name).nbytes for name in batch.array_fields) == 0  # no sequence's storage left
    joiners = _singles(method, (40, 3))
    batch.extend(_merge(joiners))
    _steps(batch, joiners, method)


@pytest.mark.parametrize("method", METHODS)
def test_extract_goes_on_as_the_single_cache(method):
    """After batched steps, each extracted cache and the single cache fed the same rows attend alike."""
    mx.random.seed(2)
    singles = _singles(method, (70, 130, 5, 0))
    batch = _merge(singles)
    _steps(batch, singles, method, [(1, None)] * 5)
    for i, c in enumerate(singles):
        _go_on_alike(batch.extract(i), c, method)


@pytest.mark.parametrize("method", METHODS)
def test_merge_with_a_cache_trimmed_to_empty(method):
    mx.random.seed(3)
    singles = _singles(method, (3, 70))
    assert singles[0].trim(3) == 3 and singles[0].offset == 0
    batch = _merge(singles)
    assert batch.lens == [0, 70]
    _steps(batch, singles, method)


@pytest.mark.parametrize("method", METHODS)
def test_saved_and_loaded_batch_decodes_on(method, tmp_path):
    mx.random.seed(4)
    singles = _singles(method, (70, 130, 5, 0))
    batch = _merge(singles)
    _steps(batch, singles, method, [(1, None)] * 3)
    path = os.path.join(tmp_path, "batch.safetensors")
    mlx_cache.save_prompt_cache(path, [batch])
    loaded = mlx_cache.load_prompt_cache(path)[0]
    assert type(loaded) is type(batch) and loaded.lens == batch.lens and loaded.offset.tolist() == batch.lens
    _steps(loaded, singles, method)


@pytest.mark.parametrize("method", ["kivi", "waterfill"])
def test_extend_refuses_other_settings(method):
    mx.random.seed(5)
    batch = _merge(_singles(method, (40, 5)))
    other = _merge(_singles(method, (20,), bits=2))
    with pytest.raises(BatchingNotSupported):
        batch.extend(other)
    assert batch.batch_size == 2  # unchanged


def _reachable_arrays(cache) -> dict:
    """Every MLX array the cache's attributes reach (through tuples, lists, dicts and plain objects), by id;
    the protocol's ``offset``/``left_padding`` (not compressed storage) aside."""
    seen, out = set(), {}

    def walk(o):
        if id(o) in seen or isinstance(o, (type, str, bytes, int, float, mx.Dtype)) or o is None:
            return
        seen.add(id(o))
        if isinstance(o, mx.array):
            out[id(o)] = o
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)
        elif hasattr(o, "__dict__"):
            for k, x in vars(o).items():
                if k != "config":
                    walk(x)

    for k, v in vars(cache).items():
        if k not in ("config", "offset", "left_padding"):
            walk(v)
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("op", ["filter", "extend"])
def test_after_filter_or_extend_nbytes_counts_all_that_is_held(method, op):
    """What the batch keeps alive is what ``nbytes`` counts: a departed batch's arrays (waterfill's decode
    kernel tables, built per sequence and head for the old batch) are not kept alive."""
    mx.random.seed(6)
    singles = _singles(method, (400, 130, 5))
    batch = _merge(singles)
    _steps(batch, singles, method, [(1, None)] * 3)
    if method == "waterfill":
        wf_kernel.cache_constants(batch)  # what a CUDA decode step builds and keeps (counted while current)
    if op == "filter":
        batch.filter([2])
    else:
        batch.extend(_merge(_singles(method, (20,))))
    held = _reachable_arrays(batch)
    assert sum(a.nbytes for a in held.values()) == batch.nbytes, sorted(a.shape for a in held.values())
