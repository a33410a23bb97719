"""A model-wide trim (``contract.trim_caches``) is all or nothing: a later layer that refuses leaves every layer as
it was, where mlx_lm's ``trim_prompt_cache`` trims the earlier layers first; ``check_trim`` agrees with ``trim``."""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache

from veloxquant_mlx.cache import KIVIOptions, KVCacheConfig, KVCacheFactory, SnapKVOptions, StreamingLLMOptions
from veloxquant_mlx.cache.contract import trim_caches

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
