"""The mlx_lm cache contract, once, for every KIVI-family / vector-quantization method.

Methods: kivi_sink, kitty, skvq, age_tiered, zipcache (test_quant_variants.py), kvquant, gear, adakv
(test_quant_mixed.py), cachegen, amc (test_cachegen_amc.py), anchorkv, nsnquant (test_anchor_nsn.py),
vecinfer, a2ats (test_vq_methods.py), waterfill (test_waterfill.py). Those modules keep each method's defining property and byte
formulas, and build their caches with ``make`` / ``config`` from the table (tests/contract_table.py).

Contract checked here for every method: the factory builds the method's class (no ``bits`` attribute),
bad settings raise QuantizerConfigError naming the field, attention through the dispatch point equals
dense attention over what update_and_fetch returned (every mask kind, with and without sinks), the
dense path without the dispatch point gives the same logits, mlx_lm generation with chunked prefill on
tiny llama/qwen2/gemma3, trim is exact or refused (save/load_prompt_cache, deepcopy, nbytes and merge, for
every mlx_lm method: test_contract.py). KIVI-layout methods (``group``)
also keep whole quantized groups plus a float16 residual, trim whole groups exactly, and hold their
bytes-per-token budget."""

from __future__ import annotations

import warnings

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, QuantizerConfigError, dispatch, native
from veloxquant_mlx.cache.grouped import GroupedQuantCache
from veloxquant_mlx.cache.primitives import blocks

from contract_table import (KIVI_LAYOUT, SPECS, TOKENS, caches_for, fill, make, method_class, model_of, rand,
                            run_chunks, sdpa)
from contract_table import QUANT_METHODS as METHODS
from numerics import rounding_bounds
from tiny_models import ARCHS, VOCAB, greedy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vecinfer: key_sub_dim etc. are flat fields


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


def _kivi_layout(c, rows):
    """KIVI layout: whole groups quantized, the rest in the float16 residual."""
    G = SPECS[type(c).method_name].group
    if G:
        assert (c.n_quant, c.n_res) == (rows // G * G, rows % G), (c.n_quant, c.n_res, rows)


# ------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("method", METHODS)
def test_factory_builds_the_method_class_without_bits(method):
    c = make(method)
    assert type(c) is method_class(method) and type(c).method_name == method and not hasattr(c, "bits")


@pytest.mark.parametrize("method,kw,name", [(m, kw, name) for m in METHODS for kw, name in SPECS[m].invalid])
def test_invalid_setting_names_its_field(method, kw, name):
    with pytest.raises(QuantizerConfigError) as e:
        make(method, **kw)
    assert e.value.field == name


# ------------------------------------------------------------------------------------- attention
# every mask kind: mlx_lm's "causal" string, None (one row), its boolean array, that array with random
# holes (the diagonal kept), and an additive float mask
CASES = [(70, "causal"), (1, None), (1, None), (20, "random"), (1, None), (9, "additive"), (1, None), (20, "array"),
         (1, None), (40, "causal"), (1, None)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_attend_through_dispatch_equals_dense_attention(method, use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    cache = make(method, **SPECS[method].dense_kw)
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = cache.stored_rows()
        if kind == "random":
            mask = cache.make_mask(n, return_array=True)
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            mask = mx.where(cache.make_mask(n, return_array=True), 0.0, -mx.inf)
        else:
            mask = cache.make_mask(n, return_array=kind == "array")
        K, V = cache.update_and_fetch(k, v)
        assert K.shape[2] == past + n
        assert bool(mx.array_equal(K[:, :, past:], k)) and bool(mx.array_equal(V[:, :, past:], v))
        out = dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask, sinks=sinks)
        ref = sdpa(q, K, V, mask, scale, sinks)
        assert out.shape == (B, Hq, n, D)
        assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert cache.offset == sum(n for n, _ in CASES) == cache.stored_rows()
    _kivi_layout(cache, cache.offset)
    dk, dv = cache._dense()  # the stored form, in position order
    assert dk.shape == (B, H, cache.offset, D) and dv.shape == dk.shape


def _rows_on_gpu(method) -> bool:
    """Whether ``method``'s decode steps attend over the returned rows (``_attends_returned_rows``; on a GPU when
    ``blocks.on_cpu`` says so)."""
    return getattr(make(method), "_attends_returned_rows", lambda: False)()


def _gpu_rows_methods() -> list:
    """The methods whose decode steps would attend over the returned rows on a GPU (``blocks.on_cpu`` faked)."""
    on_cpu, blocks.on_cpu = blocks.on_cpu, lambda: False
    try:
        with warnings.catch_warnings():  # at collection, outside ``pytestmark``'s filter (vecinfer's flat fields)
            warnings.simplefilter("ignore", DeprecationWarning)
            return [m for m in METHODS if hasattr(method_class(m), "_attends_returned_rows") and _rows_on_gpu(m)]
    finally:
        blocks.on_cpu = on_cpu


def _own_code_attention(method) -> bool:
    """Whether ``method`` scores its codes with attention of its own on the CPU (VecInfer's LUT scores), so that a
    GPU step over the returned rows saves that attention rather than a second decoding."""
    return method_class(method)._key_scores is not GroupedQuantCache._key_scores


def test_which_variants_attend_over_the_returned_rows_on_a_gpu(monkeypatch):
    """The variants whose codes only ``_keys_t``/``_values`` read take the rows on a GPU (measured: GEAR, SKVQ,
    KIVI-sink, Kitty, KVQuant), and VecInfer instead of its LUT scores; KIVI's own codes (its kernels,
    ``quantized_matmul``), waterfill's and A2ATS's, and ZipCache (its saliency needs the joint softmax's weights; it
    scores the returned rows in its own attention) do not; on the CPU none does."""
    monkeypatch.setattr(blocks, "on_cpu", lambda: False)
    taken = {m for m in METHODS if _rows_on_gpu(m)}
    assert {"gear", "skvq", "kivi_sink", "kitty", "kvquant", "vecinfer"} <= taken
    assert not taken & {"waterfill", "a2ats", "zipcache"}  # zipcache: the weights of its pending rows
    kivi = KVCacheFactory.create(KVCacheConfig(method="kivi", head_dim=64))
    assert not kivi._attends_returned_rows()
    monkeypatch.setattr(blocks, "on_cpu", lambda: True)
    assert not any(_rows_on_gpu(m) for m in METHODS)


def _steps_on_gpu_and_cpu(method, monkeypatch, second_chunk: bool, counted: str = "_keys_t", new=None):
    """A cache (``new()``, else the table's ``make(method)``) given 300 attended rows (and a 40-row chunk after
    them), then three decode steps, first with ``blocks.on_cpu`` patched to say GPU, then CPU; the steps' outputs
    agree to float32 rounding (float32 throughout). Returns each way's number of calls of the method ``counted``
    (the key decoding) during the steps and its cache."""
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    monkeypatch.setattr(native, "_ENV_ON", False)  # the op paths (KIVI's CPU kernel takes kivi_sink's, age_tiered's)
    cls = method_class(method)
    own, decoded = getattr(cls, counted), []
    monkeypatch.setattr(cls, counted, lambda c, *a, **k: decoded.append(1) or own(c, *a, **k))
    outs, counts, caches = [], [], []
    for gpu in (True, False):
        monkeypatch.setattr(blocks, "on_cpu", lambda gpu=gpu: not gpu)
        mx.random.seed(3)
        cache = new() if new else make(method)
        K, V = cache.update_and_fetch(rand(B, H, 300, D), rand(B, H, 300, D))
        mx.eval(dispatch.dispatched_sdpa(rand(B, Hq, 300, D), K, V, cache=cache, scale=scale, mask="causal"))
        if second_chunk:
            cache.update_and_fetch(rand(B, H, 40, D), rand(B, H, 40, D))  # a chunk after the queries were seen
        decoded.clear()
        got = []
        for _ in range(3):
            K, V = cache.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
            got.append(dispatch.dispatched_sdpa(rand(B, Hq, 1, D), K, V, cache=cache, scale=scale, mask=None))
        mx.eval(got)
        assert cache.n_quant > 0  # the steps attended a compressed past
        outs.append(got)
        counts.append(len(decoded))
        caches.append(cache)
    for a, b in zip(*outs):
        assert a.shape == (B, Hq, 1, D) and float(mx.abs(a - b).max()) < 1e-4
    return counts, caches


@pytest.mark.parametrize("method", [m for m in _gpu_rows_methods() if not _own_code_attention(m)])
def test_gpu_decode_step_decodes_the_codes_once(method, monkeypatch):
    """With ``blocks.on_cpu`` patched to say GPU, a decode step of a variant attending over the returned rows
    decodes its keys once fewer than the CPU path (rows, then its joint softmax: [3, 6] over three steps; on CUDA
    KVQuant's rows kernel decodes the rows without ``_keys_t``: [0, 3]), and both give the same attention (float32
    throughout: rounding only)."""
    counts, _ = _steps_on_gpu_and_cpu(method, monkeypatch, second_chunk=True)
    assert counts[1] - counts[0] == 3 and counts[1] in (3, 6), counts


@pytest.mark.parametrize("method", ["svdq", "kvtc"] + [m for m in _gpu_rows_methods() if _own_code_attention(m)])
def test_gpu_decode_steps_of_own_code_attentions_take_the_returned_rows(method, monkeypatch):
    """The low-rank caches (latents; Palu, which needs a model's layer, in tests/test_contract.py) and VecInfer (LUT
    scores) attend on their own codes on the CPU; on a GPU a decode step attends over the returned rows with the
    fused sdpa (H200: Palu 22 -> 44 tok/s, VecInfer 18 -> 58): no ``_attend_codes`` call there, the same outputs."""
    from veloxquant_mlx.cache import options as O

    opts = {"svdq": O.SVDqOptions(group_size=16), "kvtc": O.KVTCOptions(bit_budget=64)}.get(method)
    new = (lambda: KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, options=opts))) if opts else None
    counts, _ = _steps_on_gpu_and_cpu(method, monkeypatch, second_chunk=True, counted="_attend_codes", new=new)
    assert counts == [0, 3], counts


@pytest.mark.parametrize("method", _gpu_rows_methods() + ["svdq", "kvtc", "zipcache"])
def test_a_long_cpu_decode_step_decodes_a_variants_values_on_a_second_stream(method, monkeypatch):
    """A variant decoding its whole past (``_keys_t`` / ``_values`` of its own; the low-rank caches' latents; ZipCache,
    whose own attention takes the same part on the CPU) builds, past ``CPU_SPLIT_DECODE_MIN_ROWS`` quantized rows and
    with two CPU streams, its values' side on a second stream (MLX runs each CPU stream on one thread) while the
    current one scores the keys; below the threshold both on the current one; the attention equals the stored rows'
    either way."""
    from veloxquant_mlx.cache import attention
    from veloxquant_mlx.cache import options as O

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the split is the CPU backend's")
    monkeypatch.setattr(attention, "CPU_STREAMS", 2)
    monkeypatch.setattr(attention, "CPU_SPLIT_DECODE_MIN_ROWS", 128)
    monkeypatch.setattr(native, "_ENV_ON", False)  # the op path (KIVI's CPU kernel takes kivi_sink's, age_tiered's)
    cls, seen = method_class(method), []
    for name in ("_key_scores", "_value_side"):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda s, q_or_n, *a, _r=real, _n=name, **k:
                            seen.append((_n, mx.default_stream(mx.cpu))) or _r(s, q_or_n, *a, **k))
    opts = {"svdq": O.SVDqOptions(group_size=16), "kvtc": O.KVTCOptions(bit_budget=64)}.get(method)
    c = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64, options=opts)) if opts else make(method)
    main = mx.default_stream(mx.cpu)
    for rows in (96, 224):  # quantized rows below, then above the threshold
        c.update_and_fetch(rand(1, 2, rows - c.offset, 64), rand(1, 2, rows - c.offset, 64))
        q = rand(1, 4, 1, 64)
        K, V = c.update_and_fetch(rand(1, 2, 1, 64), rand(1, 2, 1, 64))
        seen.clear()
        got = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=0.125, mask=None)
        want = sdpa(q, K, V, None, 0.125)
        split = c.n_quant >= 128
        assert split == (rows == 224), c.n_quant
        assert seen[0] == ("_key_scores", main) and seen[-1][0] == "_value_side", seen
        assert (seen[-1][1] != main) == split, seen
        assert float(mx.abs(got - want).max()) <= 1e-4 * float(mx.abs(want).max()), rows
        c.trim(1)


def test_zipcache_gpu_steps_score_the_returned_rows(monkeypatch):
    """ZipCache keeps its own attention (its saliency needs each step's weights of the pending rows), but on a GPU
    its compressed past is scored on the rows ``update_and_fetch`` returned: one decoding of the keys a step instead
    of two, the same outputs and the same saliency sums as the CPU path (float32: rounding only)."""
    counts, caches = _steps_on_gpu_and_cpu("zipcache", monkeypatch, second_chunk=False)
    assert counts == [3, 6], counts
    assert all(c.saliency_source == "attention" for c in caches)
    gpu, cpu = (c.sal_sum[:, :, : c.n_res] for c in caches)
    assert gpu.shape == cpu.shape and float(mx.abs(gpu - cpu).max()) < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_dense_path_without_dispatch_same_logits(method):
    """Without the dispatch point mlx_lm attends over the dense rows update_and_fetch returns."""
    model, chunks, kw = model_of(), [70, 1, 1, 1, 20, 1, 16, 1], SPECS[method].dense_kw
    dispatch.install()
    ca = caches_for(model, method, **kw)
    a = run_chunks(model, ca, TOKENS, chunks)
    dispatch.uninstall()
    cb = caches_for(model, method, install=False, **kw)
    b = run_chunks(model, cb, TOKENS, chunks)
    if SPECS[method].query_saliency:
        assert (ca[0].saliency_source, cb[0].saliency_source) == ("attention", SPECS[method].fallback_source)
        a, b = a[:1], b[:1]  # the prompt attends itself in full precision either way
    # the paths sum in different orders; a stored row on a float16 rounding edge then moves by an ulp, and
    # an element on a quantization boundary may round to the neighbouring code (seen for kvquant with
    # OpenBLAS off: 0.023 on one chunk); both are bounded by what the run itself measures (tests/numerics.py)
    for x, y, tol in zip(a, b, rounding_bounds(model, TOKENS, chunks, b)):
        assert float(mx.abs(x - y).max()) <= tol


# ------------------------------------------------------------------------------------- mlx_lm use
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_chunked_prefill(method, arch):
    model = model_of(arch)
    caches = caches_for(model, method)
    out = greedy(model, TOKENS[:75], caches, max_tokens=10, prefill_step_size=16)  # 75 > prefill step
    assert len(out) == 10 and all(0 <= t < VOCAB for t in out)
    ours = [c for c in caches if isinstance(c, method_class(method))]
    assert ours and all(type(c).method_name == method for c in ours)
    for c in ours:
        assert c.offset == 75 + 10 and c.stored_rows() == c.offset
        _kivi_layout(c, c.offset)


# ------------------------------------------------------------------------------------- trim
@pytest.mark.parametrize("method", [m for m in METHODS if m not in KIVI_LAYOUT])  # those: the test below
def test_trim_exact_or_refused(method):
    k, v = rand(1, 2, 130, 64, dtype=mx.float16), rand(1, 2, 130, 64, dtype=mx.float16)

    def fed(chunks):
        c, i = make(method), 0
        for m in chunks:
            c.update_and_fetch(k[:, :, i : i + m], v[:, :, i : i + m])
            i += m
        return c

    c = fed([115] + [1] * 10)
    assert c.trim(3) == 3  # the newest rows are full precision in every method: exact
    ref = fed([115] + [1] * 7)
    assert c.offset == ref.offset == c.stored_rows()
    for x, y in zip(c._dense(), ref._dense()):
        assert bool(mx.array_equal(x, y))
    before, deep = c.offset, SPECS[method].deep_trim
    if deep == "refuse":
        with pytest.raises(ValueError):
            c.trim(77)
        assert c.offset == before
    elif deep == "exact":
        assert c.trim(77) == 77 and c.offset == 45
        for x, y in zip(c._dense(), fed([45])._dense()):
            assert bool(mx.array_equal(x, y))
    else:
        try:
            c.trim(77)
        except ValueError:
            assert c.offset == before  # refused: unchanged
        else:
            assert c.offset == 45


@pytest.mark.parametrize("method", KIVI_LAYOUT)
def test_trim_whole_groups_exact_partial_groups_refused(method):
    D = 64
    k, v = rand(1, 2, 136, D), rand(1, 2, 136, D)

    def fed(*chunks):
        c, i = make(method), 0
        for n in chunks:
            c.update_and_fetch(k[:, :, i : i + n], v[:, :, i : i + n])
            i += n
        return c

    def same(a, b):
        assert (a.offset, a.n_quant, a.n_res) == (b.offset, b.n_quant, b.n_res)
        for x, y in zip(a._dense(), b._dense()):
            assert bool(mx.array_equal(x, y))

    c = fed(104)
    assert c.trim(5) == 5
    same(c, fed(99))
    with pytest.raises(ValueError):
        c.trim(20)  # cuts into a quantized group
    c = fed(96, 32)  # 96 quantized by the prefill, group 3 by the second block
    assert c.trim(32) == 32
    same(c, fed(96))
    c = fed(104)
    assert c.trim(104) == 104 and c.empty()
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    same(c, fed(40))


# ------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("method", [m for m in KIVI_LAYOUT if SPECS[m].budget is not None])
def test_bytes_per_token_budget(method):
    B, H, D, T = 1, 2, 64, 4096
    cache = fill(make(method), B, H, D, T)
    assert cache.n_quant == T and cache.nbytes == sum(a.nbytes for a in cache.held_arrays())
    assert cache.used_nbytes <= cache.nbytes <= 1.2 * cache.used_nbytes
    measured = cache.used_nbytes / (B * H * T)
    budget = cache.bytes_per_token_budget(D, D)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert budget == pytest.approx(SPECS[method].budget)
    assert {a: getattr(cache, a) for a in SPECS[method].resolved} == SPECS[method].resolved


def _short_path_cache(method, D):
    from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory
    from veloxquant_mlx.cache.options import WaterfillOptions

    options = {"waterfill": WaterfillOptions(residual_length=16)}.get(method)
    return KVCacheFactory.create(KVCacheConfig(method=method, bit_width_inlier=4, head_dim=D, n_calib_tokens=32,
                                               options=options))


@pytest.mark.parametrize("method", ["kivi", "waterfill", "turboquant_rvq"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_decode_rows_take_the_short_path_and_store_what_the_full_one_does(method, dtype, monkeypatch):
    """One-row calls that complete no group / compact nothing skip ``_check_input`` and ``_store``
    (``_decode_step`` of the KIVI and residual-window layouts); across group completions or compactions, a trim
    and a wrong-shaped row they return, store and attend exactly as the full path does."""
    from veloxquant_mlx.cache.grouped import GroupedQuantCache
    from veloxquant_mlx.cache.window import ResidualWindowCache

    H, D, n = 2, 64, 101
    short, full = _short_path_cache(method, D), _short_path_cache(method, D)
    layout = GroupedQuantCache if isinstance(short, GroupedQuantCache) else ResidualWindowCache
    stores = []
    base_store = layout._store
    monkeypatch.setattr(layout, "_store", lambda self, k, v: (stores.append(id(self)), base_store(self, k, v)))
    full._step_fits = lambda step: False
    mx.random.seed(3)
    rows = [mx.random.normal((1, H, 1, D)).astype(dtype) for _ in range(2 * n)]
    queries = [mx.random.normal((1, 2 * H, 1, D)).astype(dtype) for _ in range(2 * n)]
    prompt = mx.random.normal((1, H, 39, D)).astype(dtype)
    for c in (short, full):
        c.update_and_fetch(prompt, prompt * 0.5)
    for i in range(2 * n):
        if i == n:
            assert short.trim(3) == full.trim(3) == 3
        got = []
        for c in (short, full):
            K, V = c.update_and_fetch(rows[i], rows[i] * 0.5)
            got.append((K, V, dispatch.dispatched_sdpa(queries[i], K, V, cache=c, scale=D**-0.5, mask=None)))
        for a, b in zip(*got):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
    for a, b in zip(short.state, full.state):
        assert mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
    assert short.offset == full.offset == 39 + 2 * n - 3
    took_full = stores.count(id(short))
    assert 0 < took_full <= 2 * n // 16 + 4 < stores.count(id(full))  # the short path took most rows
    with pytest.raises(Exception, match="head_dim|holds|dim"):
        short.update_and_fetch(mx.zeros((1, H, 1, D // 2), dtype), mx.zeros((1, H, 1, D // 2), dtype))


@pytest.mark.parametrize("method", ["kivi", "waterfill", "turboquant_rvq"])
def test_short_decode_path_still_refuses_rows_after_a_nonfinite_chunk(method):
    """A chunk holding NaN makes every later call raise until it is trimmed, the short decode path's too."""
    from veloxquant_mlx.cache.errors import CacheInputError

    H, D = 2, 64
    c = _short_path_cache(method, D)
    row = mx.ones((1, H, 1, D))
    c.update_and_fetch(mx.random.normal((1, H, 40, D)), mx.random.normal((1, H, 40, D)))
    for _ in range(2):
        c.update_and_fetch(row, row)  # checked one-row calls: the next ones may take the short path
    bad = mx.ones((1, H, 4, D)).at[0, 0, 1, 3].add(mx.array(float("nan")))
    c.update_and_fetch(bad, bad)
    for _ in range(2):
        with pytest.raises(CacheInputError, match="NaN or Inf"):
            c.update_and_fetch(row, row)
    c.trim(c.offset - 42)
    K, _ = c.update_and_fetch(row, row)
    assert K.shape[2] == 43 and mx.all(mx.isfinite(K)).item()
