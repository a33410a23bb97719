"""TurboQuant-RVQ's batch form (``TurboQuantRVQBatchKVCache``): mlx_lm's continuous batching
(``BatchGenerator``) with per-request turboquant_rvq caches gives each request what it gets alone
(logits, tokens, sink rows, codes, window), with requests of different lengths, chunked and
right-padded prefill, window flushes while decoding, requests joining a running batch (extend),
leaving it (filter), and carrying history (merge of caches that already hold tokens); bytes held
stay compressed; subclasses and other methods keep refusing to merge."""

from __future__ import annotations

import copy

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import BatchingNotSupported, KVCacheBuilder, KVCacheConfig, KVCacheFactory, dispatch
from veloxquant_mlx.cache.contract import CompressedKVCache
from veloxquant_mlx.cache.methods.quantization import turboquant_rvq as tq
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import QUANT_BLOCK, SINK_ROWS, TurboQuantRVQKVCache
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq_batch import TurboQuantRVQBatchKVCache
from veloxquant_mlx.cache.options import TurboQuantRVQOptions

from batch_helpers import Run as _Run, batch_caches as _batch_caches, frac_off as _frac_off, joiners_with_history_equal_alone
from batch_helpers import attend_steps_equal_singles, check_against_alone, prompt as _prompt
from batch_helpers import real_model_batch_equals_alone
from tiny_models import tiny_llama

R_TINY = 32  # a short window on the tiny model: flushes every 32 decode steps


def _config(residual_length=R_TINY, **kw):
    return KVCacheConfig(method="turboquant_rvq", options=TurboQuantRVQOptions(residual_length=residual_length), **kw)


def _caches(model, install=True, residual_length=R_TINY):
    return KVCacheBuilder.for_model(model, _config(residual_length), install_dispatch=install)


def _same_state(a: TurboQuantRVQKVCache, b: TurboQuantRVQKVCache, exact=True):
    """Same counts and stored rows (the used rows of every array, as ``state`` saves them).
    ``exact=False``: batched and unbatched runs differ only in float32 summation order (BLAS shapes,
    masked columns); where that moves a row across a decision edge a code moves (measured on the
    embedded model: well under 1% of codes)."""
    assert type(a) is TurboQuantRVQKVCache and type(b) is TurboQuantRVQKVCache
    assert (a.offset, a.n_sink, a.n_quant, a.n_win) == (b.offset, b.n_sink, b.n_quant, b.n_win)
    assert a.array_fields == b.array_fields and a.counts_constants == b.counts_constants
    sa, sb = a.state, b.state
    for name in a.array_fields:
        x, y = sa[name], sb[name]
        if x is None or y is None:
            assert x is None and y is None or 0 in (x if x is not None else y).shape, name
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if exact:
            assert bool(mx.array_equal(x, y)), name
        elif "codes" in name:
            assert float(mx.mean((x != y).astype(mx.float32))) < 1e-2, name
        else:  # float16 norms / rows that differ in their last bits
            assert _frac_off(x, y) < 1e-2, name


def _same_inexact(extracted, alone):  # float32 summation order differs with the batch's widths
    _same_state(extracted, alone, exact=False)


# ------------------------------------------------------------------------------------- tiny model
@pytest.mark.parametrize("use_dispatch", [True, False])
def test_batch_generator_equals_each_request_alone(use_dispatch):
    """4 prompts of different lengths (right-padded prefill in 64-token chunks, sink rows and blocks
    flushed in prefill, windows flushed again while decoding, at different steps per request),
    requests leaving at different steps (filter); with the dispatch point (attention on the codes)
    and without it (dense rows + the batch mask)."""
    model = tiny_llama()
    if not use_dispatch:
        dispatch.uninstall()
    lens, max_tokens = [45, 100, 71, 150], [40, 25, 40, 33]
    prompts = [_prompt(n, k) for k, n in enumerate(lens)]
    run = _Run(model, prefill_step_size=64)
    uids = run.insert(prompts, [_caches(model, install=use_dispatch) for _ in prompts], max_tokens)
    saw_batch, flushes_in_decode = False, 0
    while run.busy():
        before = [list(c.nq) for c in _batch_caches(run.gen)[:1] if isinstance(c, TurboQuantRVQBatchKVCache)]
        run.step()
        kb = [c for c in _batch_caches(run.gen) if isinstance(c, TurboQuantRVQBatchKVCache)]
        if kb and len(run.gen._generation_batch) > 1:
            c = kb[0]
            saw_batch |= len(c.lens) == 4
            assert c.offset.tolist() == c.lens
            assert c.lens == [s + q + w for s, q, w in zip(c.ns, c.nq, c.nw)]
            assert c.win_k.shape[2] == max(c.nw) < R_TINY + QUANT_BLOCK  # window bounded, prefix sliced off
            if before and len(before[0]) == len(c.nq):  # a decode step of an unchanged batch
                flushes_in_decode += sum(b > a for a, b in zip(before[0], c.nq))
    assert saw_batch and dispatch.installed() == use_dispatch
    assert flushes_in_decode >= 2  # windows flushed while the batch decoded, at different steps
    alone = [_caches(model, install=use_dispatch) for _ in prompts]
    # the batch's padded/masked columns change float32 summation order (softmax sums, BLAS blocking):
    # measured here, identical codes and window rows equal but for 1-ulp float16 differences in a few
    # percent of them, logprobs within 4e-4 on this random model (sharp attention)
    check_against_alone(model, run, uids, prompts, max_tokens, alone, _same_inexact, prefill_step_size=64)


def test_request_joins_running_batch_and_history_is_merged():
    """Requests join a batch that is decoding (extend, empty caches next to full ones), one of them
    carrying a cache that already holds a prefix (merge with history); all equal their run alone."""
    model = tiny_llama()
    prefix, rest = _prompt(90, 2)[:66], _prompt(90, 2)[66:]
    reused = _caches(model)
    model(mx.array(prefix)[None], cache=reused)  # 66 tokens held: 4 sinks, 28 codes, 34 window rows
    assert (reused[0].n_sink, reused[0].n_quant, reused[0].n_win) == (SINK_ROWS, 28, 34)
    # (attention itself agrees to ~1e-6 with masked slots: test_attend_on_ragged_batch_equals_each_single)
    joiners_with_history_equal_alone(model, lambda: _caches(model), reused, prefix, rest, _same_inexact)


def _random_singles(H, D, held, residual_length=R_TINY):
    out = []
    for n in held:
        c = KVCacheFactory.create(_config(residual_length, head_dim=D))
        if n:
            c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        out.append(c)
    return out


@pytest.mark.parametrize("split", [False, True])
def test_attend_on_ragged_batch_equals_each_single(monkeypatch, split):
    """Random rows, ragged states (held history of 70 / 130 / 3 / 0 tokens), right-padded prefill
    chunks, decode steps crossing flushes and a full chunk: the batch's attention (on the codes and
    through the dense rows + mask) equals each single cache's, and the extracted states equal."""
    if split:  # every long CPU step in parts on two streams (attention.cpu_cuts), the batch's as each single's
        from veloxquant_mlx.cache import attention
        for name, value in (("CPU_STREAMS", 2), ("CPU_SPLIT_MIN_ROWS", 64), ("CPU_SPLIT_DECODE_MIN_ROWS", 64)):
            monkeypatch.setattr(attention, name, value)
    mx.random.seed(0)
    D, H, Hq = 64, 2, 6
    singles = _random_singles(H, D, (70, 130, 3, 0))
    batch = TurboQuantRVQKVCache.merge([copy.deepcopy(c) for c in singles])
    assert type(batch) is TurboQuantRVQBatchKVCache
    steps = [(23, [23, 10, 23, 1]), (1, None), (1, None), (40, None)] + [(1, None)] * 30 + \
            [(50, [50, 5, 37, 50]), (1, None), (1, None)]
    attend_steps_equal_singles(batch, singles, steps, H, Hq, D, tol_codes=1e-5, tol_dense=1e-4)
    assert batch.lens == [c.offset for c in singles] == [217, 219, 137, 125]
    assert batch.nw == [c.n_win for c in singles] and batch.nq == [c.n_quant for c in singles]
    for i, c in enumerate(singles):
        _same_state(batch.extract(i), c)


def test_merge_extract_filter_extend_trim_units():
    """The batch protocol on the cache itself: merge of held/empty caches, extract, filter, extend,
    the mask layout, trim (as the single cache trims) and the state round trip."""
    mx.random.seed(1)
    D, H = 16, 2
    held = _random_singles(H, D, (50, 97, 5))
    empty = KVCacheFactory.create(_config(head_dim=D))
    b = TurboQuantRVQKVCache.merge(held + [empty])
    assert b.ns == [0, 4, 0, 0] and b.nq == [0, 60, 0, 0] and b.nw == [50, 33, 5, 0]
    assert b.offset.tolist() == [50, 97, 5, 0] and b.win_k.shape[2] == 50 and b.cap == 60
    for i, h in enumerate(held):  # extract right after merge gives back the same cache
        _same_state(b.extract(i), h)
    assert b.extract(3).empty()
    # mask: each sequence sees its sink rows, its code slots, its window rows and, causally, the new rows
    m = b.make_mask(2)
    assert m.shape == (4, 1, 2, 4 + 60 + 50 + 2)
    assert m[2, 0, 0].tolist() == [False] * 64 + [False] * 45 + [True] * 5 + [True, False]
    assert m[1, 0, 1].tolist() == [True] * 64 + [False] * 17 + [True] * 33 + [True] * 2
    # trim: as each single cache trims (window rows, then codes, then sink rows)
    t = copy.deepcopy(b)
    t.filter([0, 1, 2])
    with pytest.raises(ValueError):
        t.trim(6)  # a sequence holds 5 tokens
    singles = [copy.deepcopy(h) for h in held]
    assert t.trim(5) == 5 and all(s.trim(5) == 5 for s in singles)
    assert t.lens == [45, 92, 0] and t.win_k.shape[2] == 45
    for i, s in enumerate(singles):
        _same_state(t.extract(i), s)
    t.filter([0, 1])
    singles = singles[:2]
    assert t.trim(30) == 30 and all(s.trim(30) == 30 for s in singles)  # into the codes of sequence 1
    assert t.nq == [0, 58] and t.nw == [15, 0] and t.win_k.shape[2] == 15
    for i, s in enumerate(singles):
        _same_state(t.extract(i), s)
    # state round trip (mlx_lm's save/load_prompt_cache path)
    r = TurboQuantRVQBatchKVCache.__new__(TurboQuantRVQBatchKVCache)
    r.state = t.state
    assert (r.ns, r.nq, r.nw, r.lens) == (t.ns, t.nq, t.nw, t.lens) and r.offset.tolist() == t.lens
    _same_state(r.extract(1), singles[1])
    # filter / extend
    b.filter([1, 2])
    assert b.nq == [60, 0] and b.nw == [33, 5] and b.win_k.shape[2] == 33
    _same_state(b.extract(0), held[1])
    _same_state(b.extract(1), held[2])
    other = TurboQuantRVQKVCache.merge([copy.deepcopy(empty), copy.deepcopy(empty)])  # nothing stored yet
    assert other.empty()
    b.extend(other)
    assert b.nq == [60, 0, 0, 0] and b.lens == [97, 5, 0, 0] and b.sink_k.shape[0] == 4
    _same_state(b.extract(1), held[2])
    assert b.extract(2).empty()
    b2 = TurboQuantRVQKVCache.merge([copy.deepcopy(held[1])])
    other.extend(b2)  # an empty batch extended by one holding tokens
    assert other.lens == [0, 0, 97] and other.cap == 60
    _same_state(other.extract(2), held[1])


def test_nbytes_compressed_and_no_float_copy():
    """Default settings (window 128): the batch holds codes, norms, 4 sink rows and the window per
    request, nothing else; nbytes is the arrays held and well under float16."""
    model = tiny_llama(head_dim=64, n_layers=2)
    prompts = [_prompt(n, k) for k, n in enumerate([900, 950, 990])]
    run = _Run(model, max_tokens=12)
    run.insert(prompts, [_caches(model, residual_length=128) for _ in prompts], [12, 12, 12])
    for _ in range(6):
        run.step()
    batch = run.gen._generation_batch.prompt_cache
    assert len(batch[0].lens) == 3
    for layer, c in enumerate(batch):
        assert type(c) is TurboQuantRVQBatchKVCache and c.counts_constants == (layer == 0)
        const = c.constant_nbytes if layer == 0 else 0
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) + const
        fp16 = c.full_seq_bytes
        assert fp16 == sum(c.lens) * 2 * (64 + 64) * 2
        # the requests' arrays (0.31x here); the shared constants apart: they grow with what the process built
        # before (a GPU's decode kernel adds the rotation's transpose and 16-bit copies: 0.07x -> 0.11x here)
        assert c.nbytes - const < 0.35 * fp16, (c.nbytes - const) / fp16
        assert const < 0.15 * fp16, const / fp16
        for name in ("k_codes1", "k_codes2", "v_codes1"):
            assert getattr(c, name).dtype == mx.uint32
        assert c.k_norms.dtype == mx.float16 and c.k_norms.shape[2] == c.cap
        assert c.win_k.shape[2] == max(c.nw) < 128 + QUANT_BLOCK and c.sink_k.shape[2] == SINK_ROWS
        assert c.win_k.dtype == mx.float16 and c.size() == SINK_ROWS + max(c.nq) + max(c.nw)
    run.run()


def test_subclasses_other_methods_and_mixed_batches_refuse():
    def make(method="turboquant_rvq", **kw):
        return KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, **kw))

    assert TurboQuantRVQKVCache.batchable and not TurboQuantRVQBatchKVCache.batchable
    assert not CompressedKVCache.batchable and not tq.ResidualWindowCache.batchable

    class Sub(TurboQuantRVQKVCache):  # a subclass batches only if its own class body says so
        pass

    a, b = Sub(make().config), Sub(make().config)
    assert not Sub.batchable
    with pytest.raises(BatchingNotSupported):
        Sub.merge([a, b])
    with pytest.raises(BatchingNotSupported):
        TurboQuantRVQKVCache.merge([make(), a])  # a subclass in a turboquant_rvq batch
    for method in ("vecinfer", "skvq", "snapkv"):
        x, y = make(method), make(method)
        with pytest.raises(BatchingNotSupported):
            x.merge([x, y])
        with pytest.raises(BatchingNotSupported):
            TurboQuantRVQKVCache.merge([make(), x])
    with pytest.raises(BatchingNotSupported):  # different settings cannot share a code layout
        TurboQuantRVQKVCache.merge([make(), KVCacheFactory.create(
            KVCacheConfig(head_dim=64, options=TurboQuantRVQOptions(key_codebook_bits=10)))])


# ------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_batch_equals_alone():
    """The embedded SmolLM2-135M, default settings: 3 essay prompts (140-175 tokens) whose windows
    flush while decoding, 24 greedy decode steps batched by mlx_lm's BatchGenerator: the same tokens
    as each request alone through mlx_lm.stream_generate, and the extracted caches hold the same state."""

    def caches(model):
        return KVCacheBuilder.for_model(model, KVCacheConfig(method="turboquant_rvq"))

    # window flushes at decode steps 20, 10, 17
    alone = real_model_batch_equals_alone([(0, 140), (200, 350), (500, 675)], 24, caches, _same_state)
    for c in alone:
        assert c[0].n_sink == SINK_ROWS and c[0].n_quant >= 28
