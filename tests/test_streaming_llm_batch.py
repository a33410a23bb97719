"""StreamingLLM's batch form (``StreamingLLMBatchKVCache``): mlx_lm's continuous batching
(``BatchGenerator``) with per-request streaming_llm caches gives each request what it gets alone
(logits, tokens, kept rows and positions, ring slot), with requests of different lengths whose windows
wrap while decoding, chunked and right-padded prefill, requests joining a running batch (extend),
leaving it (filter), and carrying history (merge of caches that already hold tokens); bytes held stay
at the budget; the other eviction methods keep refusing to merge."""

from __future__ import annotations

import copy

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import BatchingNotSupported, KVCacheBuilder, KVCacheConfig, KVCacheFactory, dispatch
from veloxquant_mlx.cache.contract import CompressedKVCache
from veloxquant_mlx.cache.methods.eviction.streaming_llm import StreamingLLMKVCache
from veloxquant_mlx.cache.methods.eviction.streaming_llm_batch import StreamingLLMBatchKVCache
from veloxquant_mlx.cache.options import StreamingLLMOptions

from batch_helpers import Run as _Run, batch_caches as _batch_caches, frac_off as _frac_off, joiners_with_history_equal_alone
from batch_helpers import attend_steps_equal_singles, check_against_alone, prompt as _prompt
from batch_helpers import real_model_batch_equals_alone
from tiny_models import tiny_llama

SINKS, WINDOW = 4, 24
BUDGET = SINKS + WINDOW


def _config(window=WINDOW, **kw):
    return KVCacheConfig(method="streaming_llm", options=StreamingLLMOptions(n_sink=SINKS, window_size=window), **kw)


def _caches(model, install=True):
    return KVCacheBuilder.for_model(model, _config(), install_dispatch=install)


def _same_state(a: StreamingLLMKVCache, b: StreamingLLMKVCache, exact=True):
    """Same kept positions, in the same slots, the same ring slot, and the same rows. ``exact=False``:
    batched and unbatched runs differ only in float32 summation order (BLAS shapes, masked columns),
    so a few float16 rows of later layers differ in their last bit."""
    assert type(a) is StreamingLLMKVCache and type(b) is StreamingLLMKVCache
    assert (a.offset, a.rows, a.ring) == (b.offset, b.rows, b.ring)
    if not a.rows:
        return
    n = a.rows
    assert bool(mx.array_equal(a.positions[:, :, :n], b.positions[:, :, :n]))
    for name in ("keys", "values"):
        x, y = getattr(a, name)[:, :, :n], getattr(b, name)[:, :, :n]
        assert x.dtype == y.dtype, name
        if exact:
            assert bool(mx.array_equal(x, y)), name
        else:
            assert _frac_off(x, y) < 1e-2, name


def _same_inexact(extracted, alone):
    _same_state(extracted, alone, exact=False)


def _kept_positions(c: StreamingLLMKVCache):
    return sorted(c.positions[0, 0, : c.rows].tolist())


# ------------------------------------------------------------------------------------- tiny model
@pytest.mark.parametrize("use_dispatch", [True, False])
def test_batch_generator_equals_each_request_alone(use_dispatch):
    """4 prompts of 40-120 tokens (right-padded prefill in 64-token chunks, evicting inside the
    prefill), 30 decode steps so every window wraps (ring overwrite), requests leaving at different
    steps (filter); with the dispatch point (``attend``) and without it (dense rows + the batch mask)."""
    model = tiny_llama()
    if not use_dispatch:
        dispatch.uninstall()
    lens, max_tokens = [40, 120, 71, 20], [30, 22, 30, 30]
    prompts = [_prompt(n, k) for k, n in enumerate(lens)]
    run = _Run(model, prefill_step_size=64)
    uids = run.insert(prompts, [_caches(model, install=use_dispatch) for _ in prompts], max_tokens)
    saw_batch, rings = False, set()
    while run.busy():
        run.step()
        kb = [c for c in _batch_caches(run.gen) if isinstance(c, StreamingLLMBatchKVCache)]
        if kb and len(run.gen._generation_batch) > 1:
            c = kb[0]
            saw_batch |= len(c.lens) == 4
            assert c.offset.tolist() == c.lens
            assert max(c.nq) <= BUDGET and c.cap <= BUDGET  # sinks + window, whatever the decode length
            rings.update(r for r in c.ring if r >= 0)
    assert saw_batch and dispatch.installed() == use_dispatch
    assert len(rings) > 3  # full caches overwrote their oldest window rows in place, at several slots
    alone = [_caches(model, install=use_dispatch) for _ in prompts]
    check_against_alone(model, run, uids, prompts, max_tokens, alone, _same_inexact, prefill_step_size=64)
    final = run.final[uids[1]][0]
    assert _kept_positions(final) == list(range(SINKS)) + list(range(final.offset - WINDOW, final.offset))


def test_request_joins_running_batch_and_history_is_merged():
    """Requests join a batch that is decoding (extend, empty caches next to full ones), one of them
    carrying a cache that already holds a prefix and wrapped its ring (merge with history); all equal
    their run alone."""
    model = tiny_llama()
    prefix, rest = _prompt(90, 2)[:50], _prompt(90, 2)[50:]
    reused = _caches(model)
    model(mx.array(prefix)[None], cache=reused)
    for t in prefix[:5]:  # decode steps on a full cache: the ring moved
        model(mx.array([[t]]), cache=reused)
    assert reused[0].rows == BUDGET and reused[0].ring == SINKS + 5 and reused[0].offset == 55
    joiners_with_history_equal_alone(model, lambda: _caches(model), reused, prefix + prefix[:5], rest,
                                     _same_inexact)


def test_attend_on_ragged_batch_equals_each_single():
    """Random rows, ragged states (held history of 66 / 130 / 5 / 0 tokens, one with a moved ring), a
    right-padded prefill chunk, decode steps (rings wrap), a full chunk: the batch's attention (through
    ``attend`` and through the dense rows + mask) equals each single cache's, and the states equal."""
    mx.random.seed(0)
    D, H, Hq = 32, 2, 6

    def make():
        return KVCacheFactory.create(_config(head_dim=D))

    singles = []
    for n in (66, 130, 5, 0):
        c = make()
        if n:
            c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        singles.append(c)
    for _ in range(3):
        singles[1].update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
    assert singles[1].ring == SINKS + 3
    batch = StreamingLLMKVCache.merge([copy.deepcopy(c) for c in singles])
    assert type(batch) is StreamingLLMBatchKVCache and batch.ring == [-1, SINKS + 3, -1, -1]
    steps = [(23, [23, 10, 23, 1])] + [(1, None)] * 30 + [(40, None), (1, None), (1, None)]
    attend_steps_equal_singles(batch, singles, steps, H, Hq, D, tol_codes=1e-5, tol_dense=1e-5)
    assert batch.lens == [c.offset for c in singles] and batch.nq == [BUDGET] * 4
    for i, c in enumerate(singles):
        _same_state(batch.extract(i), c)


def test_batch_filled_by_decode_steps_only_wraps_its_ring_as_alone():
    """Sequences that start empty and receive only one-row calls (a one-token prompt) fill up and then
    overwrite their oldest window row, never a sink: the same rows, slots and ring as alone."""
    mx.random.seed(1)
    H, D = 2, 16
    singles = [KVCacheFactory.create(_config(head_dim=D)) for _ in range(2)]
    batch = StreamingLLMKVCache.merge([copy.deepcopy(c) for c in singles])
    for _ in range(BUDGET + 5):
        k, v = mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))
        batch.update_and_fetch(k, v)
        for i, c in enumerate(singles):
            c.update_and_fetch(k[i : i + 1], v[i : i + 1])
    assert batch.ring == [SINKS + 5] * 2 and batch.nq == [BUDGET] * 2
    for i, c in enumerate(singles):
        _same_state(batch.extract(i), c)


def test_merge_extract_filter_extend_units():
    """The batch protocol on the cache itself: merge of held/empty caches, extract, filter, extend,
    the mask, trim."""
    model = tiny_llama()
    held = []
    for k, n in enumerate([50, 97, 5]):
        c = _caches(model)
        model(mx.array(_prompt(n, k))[None], cache=c)
        held.append(c)
    empty = _caches(model)
    batch = [StreamingLLMKVCache.merge([h[i] for h in held] + [empty[i]]) for i in range(len(empty))]
    b0 = batch[0]
    assert type(b0) is StreamingLLMBatchKVCache and b0.nq == [BUDGET, BUDGET, 5, 0]
    assert b0.offset.tolist() == [50, 97, 5, 0] and b0.keys.shape[2] == BUDGET
    for i, h in enumerate(held):  # extract right after merge gives back the same cache
        _same_state(b0.extract(i), h[0])
    assert b0.extract(3).empty()
    b0.filter([1, 2])
    assert b0.nq == [BUDGET, 5] and b0.lens == [97, 5]
    _same_state(b0.extract(0), held[1][0])
    _same_state(b0.extract(1), held[2][0])
    other = StreamingLLMKVCache.merge([empty[0], copy.deepcopy(empty[0])])  # nothing stored yet
    assert other.empty()
    b0.extend(other)
    assert b0.nq == [BUDGET, 5, 0, 0] and b0.lens == [97, 5, 0, 0]
    _same_state(b0.extract(1), held[2][0])
    assert b0.extract(2).empty()
    # mask: each sequence sees its sinks, its window and, causally, the new rows
    m = b0.make_mask(2)
    assert m.shape == (4, 1, 2, BUDGET + 2)
    assert m[1, 0, 0].tolist() == [True] * 5 + [False] * (BUDGET - 5) + [True, False]
    # sequence 0 (97 tokens): query at 97 sees sinks 0-3 and 74..96 (window counts itself), not 73
    assert m[0, 0, 0].tolist() == [True] * SINKS + [False] + [True] * (WINDOW - 1) + [True, False]
    assert m[0, 0, 1].tolist() == [True] * SINKS + [False, False] + [True] * (WINDOW - 2) + [True, True]
    # trim: as the single cache (rows back in position order)
    b1 = batch[1]
    b1.filter([0, 1, 2])
    single = copy.deepcopy(held[2][1])
    assert b1.trim(2) == 2 and single.trim(2) == 2
    _same_state(b1.extract(2), single)
    assert b1.lens == [48, 95, 3]


def test_nbytes_at_budget_not_growing():
    """Bytes held are the arrays held: sinks + window rows (+ their positions) per request, the same
    after 10 and after 30 decode steps."""
    model = tiny_llama(n_layers=2)
    prompts = [_prompt(n, k) for k, n in enumerate([60, 90, 110])]
    run = _Run(model, max_tokens=30)
    run.insert(prompts, [_caches(model) for _ in prompts], [30, 30, 30])
    seen = []
    for step in range(28):
        run.step()
        if step in (10, 27):
            batch = run.gen._generation_batch.prompt_cache
            assert len(batch[0].lens) == 3
            for c in batch:
                assert type(c) is StreamingLLMBatchKVCache
                assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
                H, D, Dv = c._shape
                assert c.nbytes == 3 * H * BUDGET * ((D + Dv) * 2 + 4)  # fp16 rows + int32 positions
                assert c.nbytes < c.full_seq_bytes
            seen.append(sum(c.nbytes for c in batch))
    assert seen[0] == seen[1]
    run.run()


def test_other_eviction_methods_refuse():
    def make(method, **kw):
        return KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, **kw))

    assert StreamingLLMKVCache.batchable and not StreamingLLMBatchKVCache.batchable
    assert not CompressedKVCache.batchable
    for method in ("h2o", "snapkv", "tova", "knorm", "pyramidkv"):
        a, b = make(method), make(method)
        assert not type(a).batchable
        with pytest.raises(BatchingNotSupported):
            a.merge([a, b])
        with pytest.raises(BatchingNotSupported):
            StreamingLLMKVCache.merge([KVCacheFactory.create(_config(head_dim=64)), a])
    with pytest.raises(BatchingNotSupported):  # different windows cannot share a batch
        StreamingLLMKVCache.merge([KVCacheFactory.create(_config(head_dim=64)),
                                   KVCacheFactory.create(_config(window=32, head_dim=64))])


# ------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_batch_equals_alone():
    """The embedded SmolLM2-135M: 3 essay prompts (41-120 tokens), 30 greedy decode steps batched by
    mlx_lm's BatchGenerator with 4 sinks + a 24-token window (every window wraps): the same tokens as
    each request alone through mlx_lm.stream_generate, and the extracted caches keep the same rows."""
    real_model_batch_equals_alone([(0, 41), (200, 320), (500, 580)], 30, _caches, _same_state)
