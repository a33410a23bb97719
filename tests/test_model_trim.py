"""A model-wide trim (``contract.trim_caches``) is all or nothing: a later layer that refuses leaves every layer as
it was, where mlx_lm's ``trim_prompt_cache`` trims the earlier layers first; ``check_trim`` agrees with ``trim``
(eviction, every quantizing and cross-layer method, the batch forms) and neither changes a cache it refuses."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache

from contract_table import COMPOSED, CONFIGS, CONTRACT_METHODS, MERGES, base_method
from tiny_models import VOCAB, tiny_llama
from veloxquant_mlx.cache import (KIVIOptions, KVCacheBuilder, KVCacheConfig, KVCacheFactory, SnapKVOptions,
                                  StreamingLLMOptions)
from veloxquant_mlx.cache.base import method_info
from veloxquant_mlx.cache.contract import trim_caches

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the contract table's shared flat fields

H, D = 2, 16


def streaming(window, n_sink=2):
    return KVCacheFactory.create(KVCacheConfig(method="streaming_llm", dtype=mx.float32,
                                               options=StreamingLLMOptions(n_sink=n_sink, window_size=window)))


def fed(cache, n, chunk=None):
    """``cache`` after ``n`` tokens of random rows (one call, or calls of ``chunk`` rows)."""
    mx.random.seed(n)
    kv = mx.random.normal((1, H, n, D))
    step = chunk or n
    for s in range(0, n, step):
        cache.update_and_fetch(kv[:, :, s : s + step], kv[:, :, s : s + step])
    return cache


def test_a_later_layer_that_refuses_leaves_every_layer_unchanged():
    """Layer 0 holds every token; layer 2 (sinks 0, 1 and the window 32..39) evicted 31, so trimming 9 must fail."""
    caches = [fed(KVCache(), 40), fed(streaming(64), 40), fed(streaming(8), 40)]
    before = [(c.offset, c.size()) for c in caches]
    naive = copy.deepcopy(caches)
    with pytest.raises(ValueError, match="evicted"):
        trim_prompt_cache(naive, 9)  # mlx_lm's: the first layers are trimmed before the last refuses
    assert [c.offset for c in naive] == [31, 31, 40]
    with pytest.raises(ValueError, match=r"layer 2: .*evicted.*no layer was trimmed"):
        trim_caches(caches, 9)
    assert [(c.offset, c.size()) for c in caches] == before
    assert trim_caches(caches, 4) == 4  # within every layer's window: all trimmed
    assert [(c.offset, c.size()) for c in caches] == [(36, 36), (36, 36), (36, 6)]
    assert trim_caches([], 3) == 0


def test_a_layer_that_cannot_be_trimmed_is_refused_before_any_trim():
    ring = RotatingKVCache(max_size=8)
    caches = [fed(streaming(64), 20), fed(ring, 20, chunk=1)]
    assert not ring.is_trimmable()
    with pytest.raises(ValueError, match=r"layer 1 \(RotatingKVCache\) cannot be trimmed"):
        trim_caches(caches, 2)
    assert [c.offset for c in caches] == [20, 20]


@pytest.mark.parametrize("make", [lambda: streaming(6), lambda: KVCacheFactory.create(KVCacheConfig(
    method="snapkv", dtype=mx.float32, options=SnapKVOptions(budget=12, obs_window=4, n_sink=2)))])
def test_check_trim_refuses_exactly_where_trim_does_and_changes_nothing(make):
    """Prefill then decode steps (StreamingLLM's ring wraps): for every n, ``check_trim`` raises iff ``trim`` does."""
    cache = fed(make(), 20)
    for _ in range(9):
        cache.update_and_fetch(*(mx.random.normal((1, H, 1, D)),) * 2)
    for n in range(cache.offset + 2):
        state = copy.deepcopy(cache)
        try:
            cache.check_trim(n)
            refused = None
        except ValueError as e:
            refused = str(e)
        assert cache.offset == state.offset and mx.array_equal(cache.positions, state.positions)
        assert getattr(cache, "ring", None) == getattr(state, "ring", None)
        if refused:
            with pytest.raises(ValueError):
                state.trim(n)
        else:
            assert state.trim(n) == min(n, cache.offset)


def test_evict_and_quantize_refuses_in_check_trim_what_its_eviction_part_refuses():
    """snapkv keeping kivi codes holds 12 of 40 tokens, the sinks 0 and 1 among them: a trim of 12 is refused."""
    cache = KVCacheFactory.create(KVCacheConfig(method="snapkv", bit_width_inlier=4, head_dim=D, options=SnapKVOptions(
        budget=12, obs_window=4, n_sink=2, quantize=KIVIOptions(group_size=16))))
    fed(cache, 40)
    assert cache.frozen and cache.stored_rows() == 12
    caches = [fed(KVCache(), 40), cache]
    with pytest.raises(ValueError, match=r"layer 1: .*evicted"):
        trim_caches(caches, 12)
    assert [c.offset for c in caches] == [40, 40] and cache.stored_rows() == 12


def snapshot(cache):
    """What a refused trim must leave as it was: the offset, the bytes held and every state array (bit for bit)."""
    flat = tree_flatten(cache.state)
    return (int(cache.offset) if isinstance(cache.offset, int) else cache.offset.tolist(), cache.nbytes,
            [(k, v.dtype, v.shape, np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v).tobytes())
             if isinstance(v, mx.array) else (k, v) for k, v in flat])


def refusal(call):
    """The ``ValueError`` text ``call()`` raised, else None."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def check_agrees_with_trim(caches, i, ns):
    """For every ``n`` of ``ns``: ``caches[i].check_trim(n)`` raises iff ``trim(n)`` (on a copy of the whole list:
    cross-layer caches share state) raises, with the same text; neither changes the cache when it refuses."""
    for n in ns:
        before = snapshot(caches[i])
        checked = refusal(lambda: caches[i].check_trim(n))
        assert snapshot(caches[i]) == before, n
        twin = copy.deepcopy(caches)  # (a copy holds no decode-kernel counters: compared with itself)
        twin_before = snapshot(twin[i])
        trimmed = refusal(lambda: twin[i].trim(n))
        assert checked == trimmed, (type(caches[i]).__name__, i, n)
        if trimmed is not None:
            assert snapshot(twin[i]) == twin_before, n


QUANTIZED = [m for m in CONTRACT_METHODS if m in COMPOSED or method_info(m).family in ("quantization", "cross_layer")]


@pytest.mark.parametrize("method", QUANTIZED)
def test_check_trim_refuses_exactly_where_trim_does_for_every_quantizing_method(method):
    """A 100-token prompt (compressed groups) and 3 decode steps on a 4-layer tiny llama; n = 1, the residual,
    one past it (a cut into a group), the residual plus 16 or 32 (a group), 50, the offset."""
    m = tiny_llama(head_dim=32, n_layers=4)
    caches = KVCacheBuilder.for_model(m, KVCacheConfig(method=base_method(method), **{**CONFIGS, **COMPOSED}[method]))
    mx.eval(m(mx.array([[(i * 29 + 5) % VOCAB for i in range(100)]]), cache=caches))
    for t in (3, 17, 42):
        mx.eval(m(mx.array([[t]]), cache=caches))
    for i, c in enumerate(caches):
        r = getattr(c, "n_res", None) or getattr(getattr(c, "quant", None), "n_res", None) or 5
        check_agrees_with_trim(caches, i, sorted({1, r, r + 1, r + 16, r + 32, 50, c.offset}))


def kivi(group, n):
    return fed(KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=2, dtype=mx.float32,
                                                   options=KIVIOptions(group_size=group))), n)


def test_a_later_kivi_layer_cut_into_a_group_leaves_every_layer_unchanged():
    """40 tokens: groups of 16 hold 32 + 8 residual, groups of 32 hold 32 + 8. Trimming 24 drops a whole 16-group
    from layer 0 but cuts into layer 1's 32-group: mlx_lm trims layer 0 first, ``trim_caches`` trims none."""
    caches = [kivi(16, 40), kivi(32, 40)]
    before = [snapshot(c) for c in caches]
    naive = copy.deepcopy(caches)
    with pytest.raises(ValueError, match="cut into a quantized group"):
        trim_prompt_cache(naive, 24)
    assert [c.offset for c in naive] == [16, 40]
    with pytest.raises(ValueError, match=r"layer 1: .*cut into a quantized group.*no layer was trimmed"):
        trim_caches(caches, 24)
    assert [snapshot(c) for c in caches] == before
    assert trim_caches(caches, 8) == 8 and [c.offset for c in caches] == [32, 32]


@pytest.mark.parametrize("method", sorted(MERGES))
def test_a_batch_form_refuses_in_check_trim_what_its_trim_refuses(method):
    """Two sequences of 30 and 37 tokens merged (``RaggedBatchCache.trim`` runs the check first)."""
    singles = [fed(KVCacheFactory.create(KVCacheConfig(method=method, dtype=mx.float32, **CONFIGS[method])), n)
               for n in (30, 37)]
    batch = type(singles[0]).merge(singles)
    check_agrees_with_trim([batch], 0, [0, 1, 2, 5, 6, 14, 15, 30, 31])
