"""Waterfill's batch form (``WaterfillBatchKVCache``): mlx_lm's continuous batching (``BatchGenerator``)
with per-request waterfill caches gives each request what it gets alone (logits, tokens, calibration,
codes, window), with requests of different lengths that calibrate at different calls (in prefill, in
decode, with and without the queries of the dispatch point), right-padded prefill, windows flushing at
different steps, requests joining (extend, with history: merge) and leaving (filter); bytes held stay
compressed; subclasses and other settings keep refusing to merge."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.cache import BatchingNotSupported, KVCacheBuilder, KVCacheConfig, KVCacheFactory, dispatch
from veloxquant_mlx.cache.kernels import waterfill as wf_kernel
from veloxquant_mlx.cache.methods.quantization.waterfill import BLOCK, SINK_ROWS, WaterfillKVCache
from veloxquant_mlx.cache.methods.quantization.waterfill_batch import WaterfillBatchKVCache
from veloxquant_mlx.cache.options import WaterfillOptions

from batch_helpers import Run, attend_steps_equal_singles, batch_caches, check_against_alone, frac_off
from batch_helpers import joiners_with_history_equal_alone, prompt
from tiny_models import tiny_llama

R_TINY = 16  # a short window: flushes every 16 decode steps once calibrated


def _config(residual_length=R_TINY, bits=4, **kw):
    return KVCacheConfig(method="waterfill", bit_width_inlier=bits,
                         options=WaterfillOptions(residual_length=residual_length), **kw)


def _caches(model, install=True, **kw):
    return KVCacheBuilder.for_model(model, _config(**kw), install_dispatch=install)


def _same_state(a: WaterfillKVCache, b: WaterfillKVCache, exact=True):
    """Same counts, calibration (widths exactly, the saliency source) and stored rows. The query energies
    are float32 sums whose order differs with the batch's padded rows: within their rounding bound.
    ``exact=False``: batched runs differ in float32 summation order (BLAS shapes, masked columns); where
    that moves a row across a decision edge a code moves (well under 1% of codes)."""
    assert type(a) is WaterfillKVCache and type(b) is WaterfillKVCache
    assert (a.offset, a.n_sink, a.n_quant, a.n_win, a.q_count) == (b.offset, b.n_sink, b.n_quant, b.n_win, b.q_count)
    assert (a.saliency_source, a.calibrated, a.rope, a.counts_constants) == \
        (b.saliency_source, b.calibrated, b.rope, b.counts_constants)
    sa, sb = a.state, b.state
    for name in a.array_fields:
        x, y = sa[name], sb[name]
        if x is None or y is None:
            assert x is None and y is None or 0 in (x if x is not None else y).shape, name
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if name == "q_energy":  # sums of q_count positive float32 terms: worst-case rounding q_count * eps
            assert float(mx.abs(x - y).max()) <= a.q_count * 2.0**-23 * float(mx.abs(y).max()), name
        elif exact or name == "k_bits":
            assert bool(mx.array_equal(x, y)), name
        elif "words" in name:
            assert float(mx.mean((x != y).astype(mx.float32))) < 1e-2, name
        else:  # float16 ranges / scales / rows that differ in their last bits
            assert frac_off(x, y) < 1e-2, name


def _same_inexact(extracted, alone):
    _same_state(extracted, alone, exact=False)


# ------------------------------------------------------------------------------------- tiny model
@pytest.mark.parametrize("use_dispatch", [True, False])
def test_batch_generator_equals_each_request_alone(use_dispatch):
    """4 prompts of different lengths, right-padded prefill in 64-token chunks: the 100/150-token ones
    calibrate in prefill, the 45-token one in decode (after 64 rows) and the 71-token one at the end of its
    prefill; windows flush while decoding at different steps; requests leave at different steps (filter).
    With the dispatch point (queries weight the widths, attention on the codes) and without it (uniform
    weights, dense rows + the batch mask)."""
    model = tiny_llama()
    if not use_dispatch:
        dispatch.uninstall()
    lens, max_tokens = [45, 100, 71, 150], [40, 25, 40, 33]
    prompts = [prompt(n, k) for k, n in enumerate(lens)]
    run = Run(model, prefill_step_size=64)
    uids = run.insert(prompts, [_caches(model, install=use_dispatch) for _ in prompts], max_tokens)
    saw_batch, flushes_in_decode, calibrated_in_decode = False, 0, 0
    while run.busy():
        before = [(list(c.nq), list(c.src)) for c in batch_caches(run.gen)[:1] if isinstance(c, WaterfillBatchKVCache)]
        run.step()
        kb = [c for c in batch_caches(run.gen) if isinstance(c, WaterfillBatchKVCache)]
        if kb and len(run.gen._generation_batch) > 1:
            c = kb[0]
            saw_batch |= len(c.lens) == 4
            assert c.offset.tolist() == c.lens
            assert c.lens == [s + q + w for s, q, w in zip(c.ns, c.nq, c.nw)]
            assert all(w < R_TINY + BLOCK for w, s in zip(c.nw, c.src) if s)  # calibrated windows stay bounded
            if before and len(before[0][0]) == len(c.nq):  # a decode step of an unchanged batch
                flushes_in_decode += sum(b > a for a, b in zip(before[0][0], c.nq))
                calibrated_in_decode += sum(bool(b) > bool(a) for a, b in zip(before[0][1], c.src))
    assert saw_batch and dispatch.installed() == use_dispatch
    assert flushes_in_decode >= 2 and calibrated_in_decode >= 1
    alone = [_caches(model, install=use_dispatch) for _ in prompts]
    check_against_alone(model, run, uids, prompts, max_tokens, alone, _same_inexact, prefill_step_size=64)
    want = "attention" if use_dispatch else "uniform"
    assert all(c.saliency_source == want for u in uids for c in run.final[u])


def test_request_joins_running_batch_and_history_is_merged():
    """Requests join a batch that is decoding (extend, empty caches next to full ones), one of them
    carrying a calibrated cache that already holds a prefix (merge with history): all equal their run alone."""
    model = tiny_llama()
    prefix, rest = prompt(90, 2)[:70], prompt(90, 2)[70:]
    reused = _caches(model)
    model(mx.array(prefix)[None], cache=reused)  # 70 tokens: calibrated, 4 sinks, 44 codes, 22 window rows
    assert (reused[0].n_sink, reused[0].n_quant, reused[0].n_win, reused[0].calibrated) == (SINK_ROWS, 44, 22, True)
    joiners_with_history_equal_alone(model, lambda: _caches(model), reused, prefix, rest, _same_inexact)


def _rope_attn(D):
    return types.SimpleNamespace(rope=nn.RoPE(D, base=10000.0))


def _singles(H, D, held, Hq, n_calib=None, residual_length=R_TINY, bits=4):
    """Single caches (the layer's RoPE bound) holding ``held`` random rows, fed with queries through
    ``attend`` as the dispatch point does."""
    out = []
    for n in held:
        c = KVCacheFactory.create(KVCacheConfig(method="waterfill", head_dim=D, bit_width_inlier=bits,
                                                n_calib_tokens=n_calib,
                                                options=WaterfillOptions(residual_length=residual_length)))
        c.bind_attention(_rope_attn(D))
        if n:
            K, V = c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
            c.attend(mx.random.normal((1, Hq, n, D)), K, V, scale=0.125, mask="causal")
        out.append(c)
    return out


@pytest.mark.parametrize("bits, split", [(4, False), (2, False), (4, True)])
def test_attend_on_ragged_batch_equals_each_single(monkeypatch, bits, split):
    """Random rows with the layer's RoPE, ragged states (held history of 90 calibrated / 40 not / 3 / 0),
    right-padded prefill chunks (through the single cache's tiled chunk path), decode steps crossing
    flushes and calibrations, a full chunk: the batch's attention (on the codes, and through the dense
    rows + mask) equals each single cache's, and the extracted states equal theirs bit for bit (codes,
    calibration, rows). At 2 bits the key ranges are fitted (``fitted_range``), per sequence as alone."""
    if split:  # every long CPU step in parts on two streams (attention.cpu_cuts), the batch's as each single's
        from veloxquant_mlx.cache import attention
        for name, value in (("CPU_STREAMS", 2), ("CPU_SPLIT_MIN_ROWS", 64), ("CPU_SPLIT_DECODE_MIN_ROWS", 64)):
            monkeypatch.setattr(attention, name, value)
    chunks = []
    tiled = WaterfillBatchKVCache._attend_chunk
    monkeypatch.setattr(WaterfillBatchKVCache, "_attend_chunk", lambda self, q, *a, **k: chunks.append(
        (type(self), q.shape[2])) or tiled(self, q, *a, **k))
    mx.random.seed(0)
    D, H, Hq = 64, 2, 6
    singles = _singles(H, D, (90, 40, 3, 0), Hq, bits=bits)
    assert [c.calibrated for c in singles] == [True, False, False, False]
    batch = WaterfillKVCache.merge([copy.deepcopy(c) for c in singles])
    assert type(batch) is WaterfillBatchKVCache and batch.src == ["attention", "", "", ""]
    steps = [(23, [23, 10, 23, 1]), (1, None), (1, None), (40, None)] + [(1, None)] * 30 + \
            [(50, [50, 5, 37, 50]), (1, None), (1, None)]
    attend_steps_equal_singles(batch, singles, steps, H, Hq, D, tol_codes=1e-4, tol_dense=1e-3)
    assert chunks.count((WaterfillBatchKVCache, 23)) == chunks.count((WaterfillBatchKVCache, 50)) == 1
    assert batch.lens == [c.offset for c in singles] == [237, 129, 137, 125]
    assert batch.nq == [c.n_quant for c in singles] and batch.nw == [c.n_win for c in singles]
    assert all(c.calibrated for c in singles) and all(batch.src)
    assert len({tuple(np.array(c.k_bits).ravel()) for c in singles}) >= 2  # sequences with their own widths
    for i, c in enumerate(singles):
        _same_state(batch.extract(i), c)


def test_merge_extract_filter_extend_trim_units():
    """The batch protocol on the cache itself: merge of held (calibrated or not) and empty caches,
    extract, the mask layout, trim (as the single cache trims), state round trip, filter, extend."""
    mx.random.seed(1)
    D, H = 16, 2
    *held, empty = _singles(H, D, (50, 97, 5, 0), 4, n_calib=32)
    b = WaterfillKVCache.merge(held + [empty])
    assert b.ns == [4, 4, 0, 0] and b.nq == [28, 76, 0, 0] and b.nw == [18, 17, 5, 0] and b.cap == 76
    assert b.src == ["attention", "attention", "", ""] and b.offset.tolist() == [50, 97, 5, 0]
    for i, h in enumerate(held):  # extract right after merge gives back the same cache
        _same_state(b.extract(i), h)
    assert b.extract(3).empty()
    m = b.make_mask(2)  # each sequence: its sink rows, its code slots, its window rows, then causally the new rows
    assert m.shape == (4, 1, 2, 4 + 76 + 18 + 2)
    assert m[2, 0, 0].tolist() == [False] * 80 + [False] * 13 + [True] * 5 + [True, False]
    assert m[0, 0, 1].tolist() == [True] * 32 + [False] * 48 + [True] * 18 + [True] * 2
    t = copy.deepcopy(b)
    t.filter([0, 1, 2])
    singles = [copy.deepcopy(h) for h in held]
    with pytest.raises(ValueError):
        t.trim(6)  # a sequence holds 5 tokens
    assert t.trim(5) == 5 and all(s.trim(5) == 5 for s in singles)
    for i, s in enumerate(singles):
        _same_state(t.extract(i), s)
    t.filter([0, 1])
    singles = singles[:2]
    assert t.trim(30) == 30 and all(s.trim(30) == 30 for s in singles)  # into the codes of both
    assert t.nq == [11, 58] and t.nw == [0, 0]
    for i, s in enumerate(singles):
        _same_state(t.extract(i), s)
    r = WaterfillBatchKVCache.__new__(WaterfillBatchKVCache)  # mlx_lm's save/load_prompt_cache path
    r.state = t.state
    assert (r.ns, r.nq, r.nw, r.lens, r.src, r.rope) == (t.ns, t.nq, t.nw, t.lens, t.src, t.rope)
    _same_state(r.extract(1), singles[1])
    b.filter([1, 2])
    assert b.nq == [76, 0] and b.nw == [17, 5] and b.win_k.shape[2] == 17 and b.src == ["attention", ""]
    _same_state(b.extract(0), held[1])
    _same_state(b.extract(1), held[2])
    other = WaterfillKVCache.merge([copy.deepcopy(empty), copy.deepcopy(empty)])  # nothing stored yet
    b.extend(other)
    assert b.nq == [76, 0, 0, 0] and b.lens == [97, 5, 0, 0] and b.k_bits.shape[0] == 4
    _same_state(b.extract(1), held[2])
    assert b.extract(2).empty()
    other.extend(WaterfillKVCache.merge([copy.deepcopy(held[1])]))  # an empty batch extended by a full one
    assert other.lens == [0, 0, 97] and other.cap == 76
    _same_state(other.extract(2), held[1])


def test_nbytes_compressed_and_no_float_copy():
    """4 bits, window 16: the batch holds codes, scales, calibration, 4 sink rows and the window per
    request, nothing else; nbytes is the arrays held (plus the width layout) and well under float16."""
    model = tiny_llama(head_dim=64, n_layers=2)
    prompts = [prompt(n, k) for k, n in enumerate([600, 650, 700])]
    run = Run(model, max_tokens=12)
    run.insert(prompts, [_caches(model) for _ in prompts], [12, 12, 12])
    for _ in range(6):
        run.step()
    batch = run.gen._generation_batch.prompt_cache
    assert len(batch[0].lens) == 3
    for c in batch:
        assert type(c) is WaterfillBatchKVCache and all(c.src)
        arrays = sum(getattr(c, n).nbytes for n in c.array_fields) + c._layout.nbytes + c._omega_cache.nbytes
        kernel_tables = sum(a.nbytes for a in wf_kernel.held_constants(c))  # built on CUDA only (its decode kernel)
        for held in ("_kernel_counters", "_kernel_after"):  # the fused launches' counters, last output (CUDA only)
            kernel_tables += c.__dict__[held].nbytes if held in c.__dict__ else 0
        cpu_tables = c.__dict__.get("_cpuconst")  # the CPU kernel's (its decode steps here), memoised with k_lo
        if cpu_tables is not None:
            assert cpu_tables[0] is c.k_lo
            kernel_tables += sum(a.nbytes for a in cpu_tables[1:])
        assert c.nbytes == arrays + kernel_tables  # head dim 64: a fast Hadamard, no rotation matrix
        assert c.full_seq_bytes == sum(c.lens) * 2 * (64 + 64) * 2
        # 66 / 256 for the codes, plus windows, sinks, the slots of shorter sequences up to the longest one's
        # and decode's growth slack (measured 0.36)
        assert c.nbytes < 0.4 * c.full_seq_bytes, c.nbytes / c.full_seq_bytes
        assert c.k_words.dtype == c.v_words.dtype == mx.uint32 and c.v_scales.dtype == mx.float16
        assert c.k_words.shape[2] == c.cap >= max(c.nq) and c.k_words.shape[3] == 4 * 64 // 32
        assert c.win_k.shape[2] == max(c.nw) < R_TINY + BLOCK and c.sink_k.shape[2] == SINK_ROWS
        assert c.win_k.dtype == mx.float16 and c.size() == SINK_ROWS + max(c.nq) + max(c.nw)
    run.run()


def test_subclasses_and_other_settings_refuse():
    def make(**kw):
        return KVCacheFactory.create(_config(head_dim=64, **kw))

    assert WaterfillKVCache.batchable and not WaterfillBatchKVCache.batchable

    class Sub(WaterfillKVCache):  # a subclass batches only if its own class body says so
        pass

    a = Sub(make().config)
    with pytest.raises(BatchingNotSupported):
        Sub.merge([a, Sub(make().config)])
    with pytest.raises(BatchingNotSupported):
        WaterfillKVCache.merge([make(), a])
    for other in (make(bits=2), make(residual_length=32)):  # different layouts / windows
        with pytest.raises(BatchingNotSupported, match="settings"):
            WaterfillKVCache.merge([make(), other])


@pytest.mark.parametrize("traditional", [False, True])
def test_rotate_rows_per_row_offsets_equal_each_row_alone(traditional):
    """The batch encodes each sequence's rows at its own positions: ``rotate_rows`` with one offset per
    batch row gives every row the values it gets alone, bit for bit (the codes depend on them)."""
    from veloxquant_mlx.cache.primitives.rope import rope_frequencies, rope_spec, rotate_rows

    spec = rope_spec(nn.RoPE(32, traditional=traditional, base=10000.0))
    omega = rope_frequencies(spec)
    x = mx.random.normal((3, 2, 70, 32), key=mx.random.key(3))
    offsets = [4, 0, 131]
    for inverse in (False, True):
        out = rotate_rows(x, spec, omega, offsets, inverse=inverse)
        for i, p in enumerate(offsets):
            assert bool(mx.array_equal(out[i:i + 1], rotate_rows(x[i:i + 1], spec, omega, p, inverse=inverse)))


# ------------------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_batch_equals_alone():
    """The embedded SmolLM2-135M, 4 bits, window 16: 3 essay prompts (140-175 tokens, calibrated on
    their own queries in prefill, windows flushing while decoding), 24 greedy decode steps batched by
    mlx_lm's BatchGenerator: the same tokens as each request alone through mlx_lm.stream_generate, and
    the extracted caches hold the same widths, codes and rows (``exact=False``: summation order)."""

    def caches(model):
        return KVCacheBuilder.for_model(model, _config())

    from batch_helpers import real_model_batch_equals_alone

    alone = real_model_batch_equals_alone([(0, 140), (200, 350), (500, 675)], 24, caches, _same_state)
    for c in alone:
        assert c[0].saliency_source == "attention" and c[0].n_sink == SINK_ROWS and c[0].n_quant >= 112
