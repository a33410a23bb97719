"""KIVI's batch form (``KIVIBatchKVCache``): mlx_lm's continuous batching (``BatchGenerator``) with
per-request KIVI caches gives each request what it gets alone (logits, tokens, codes), with requests
of different lengths, chunked and right-padded prefill, requests joining a running batch (extend),
leaving it (filter), and carrying history (merge of caches that already hold tokens); bytes held
stay compressed; the KIVI variants keep refusing to merge."""

from __future__ import annotations

import copy

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import BatchingNotSupported, KVCacheBuilder, KVCacheConfig, KVCacheFactory, dispatch
from veloxquant_mlx.cache.contract import CompressedKVCache
from veloxquant_mlx.cache.methods.quantization.kivi import KIVIKVCache
from veloxquant_mlx.cache.methods.quantization.kivi_batch import KIVIBatchKVCache

from batch_helpers import Run as _Run, batch_caches as _batch_caches, frac_off as _frac_off, joiners_with_history_equal_alone
from batch_helpers import attend_steps_equal_singles, check_against_alone, prompt as _prompt
from batch_helpers import real_model_batch_equals_alone
from tiny_models import tiny_llama

G = 32
QFIELDS = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")


def _caches(model, bits=4, install=True):
    return KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=bits),
                                    install_dispatch=install)


def _same_codes(a: KIVIKVCache, b: KIVIKVCache, exact=True, plain=None):
    """Same layout and codes. ``exact=False``: batched and unbatched runs differ only in float32 summation
    order (BLAS shapes, masked columns); where that moves a row across a rounding edge a code moves one
    level (measured on the embedded model: <= 0.2% of codes, a batch of one is bit-exact). ``plain``:
    mlx_lm's plain cache fed the same tokens; the residual rows, computed after those code moves, then
    differ by less than what quantizing every earlier row moved them from the unquantized rows."""
    assert type(a) is KIVIKVCache and type(b) is KIVIKVCache
    assert (a.offset, a.n_quant, a.n_res, a.qbits, a.group) == (b.offset, b.n_quant, b.n_res, b.qbits, b.group)
    g, w = a.n_quant // a.group, a._key_words()
    for name in QFIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if g == 0:
            continue
        if name.startswith("k"):
            n = g * (w if name == "k_codes" else 1)
            x, y = x[..., :n], y[..., :n]
        else:
            x, y = x[:, :, : a.n_quant], y[:, :, : a.n_quant]
        if exact:
            assert bool(mx.array_equal(x, y)), name
        elif name.endswith("codes"):  # a code may move one level where its row differs in its last bits
            assert float(mx.mean((x != y).astype(mx.float32))) < 1e-2, name
        else:  # scales/biases: nearly all equal to 1%; a few rows moved with codes flipped upstream
            assert _frac_off(x, y) < 1e-2, name
    for name in ("res_k", "res_v"):
        x, y = getattr(a, name)[:, :, : a.n_res], getattr(b, name)[:, :, : b.n_res]
        if not a.n_res:
            continue
        if exact:
            assert bool(mx.array_equal(x, y)), name
        elif plain is not None:
            assert plain.offset >= a.offset
            rows = (plain.keys if name == "res_k" else plain.values)[:, :, a.offset - a.n_res : a.offset]
            diff, bound = (float(mx.abs(y.astype(mx.float32) - z.astype(mx.float32)).max()) for z in (x, rows))
            assert diff <= bound, (name, diff, bound)
        else:  # float32 K/V that differ in their last bits (batched matmul shapes), after code flips upstream
            assert _frac_off(x, y) < 1e-2, name


def _same_inexact(extracted, alone):  # float32 summation order differs with the batch's widths
    _same_codes(extracted, alone, exact=False)


# ------------------------------------------------------------------------------------- tiny model
@pytest.mark.parametrize("use_dispatch", [True, False])
def test_batch_generator_equals_each_request_alone(use_dispatch):
    """4 prompts of different lengths (right-padded prefill, groups crossed in prefill and decode),
    prefilled in 64-token chunks, requests leaving at different steps (filter); with the dispatch
    point (attention on the codes) and without it (dense rows + the batch mask)."""
    model = tiny_llama()
    if not use_dispatch:
        dispatch.uninstall()
    lens, max_tokens = [45, 100, 71, 150], [40, 25, 40, 33]
    prompts = [_prompt(n, k) for k, n in enumerate(lens)]
    run = _Run(model, prefill_step_size=64)
    uids = run.insert(prompts, [_caches(model, install=use_dispatch) for _ in prompts], max_tokens)
    saw_batch = False
    while run.busy():
        run.step()
        kb = [c for c in _batch_caches(run.gen) if isinstance(c, KIVIBatchKVCache)]
        if len(run.gen._generation_batch) == 4:
            saw_batch = True
            c = kb[0]
            assert c.offset.tolist() == c.lens and len(c.lens) == 4
            assert c.res_k.shape[2] == max(c.nr) < G  # residual region bounded, common prefix sliced off
    assert saw_batch and dispatch.installed() == use_dispatch
    alone = [_caches(model, install=use_dispatch) for _ in prompts]
    check_against_alone(model, run, uids, prompts, max_tokens, alone, _same_inexact, prefill_step_size=64)


def test_request_joins_running_batch_and_history_is_merged():
    """Requests join a batch that is decoding (extend, empty caches next to full ones), one of them
    carrying a cache that already holds a prefix (merge with history); all equal their run alone."""
    model = tiny_llama()
    prefix, rest = _prompt(90, 2)[:66], _prompt(90, 2)[66:]
    reused = _caches(model)
    model(mx.array(prefix)[None], cache=reused)  # 66 tokens held: 2 groups + 2 residual rows
    # (attention itself agrees to ~1e-7 with masked slots: test_attend_on_ragged_batch_equals_each_single)
    joiners_with_history_equal_alone(model, lambda: _caches(model), reused, prefix, rest, _same_inexact)


@pytest.mark.parametrize("split", [False, True])
def test_attend_on_ragged_batch_equals_each_single(monkeypatch, split):
    """Random rows, ragged states (held history of 66 / 130 / 5 / 0 tokens), a right-padded prefill
    chunk, decode steps and a full chunk: the batch's attention (on the codes and through the dense
    rows + mask) equals each single cache's, and the codes equal."""
    if split:  # every long CPU step in parts on two streams (attention.cpu_cuts), the batch's as each single's
        from veloxquant_mlx.cache import attention
        for name, value in (("CPU_STREAMS", 2), ("CPU_SPLIT_MIN_ROWS", 64), ("CPU_SPLIT_DECODE_MIN_ROWS", 64)):
            monkeypatch.setattr(attention, name, value)
    mx.random.seed(0)
    D, H, Hq = 64, 2, 6

    def make():
        return KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=4, head_dim=D))

    singles = []
    for n in (66, 130, 5, 0):
        c = make()
        if n:
            c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        singles.append(c)
    batch = KIVIKVCache.merge([copy.deepcopy(c) for c in singles])
    steps = [(23, [23, 10, 23, 1]), (1, None), (1, None), (40, None), (1, None)]
    attend_steps_equal_singles(batch, singles, steps, H, Hq, D, tol_codes=1e-6, tol_dense=1e-5)
    assert batch.nq == [4, 5, 2, 1] and batch.nr == [4, 23, 7, 12] and batch.lens == [132, 183, 71, 44]
    for i, c in enumerate(singles):
        _same_codes(batch.extract(i), c)


def test_merge_extract_filter_extend_units():
    """The batch protocol on the cache itself: merge of held/empty caches, extract, filter, extend."""
    model = tiny_llama()
    held = []
    for k, n in enumerate([50, 97, 5]):
        c = _caches(model)
        model(mx.array(_prompt(n, k))[None], cache=c)
        held.append(c)
    empty = _caches(model)
    batch = [KIVIKVCache.merge([h[i] for h in held] + [empty[i]]) for i in range(len(empty))]
    b0 = batch[0]
    assert type(b0) is KIVIBatchKVCache and b0.nq == [1, 3, 0, 0] and b0.nr == [18, 1, 5, 0]
    assert b0.offset.tolist() == [50, 97, 5, 0] and b0.res_k.shape[2] == 18
    for i, h in enumerate(held):  # extract right after merge gives back the same cache
        _same_codes(b0.extract(i), h[0])
    assert b0.extract(3).empty()
    b0.filter([1, 2])
    assert b0.nq == [3, 0] and b0.nr == [1, 5] and b0.res_k.shape[2] == 5
    _same_codes(b0.extract(0), held[1][0])
    _same_codes(b0.extract(1), held[2][0])
    other = KIVIKVCache.merge([empty[0], copy.deepcopy(empty[0])])  # nothing stored yet
    assert other.empty()
    b0.extend(other)
    assert b0.nq == [3, 0, 0, 0] and b0.lens == [97, 5, 0, 0]
    _same_codes(b0.extract(1), held[2][0])
    assert b0.extract(2).empty()
    # mask: each sequence sees its own groups and residual rows and, causally, the new rows
    m = b0.make_mask(2)
    assert m.shape == (4, 1, 2, 3 * G + 5 + 2)
    assert m[1, 0, 0].tolist() == [False] * 3 * G + [True] * 5 + [True, False]
    assert m[0, 0, 1].tolist() == [True] * 3 * G + [False] * 4 + [True] * 3


def test_nbytes_compressed_and_no_float_copy():
    model = tiny_llama(head_dim=64, n_layers=2)
    prompts = [_prompt(n, k) for k, n in enumerate([600, 650, 690])]
    run = _Run(model, max_tokens=20)
    run.insert(prompts, [_caches(model) for _ in prompts], [20, 20, 20])
    for _ in range(12):
        run.step()
    batch = run.gen._generation_batch.prompt_cache
    assert len(batch[0].lens) == 3
    for c in batch:
        assert type(c) is KIVIBatchKVCache
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
        H, D, Dv = c._shape
        fp16 = sum(c.lens) * H * (D + Dv) * 2
        assert c.nbytes < 0.45 * fp16, c.nbytes / fp16
        # float arrays held: per-group scales/biases and a residual of fewer than G rows, nothing else
        for name in ("k_codes", "v_codes"):
            assert getattr(c, name).dtype == mx.uint32
        assert c.res_k.shape[2] < G and c.res_v.shape[2] < G
        assert c.k_scales.shape[-1] == c.cap and c.v_scales.shape[2] == c.cap * G
        assert c.v_scales.shape[-1] == Dv // G
    run.run()


def test_variants_and_mixed_batches_refuse():
    def make(method, **kw):
        return KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, **kw))

    assert KIVIKVCache.batchable and not CompressedKVCache.batchable and not KIVIBatchKVCache.batchable
    for method in ("kivi_sink", "kvquant", "gear"):
        a, b = make(method), make(method)
        assert isinstance(a, KIVIKVCache) and not type(a).batchable
        with pytest.raises(BatchingNotSupported):
            a.merge([a, b])
        with pytest.raises(BatchingNotSupported):
            KIVIKVCache.merge([make("kivi"), a])  # a variant in a KIVI batch
    with pytest.raises(BatchingNotSupported):  # different bits cannot share codes layout
        KIVIKVCache.merge([make("kivi", bit_width_inlier=4), make("kivi", bit_width_inlier=2)])


# ------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_batch_equals_alone():
    """The embedded SmolLM2-135M: 3 essay prompts (41-150 tokens), 24 greedy decode steps batched by
    mlx_lm's BatchGenerator: the same tokens as each request alone through mlx_lm.stream_generate,
    and the extracted caches hold the same codes."""
    # 24 steps (the CPU is slow with this model); every request crosses a group boundary while decoding
    real_model_batch_equals_alone([(0, 41), (200, 350), (500, 610)], 24, _caches, _same_codes, plain_reference=True)
