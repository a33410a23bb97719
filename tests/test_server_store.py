"""The server's prompt-cache stores reuse a kept cache only where the cache's flags make it exact."""

from __future__ import annotations

import pytest

from veloxquant_mlx import server as S


class FakeCache:
    """A per-layer cache that records its trims; flags as class attributes like the real ones."""

    chunk_invariant = True
    exact_trim = True
    trim_exact_or_raises = False
    raises = False

    def __init__(self, offset):
        self.offset = offset
        self.nbytes = 10 * offset

    def is_trimmable(self):
        return True

    def trim(self, n):
        if self.raises:
            raise ValueError("would cut into a quantized group")
        self.offset -= n
        return n

    def __deepcopy__(self, memo):
        new = type(self)(self.offset)
        return new


class InexactTrim(FakeCache):
    exact_trim = False


class RaisingTrim(FakeCache):
    exact_trim = False
    trim_exact_or_raises = True
    raises = True


class SplitDependent(FakeCache):
    chunk_invariant = False


def layers(cls, n, count=2):
    return [cls(n) for _ in range(count)]


@pytest.fixture
def lru():
    return S.SafePromptCache(10, {"reused_tokens": 0})


def test_exact_trim_reuses_the_longer_sequence(lru):
    lru.insert_cache("m", list(range(20)), layers(FakeCache, 20))
    cache, rest = lru.fetch_nearest_cache("m", list(range(12)) + [99, 98])
    assert cache is not None and [c.offset for c in cache] == [12, 12] and rest == [99, 98]
    assert lru.counters["reused_tokens"] == 12


def test_inexact_trim_falls_back_to_a_shorter_prefix_or_recomputes(lru):
    lru.insert_cache("m", list(range(20)), layers(InexactTrim, 20))
    cache, rest = lru.fetch_nearest_cache("m", list(range(12)) + [99])
    assert cache is None and rest == list(range(12)) + [99]
    lru.insert_cache("m", list(range(5)), layers(InexactTrim, 5))
    cache, rest = lru.fetch_nearest_cache("m", list(range(12)) + [99])
    assert [c.offset for c in cache] == [5, 5] and rest == list(range(5, 12)) + [99]


def test_a_raising_trim_means_recompute(lru):
    lru.insert_cache("m", list(range(20)), layers(RaisingTrim, 20))
    assert lru.fetch_nearest_cache("m", list(range(12)) + [99])[0] is None


def test_split_dependent_caches_are_never_kept(lru):
    lru.insert_cache("m", list(range(20)), layers(SplitDependent, 20))
    assert len(lru) == 0 and lru.entries() == []


def test_reuse_can_be_switched_off_per_request(lru):
    lru.insert_cache("m", list(range(20)), layers(FakeCache, 20))
    lru.skip_fetch = True
    assert lru.fetch_nearest_cache("m", list(range(20)) + [1])[0] is None


def test_own_store_prefers_the_longest_exact_reuse():
    store = S.PromptCacheStore(max_entries=3)
    store.insert("kv", list(range(8)), layers(FakeCache, 8))
    store.insert("kv", list(range(30)), layers(InexactTrim, 30))
    caches, used, how = store.fetch("kv", list(range(20)) + [7])
    # the 30-token entry shares 20 tokens but its trim is not exact: the 8-token prefix is used instead
    assert used == 8 and caches[0].offset == 8 and "not exact" in how
    store.insert("kv", list(range(40)), layers(RaisingTrim, 40))
    caches, used, how = store.fetch("kv", list(range(20)) + [7])
    assert used == 8, "a trim that raises falls back to the next candidate"
    store.insert("kv", list(range(16)), layers(FakeCache, 16))
    caches, used, how = store.fetch("kv", list(range(16)) + [7])
    assert used == 16 and how == "prefix" and caches[0].offset == 16
    assert store.fetch("other", list(range(16)) + [7])[0] is None  # other KV settings: nothing shared


def test_own_store_keeps_at_most_max_entries():
    store = S.PromptCacheStore(max_entries=2)
    for n in (4, 5, 6):
        store.insert("kv", [n] * n, layers(FakeCache, n))
    assert len(store) == 2


@pytest.mark.parametrize("cls, reused", [(FakeCache, 12), (InexactTrim, 0), (RaisingTrim, 0), (SplitDependent, 0)])
def test_both_stores_make_the_same_decision(cls, reused):
    """One policy (server_store) for mlx_lm's store and the one-at-a-time store: a 20-token kept
    sequence, a prompt sharing its first 12 tokens; the trim back to 12 is taken only where it is exact."""
    prompt = list(range(12)) + [99]
    lru = S.SafePromptCache(10, {"reused_tokens": 0})
    lru.insert_cache("m", list(range(20)), layers(cls, 20))
    cache, rest = lru.fetch_nearest_cache("m", prompt)
    store = S.PromptCacheStore()
    store.insert("kv", list(range(20)), layers(cls, 20))
    caches, used, how = store.fetch("kv", prompt)
    assert len(prompt) - len(rest) == used == reused
    if reused:
        assert [c.offset for c in cache] == [c.offset for c in caches] == [12, 12] and how == "trimmed"
    else:
        assert cache is None and caches is None


def test_a_sliding_window_model_serves_ring_methods_one_at_a_time():
    """kivi batches on a model of full-attention layers; on gemma3 its sliding layers get the compressed
    ring, which has no batch form, so kivi requests are served one at a time there (mlx_lm's own ring, for
    ``none``, still batches)."""
    from tiny_models import tiny_gemma3, tiny_llama

    from veloxquant_mlx.server import ServedModelProvider, server_args
    from veloxquant_mlx.server_requests import parse_kv_settings

    kivi, none = parse_kv_settings("kivi", {}), parse_kv_settings("none", {})
    snap = parse_kv_settings("snapkv", {})
    for model, sliding in ((tiny_llama(), False), (tiny_gemma3(), True)):
        provider = ServedModelProvider(server_args("tiny"), loaded=(model, None))
        provider.load("tiny")
        assert provider.batches(none)
        assert provider.batches(kivi) is (not sliding)
        assert provider.batches(snap) is snap.batchable
