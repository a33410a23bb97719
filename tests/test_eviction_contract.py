"""The mlx_lm contract's eviction specifics (StreamingLLM, SnapKV): attention through the dispatch point vs
a dense reference with the eviction mask, real-query scoring, lossless budgets, batches, bad inputs, bytes.
State, save/load, deepcopy, trim and merge for every mlx_lm method: test_contract.py."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tiny_models import ARCHS, VOCAB, greedy, tiny_llama
from veloxquant_mlx.cache import (
    CacheInputError,
    CaMOptions,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    SnapKVOptions,
    SqueezeOptions,
    StreamingLLMOptions,
    dispatch,
)
from veloxquant_mlx.cache.dispatch import dispatched_sdpa

B, HQ, H, D = 2, 4, 2, 16
F32 = mx.float32  # exactness tests store rows in float32 (the default stores 16-bit)


def streaming(n_sink=2, window=6):
    return KVCacheFactory.create(KVCacheConfig(method="streaming_llm", options=StreamingLLMOptions(n_sink=n_sink, window_size=window), dtype=F32))


def snap(budget=16, obs=4, n_sink=2):
    return KVCacheFactory.create(KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=budget, obs_window=obs, n_sink=n_sink), dtype=F32))


def layer_call(cache, q, k, v):
    """What an mlx_lm attention layer does with a cache (mask first, then update, then sdpa)."""
    mask = cache.make_mask(q.shape[2])
    keys, values = cache.update_and_fetch(k, v)
    return dispatched_sdpa(q, keys, values, cache=cache, scale=D**-0.5, mask=mask)


def reference_attention(q, K, V, q_pos, allowed):
    """Dense attention of queries at positions q_pos over all keys K, V with allowed(q_pos, k_pos)."""
    k_pos = mx.arange(K.shape[2])
    mask = allowed(q_pos[:, None], k_pos[None])
    return mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask)


@pytest.mark.parametrize("use_dispatch", [True, False])
@pytest.mark.parametrize("chunks", [[9, 1, 1, 1, 5, 1], [1] * 12, [20, 3, 1], [9] + [1] * 50, [9] + [1] * 20 + [7] + [1] * 5])
def test_streaming_llm_is_exactly_sinks_plus_window(use_dispatch, chunks):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    n_sink, window = 2, 6
    cache = streaming(n_sink, window)
    mx.random.seed(0)
    total = sum(chunks)
    K, V = mx.random.normal((B, H, total, D)), mx.random.normal((B, H, total, D))
    Q = mx.random.normal((B, HQ, total, D))
    allowed = lambda qp, kp: (kp <= qp) & ((kp < n_sink) | (kp > qp - window))
    start = 0
    for n in chunks:
        sl = slice(start, start + n)
        out = layer_call(cache, Q[:, :, sl], K[:, :, sl], V[:, :, sl])
        ref = reference_attention(Q[:, :, sl], K[:, :, : start + n], V[:, :, : start + n], mx.arange(start, start + n), allowed)
        assert mx.allclose(out, ref, atol=1e-5), (n, start)
        start += n
        assert cache.offset == start
        assert cache.size() <= n_sink + window
    # the stored rows are exactly the sinks and the newest window tokens (in any row order)
    pos = sorted(cache.positions[0, 0, : cache.size()].tolist())
    assert pos == list(range(n_sink)) + list(range(total - window, total))


@pytest.mark.parametrize("tile,logit_sinks", [(1, False), (2, False), (3, True), (7, False)])
@pytest.mark.parametrize("chunks", [[9, 1, 1, 1, 5, 1], [20, 3, 1], [9] + [1] * 20 + [7] + [1] * 5, [3, 4, 13, 11]])
def test_streaming_llm_window_tiles_see_only_their_band_and_stay_exact(tile, logit_sinks, chunks, monkeypatch):
    """A multi-row call with its rows in position order goes to ``attention.window_attention``: tiles of query rows
    (forced small here) each over the sinks and its band of the window. Exact against the reference mask over all
    keys (with a model's attention-sink logits too), and no tile sees more than sinks + window + tile - 1 keys;
    after decode steps on a full cache (a ring) a call takes the path over all its rows."""
    from veloxquant_mlx.cache import attention

    dispatch.install()
    n_sink, window = 2, 6
    cache = streaming(n_sink, window)
    seen, sdpa = [], mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention, "query_tile_rows", lambda *a: tile)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    mx.random.seed(3)
    total = sum(chunks)
    K, V = mx.random.normal((B, H, total, D)), mx.random.normal((B, H, total, D))
    Q = mx.random.normal((B, HQ, total, D))
    allowed = lambda qp, kp: (kp <= qp) & ((kp < n_sink) | (kp > qp - window))
    logits = mx.array([0.5, -1.0, 2.0, 0.0]) if logit_sinks else None  # per query head (gpt-oss's sinks)
    start, banded = 0, 0
    for n in chunks:
        sl = slice(start, start + n)
        in_order = cache.ring < 0
        seen.clear()
        mask = cache.make_mask(n)
        keys, values = cache.update_and_fetch(K[:, :, sl], V[:, :, sl])
        out = dispatched_sdpa(Q[:, :, sl], keys, values, cache=cache, scale=D**-0.5, mask=mask, sinks=logits)
        calls = list(seen)
        allowed_now = allowed(mx.arange(start, start + n)[:, None], mx.arange(start + n)[None])
        ref = sdpa(Q[:, :, sl], K[:, :, : start + n], V[:, :, : start + n], scale=D**-0.5, mask=allowed_now,
                   sinks=logits)
        assert mx.allclose(out, ref, atol=1e-5), (n, start)
        if n > 1 and start + n > window and in_order:  # an array mask: the band's tiles
            banded += 1
            assert sum(r for r, _ in calls) == n and all(r <= min(tile, window) for r, _ in calls)
            assert all(m <= n_sink + window + r - 1 for r, m in calls), calls
        start += n
    assert banded >= 1


def test_eviction_keeps_original_rows_with_their_positions_per_head():
    dispatch.install()
    mx.random.seed(1)
    cache = snap(budget=12, obs=4, n_sink=2)
    T = 40
    K, V = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    Q = mx.random.normal((B, HQ, T, D))
    layer_call(cache, Q, K, V)
    assert cache.size() == 12 and cache.offset == T
    pos = cache.positions[:, :, :12]
    # rows are the original rows at their positions, in position order, sinks and window kept
    assert mx.array_equal(cache.keys[:, :, :12], mx.take_along_axis(K, pos[..., None], axis=2))
    assert mx.all(pos[..., 1:] > pos[..., :-1])
    assert mx.all(pos[..., :2] == mx.array([0, 1])) and mx.all(pos[..., -4:] == mx.arange(T - 4, T))
    # heads choose independently (random data: the sets differ)
    assert not mx.array_equal(pos[0, 0], pos[0, 1])
    # a decode step: attention over exactly the kept rows + the new token, token by token
    q1, k1, v1 = mx.random.normal((B, HQ, 1, D)), mx.random.normal((B, H, 1, D)), mx.random.normal((B, H, 1, D))
    out = layer_call(cache, q1, k1, v1)
    Kk = mx.concatenate([mx.take_along_axis(K, pos[..., None], axis=2), k1], axis=2)
    Vk = mx.concatenate([mx.take_along_axis(V, pos[..., None], axis=2), v1], axis=2)
    ref = mx.fast.scaled_dot_product_attention(q1, Kk, Vk, scale=D**-0.5, mask=None)
    assert mx.allclose(out, ref, atol=1e-5)
    assert cache.size() == 13  # decode tokens are kept (SnapKV compresses the prompt)


def test_snapkv_real_queries_keep_what_real_attention_concentrates_on():
    """Queries look along direction u; keys of a few 'needle' tokens point along u, while the
    observation window's own keys are orthogonal to u. Real-query scoring keeps the needles;
    keys-as-queries (the fallback) does not."""
    T, obs = 128, 4
    budget = 1 + obs + 4 * 7  # sink + window + the needles with their pooling neighbourhoods
    mx.random.seed(2)
    u = mx.zeros((D,)).at[0].add(1.0)
    K = mx.random.normal((1, 1, T, D)) * 0.3
    K = K.at[..., 0].multiply(0.0)  # nothing else along u
    needles = [10, 33, 67, 95]
    for i in needles:
        K = K.at[0, 0, i].add(u * 6.0)
    V = mx.random.normal((1, 1, T, D))
    Q = mx.broadcast_to(u * 6.0, (1, 1, T, D))

    def kept(use_dispatch):
        (dispatch.install if use_dispatch else dispatch.uninstall)()
        c = snap(budget=budget, obs=obs, n_sink=1)
        layer_call(c, Q, K, V)
        return set(c.positions[0, 0, : c.size()].tolist())

    assert set(needles) <= kept(True)
    assert not set(needles) <= kept(False)


def test_snapkv_refuses_a_budget_that_cannot_hold_its_always_kept_rows():
    """Sinks and the observation window are always kept: a budget below them plus one evictable row is refused
    at construction (it used to keep an arbitrary subset of the protected rows)."""
    with pytest.raises(QuantizerConfigError, match=r"snap_budget=36 .*snap_n_sink \+ snap_obs_window \+ 1 = 37"):
        snap(budget=36, obs=32, n_sink=4)
    with pytest.raises(QuantizerConfigError, match="snap_budget=16"):
        snap(budget=16, obs=32, n_sink=0)
    c = snap(budget=37, obs=32, n_sink=4)  # the smallest budget accepted
    c.update_and_fetch(*(mx.random.normal((1, H, 60, D)),) * 2)
    kept = c.positions[0, 0, : c.size()].tolist()
    assert c.size() == 37 and kept[:4] == [0, 1, 2, 3] and kept[-32:] == list(range(28, 60))


@pytest.mark.parametrize("method, options", [("cam", CaMOptions), ("squeeze", SqueezeOptions)])
def test_h2o_style_votes_refuse_sinks_that_leave_no_row_to_choose(method, options):
    """H2O-style votes keep the sinks and the newest half of the budget: sinks filling the other half are refused
    (they used to keep an arbitrary part of the newest half)."""
    with pytest.raises(QuantizerConfigError, match=rf"{method}_n_sink=100 .*_budget - {method}_budget // 2 = 75"):
        KVCacheFactory.create(KVCacheConfig(method=method, options=options(budget=150, n_sink=100)))
    c = KVCacheFactory.create(KVCacheConfig(method=method, options=options(budget=150, n_sink=74), dtype=F32))
    c.update_and_fetch(*(mx.random.normal((1, H, 300, D)),) * 2)
    kept = sorted(c.positions[0, 0, : c.size()].tolist())
    assert c.size() == 150 and kept[:74] == list(range(74)) and kept[-75:] == list(range(225, 300))


def test_layers_with_different_budgets_share_one_mask_in_a_model():
    model = tiny_llama(n_layers=3)
    toks = mx.random.randint(0, VOCAB, (1, 50))
    for use_dispatch in (True, False):
        (dispatch.install if use_dispatch else dispatch.uninstall)()
        caches = [snap(budget=b, obs=4) for b in (8, 16, 24)]
        model(toks[:, :40], cache=caches)
        assert [c.size() for c in caches] == [8, 16, 24]
        logits = model(toks[:, 40:], cache=caches)  # a second chunk: rows differ per layer
        assert logits.shape == (1, 10, VOCAB) and bool(mx.all(mx.isfinite(logits)))
        assert [c.offset for c in caches] == [50] * 3


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("method, options", [("snapkv", SnapKVOptions(budget=2048)), ("streaming_llm", StreamingLLMOptions(window_size=4096))])
def test_lossless_budget_matches_plain_cache_through_generate(arch, method, options):
    """With a budget larger than the prompt nothing is evicted: generation equals mlx_lm's plain cache,
    across prefill chunks (prefill_step_size=16) and with mixed layer types (gemma3 sliding layers)."""
    model = ARCHS[arch]()
    prompt = mx.random.randint(0, VOCAB, (45,)).tolist()
    ref = greedy(model, prompt, make_prompt_cache(model), 8, prefill_step_size=16)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, options=options, dtype=F32))
    out = greedy(model, prompt, caches, 8, prefill_step_size=16)
    assert out == ref
    assert sum(type(c).__name__ != "RotatingKVCache" for c in caches) >= 1


def test_eviction_through_generate_with_chunked_prefill_stays_within_budget():
    model = tiny_llama()
    prompt = mx.random.randint(0, VOCAB, (100,)).tolist()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=24, obs_window=8)))
    greedy(model, prompt, caches, 5, prefill_step_size=32)
    # 99 prompt tokens in chunks of 32 (evicting to 24 after each), then the last prompt token and
    # 5 decode calls (generate_step runs one step ahead): decode rows are all kept
    assert all(c.offset == 105 and c.size() == 24 + 6 for c in caches)
    assert sum(c.nbytes for c in caches) < sum(c.full_seq_bytes for c in caches)


def test_streaming_memory_stays_bounded_over_a_long_decode():
    model = tiny_llama(n_layers=1)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming_llm", options=StreamingLLMOptions(n_sink=4, window_size=32)))
    prompt = mx.random.randint(0, VOCAB, (10,)).tolist()
    greedy(model, prompt, caches, 600)
    c = caches[0]
    assert c.offset == 610 and c.size() == 36
    assert c.keys.shape[2] <= 36 + 16  # the full cache's decode steps write in place: no growth  # buffer growth is bounded, never proportional to tokens seen


def test_batch_of_two_equal_length_prompts():
    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (2, 30))
    ref = model(toks, cache=make_prompt_cache(model))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=64), dtype=F32))
    out = model(toks[:, :20], cache=caches)
    out = mx.concatenate([out, model(toks[:, 20:], cache=caches)], axis=1)
    assert mx.allclose(out, ref, atol=1e-4)
    # and each row matches a batch of one
    single = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=64), dtype=F32))
    assert mx.allclose(model(toks[1:], cache=single), ref[1:], atol=1e-4)


def test_bad_inputs_get_clear_errors():
    c = snap()
    with pytest.raises(CacheInputError, match=r"\[B, H, N, D\]"):
        c.update_and_fetch(mx.zeros((2, 3, 4)), mx.zeros((2, 3, 4)))
    with pytest.raises(CacheInputError, match="floating"):
        c.update_and_fetch(mx.zeros((1, 2, 3, D), dtype=mx.int32), mx.zeros((1, 2, 3, D)))
    # a chunk's NaN is found at the next call (no host sync inside the graph), which raises, as does every
    # call after it, until trim removes the chunk's rows
    c.update_and_fetch(mx.full((1, 2, 3, D), mx.nan), mx.zeros((1, 2, 3, D)))
    for _ in range(2):
        with pytest.raises(CacheInputError, match=r"NaN or Inf .*positions 0\.\.2\); trim\(3\)"):
            c.update_and_fetch(mx.zeros((1, 2, 1, D)), mx.zeros((1, 2, 1, D)))
    assert c.offset == 3 and c.trim(3) == 3
    c.update_and_fetch(mx.zeros((1, 2, 3, D)), mx.zeros((1, 2, 3, D)))
    with pytest.raises(CacheInputError, match="head_dim mismatch"):
        c.update_and_fetch(mx.zeros((1, 2, 1, 32)), mx.zeros((1, 2, 1, 32)))
    assert c.offset == 3


def test_rows_are_stored_at_16_bits_by_default_and_bytes_are_honest():
    c = KVCacheFactory.create(KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=16, obs_window=4)))
    mx.random.seed(4)
    k = mx.random.normal((1, H, 40, D))
    keys, _ = c.update_and_fetch(k, k)
    assert keys.dtype == mx.float32 and c.keys.dtype == mx.float16
    assert c.nbytes == c.keys.nbytes + c.values.nbytes + c.positions.nbytes
    assert c.full_seq_bytes == 40 * H * 2 * D * 2


def test_streaming_trim_after_the_ring_wrapped_is_exact():
    n_sink, window = 2, 6
    cache, twin = streaming(n_sink, window), streaming(n_sink, window)
    mx.random.seed(5)
    K, V = mx.random.normal((1, H, 30, D)), mx.random.normal((1, H, 30, D))
    for c, n in ((cache, 30), (twin, 28)):
        c.update_and_fetch(K[:, :, :9], V[:, :, :9])
        for t in range(9, n):
            c.update_and_fetch(K[:, :, t : t + 1], V[:, :, t : t + 1])
    assert cache.ring >= 0  # decode steps wrote in place
    assert cache.trim(2) == 2 and cache.offset == 28
    # same rows as a cache that stopped at 28 tokens (sinks + the window newest it still holds)
    held = sorted(cache.positions[0, 0, : cache.size()].tolist())
    assert held == list(range(n_sink)) + list(range(24, 28))
    assert set(held) <= set(twin.positions[0, 0, : twin.size()].tolist())
