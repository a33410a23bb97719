"""The mlx_lm cache contract, once, for every mlx_lm-protocol method (the rows of tests/contract_table.py).

On a 4-layer tiny llama (head_dim 32) with each method's ``CONFIGS`` settings (compression happens on the
100-token prompt), driven by the model itself (the first check: by per-layer rows, as mlx_lm's layers):

- attention through the dispatch point equals dense attention over what update_and_fetch returned, with
  the mask mlx_lm builds from the cache (``contract_table.SPARSE_DECODE``: prefill calls only);

- ``nbytes`` is the bytes of the arrays each cache holds, at least its ``used_nbytes``;
- ``save_prompt_cache`` / ``load_prompt_cache`` and ``copy.deepcopy`` give caches of the same classes with
  the same offset, state arrays (bit for bit) and bytes, that continue bit-identically
  (and keep evolving identically), and are independent of the original;
- ``merge`` builds the method's batched form, from which ``extract`` gives each cache back, or refuses
  with BatchingNotSupported (a compressed form is never silently decompressed);
- a trim of the newest decode rows removes exactly them and continues like a cache that never saw them
  (per-step eviction: the rows they evicted stay evicted); a trim deep into compressed rows is refused
  with nothing changed, or exact; into evicted rows, refused;
- mlx_lm's own generation with a chunked prefill runs on llama, qwen2 and gemma3 (sliding-window layers
  keep their own caches) and every cache of the method ends at the logical offset;
- a prefill chunk's graph is built with no host sync (``contract_table.PREFILL_SYNCS``: the data-dependent
  exceptions), a decode step's with none at all, and a chunk holding NaN makes the cache's next calls raise.

Each method's defining property and its own edge cases stay in its own test module (every mask kind and
sinks: test_quant_contract.py; eviction against a reference that knows the kept positions:
test_eviction_contract.py and the eviction modules); chunk invariance and exact trims: test_chunk_invariance.py;
memory honesty against MLX's allocator: test_memory_honesty.py.
"""

from __future__ import annotations

import collections
import copy
import functools

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from contract_table import (COMPOSED, CONFIGS, CONTRACT_METHODS, D, LOAD_BUGS, PREFILL_SYNCS, TABLE, base_method,
                            layer_rows, method_class, with_known_bugs)
from tiny_models import ARCHS, VOCAB, greedy, tiny_llama
from veloxquant_mlx.cache import (BatchingNotSupported, CacheInputError, KVCacheBuilder, KVCacheConfig, contract,
                                  dispatch)
from veloxquant_mlx.cache.dispatch import dispatched_sdpa
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.cache.base import method_info
from veloxquant_mlx.cache.primitives import blocks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # shared flat fields (vecinfer)

PROMPT = [(i * 29 + 5) % VOCAB for i in range(100)]
DECODE = [3, 17, 42]  # decode steps after the prompt
NEXT = [7, 11, 64, 90]  # steps that continue the original, the loaded and the copied caches


@functools.cache
def model():
    return tiny_llama(head_dim=32, n_layers=4)


def build(method, m=None):
    fields = {**CONFIGS, **COMPOSED}[method]
    return KVCacheBuilder.for_model(m or model(), KVCacheConfig(method=base_method(method), **fields))


def prefilled(method, decode=DECODE):
    """Caches that saw the prompt (in one call, then the method's own pass if any) and ``decode`` steps."""
    caches = build(method)
    mx.eval(model()(mx.array([PROMPT]), cache=caches))
    if TABLE[method].prepare is not None:
        TABLE[method].prepare(model(), caches, PROMPT)
    for t in decode:
        mx.eval(model()(mx.array([[t]]), cache=caches))
    return caches


def step(caches, tokens):
    out = []
    for t in tokens:
        out.append(model()(mx.array([[t]]), cache=caches).astype(mx.float32))
        mx.eval(out[-1])
    return out


def held_nbytes(c):
    """The bytes of the arrays ``c`` holds (spare capacity included), plus the process-wide constants a
    cache counts where it says so (``counts_constants``: one cache per set of constants)."""
    return sum(a.nbytes for a in c.held_arrays()) + (c.constant_nbytes if getattr(c, "counts_constants", False) else 0)


def used_nbytes(c):
    """The bytes of the filled part, for a cache that keeps spare capacity (``used_nbytes``; else None)."""
    return getattr(c, "used_nbytes", None)


def state_of(caches):
    """The flattened state of every cache: what a prompt-cache file stores (mlx_lm >= 0.32: no meta_state)."""
    return [tree_flatten(c.state) for c in caches]


def assert_same_state(a, b):
    for sa, sb in zip(state_of(a), state_of(b)):
        assert [k for k, _ in sa] == [k for k, _ in sb]
        for (key, x), (_, y) in zip(sa, sb):
            if isinstance(x, mx.array):
                assert isinstance(y, mx.array) and (x.dtype, x.shape) == (y.dtype, y.shape), key
                assert bool(mx.array_equal(x, y)), key
            else:
                assert x == y, key
    assert [c.offset for c in a] == [c.offset for c in b]


def test_every_mlx_lm_method_has_a_row():
    assert sorted(TABLE) == sorted(CONTRACT_METHODS)


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_attention_equals_dense_attention_over_the_returned_rows_with_mlx_lm_masks(method):
    """Per layer and call, as mlx_lm runs them (one mask from layer 0, update_and_fetch, then the dispatch
    point): the cache's own attention equals dense attention over the rows update_and_fetch returned with
    that mask -- through prefill chunks, decode steps, and the compression / eviction between them."""
    caches, data, start = build(method), layer_rows(3, 125), 0
    assert dispatch.installed()
    for n in (70, 1, 1, 20, 1, 30, 1, 1):
        mask = create_attention_mask(mx.zeros((1, n, 1)), caches[0])
        for cache, (q, k, v) in zip(caches, data):
            sl = slice(start, start + n)
            K, V = cache.update_and_fetch(k[:, :, sl], v[:, :, sl])
            out = dispatched_sdpa(q[:, :, sl], K, V, cache=cache, scale=D**-0.5, mask=mask)
            ref = mx.fast.scaled_dot_product_attention(q[:, :, sl], K, V, scale=D**-0.5, mask=mask)
            assert out.shape == ref.shape and K.shape[2] == V.shape[2]
            if n > 1 or not TABLE[method].sparse_decode:  # float32 rows: only the summation order differs
                assert float(mx.abs(out - ref).max()) <= 1e-4 * max(1.0, float(mx.abs(V).max())), (start, n)
        start += n
        assert [c.offset for c in caches] == [start] * len(caches)


def test_gpu_decode_steps_over_the_returned_rows_give_the_cpu_paths_logits(monkeypatch):
    """Every method whose decode steps attend over the rows ``update_and_fetch`` returned on a GPU (KIVI-layout
    variants read through ``_keys_t`` / ``_values``: ``GroupedQuantCache._attends_returned_rows``; the low-rank
    caches and VecInfer; ZipCache's own attention scoring them), the cross-layer ones included, decodes the same
    logits as on the CPU path (the codes decoded again, or attended on their own form): ``blocks.on_cpu`` patched
    for the decode steps only; float32 rows, so only the summation order differs."""
    on_cpu, taken = blocks.on_cpu, []
    for method in CONTRACT_METHODS:
        outs = []
        for gpu in (True, False):
            caches = prefilled(method)
            monkeypatch.setattr(blocks, "on_cpu", lambda gpu=gpu: not gpu)
            rows = method == "zipcache" or getattr(caches[0], "_attends_returned_rows", lambda: False)()
            if gpu and not rows:
                break
            outs.append(step(caches, NEXT))
            monkeypatch.setattr(blocks, "on_cpu", on_cpu)
        monkeypatch.setattr(blocks, "on_cpu", on_cpu)
        if outs:
            taken.append(method)
            for a, b in zip(*outs):
                assert float(mx.abs(a - b).max()) <= 1e-4 * max(1.0, float(mx.abs(b).max())), method
    own = {"palu", "svdq", "kvtc", "vecinfer", "zipcache"}  # attending on their own form on the CPU
    assert {"gear", "kvquant", "skvq", "kivi_sink", "xquant", "xkv", "minicache"} | own <= set(taken), taken
    assert not {"kivi", "waterfill"} & set(taken), taken


@pytest.mark.parametrize("method", with_known_bugs(CONTRACT_METHODS, LOAD_BUGS))
def test_state_round_trip_deepcopy_nbytes_merge(method, tmp_path):
    caches = prefilled(method)
    n = len(PROMPT) + len(DECODE)
    assert all(type(c) is method_class(method) and c.offset == n for c in caches)
    for c in caches:
        assert c.nbytes == held_nbytes(c) >= (used_nbytes(c) or 0) and c.nbytes > 0
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    twin = copy.deepcopy(caches)
    assert [type(c) for c in loaded] == [type(c) for c in twin] == [type(c) for c in caches]
    assert [c.size() for c in loaded] == [c.size() for c in twin] == [c.size() for c in caches]
    assert all(x is not y for x, y in zip(twin, caches))
    assert_same_state(caches, loaded)
    assert_same_state(caches, twin)
    assert [used_nbytes(c) for c in loaded] == [used_nbytes(c) for c in twin] == [used_nbytes(c) for c in caches]
    for other in (twin, loaded):
        if TABLE[method].loaded_nbytes_equal:
            assert [c.nbytes for c in other] == [c.nbytes for c in caches]
        else:  # spare capacity, a per-step scratch: held, not saved (contract_table.LOADED_HOLDS_LESS)
            assert all(a.nbytes <= b.nbytes for a, b in zip(other, caches))
    if TABLE[method].merges:  # the batched form (its own tests: test_*_batch.py) gives each cache back
        merged = method_class(method).merge([caches[0], twin[0]])
        assert type(merged) is not method_class(method)
        assert all(type(merged.extract(i)) is method_class(method) and merged.extract(i).offset == n for i in (0, 1))
    else:
        with pytest.raises(BatchingNotSupported):
            method_class(method).merge(caches[:2])
    ref = step(caches, NEXT)  # the original runs first: the copies must not share its state
    assert [c.offset for c in twin] == [c.offset for c in loaded] == [n] * len(caches)
    for other in (loaded, twin):
        for a, b in zip(ref, step(other, NEXT)):
            assert bool(mx.array_equal(a, b))
    assert_same_state(caches, twin)  # evolved identically (row state, counters, statistics)
    assert_same_state(caches, loaded)


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_trim_of_the_newest_rows(method):
    caches = prefilled(method)
    n, sizes = len(PROMPT) + len(DECODE), [c.size() for c in caches]
    assert all(c.is_trimmable() for c in caches)
    assert [c.trim(2) for c in caches] == [2] * len(caches)  # decode rows: held at full precision
    assert [c.offset for c in caches] == [n - 2] * len(caches) and [c.size() for c in caches] == [s - 2 for s in sizes]
    if TABLE[method].newest_trim_exact:  # else the rows the trimmed steps evicted do not come back
        fresh = prefilled(method, DECODE[:-2])
        assert [c.size() for c in caches] == [c.size() for c in fresh]
        for a, b in zip(step(caches, NEXT), step(fresh, NEXT)):
            assert bool(mx.array_equal(a, b))
    evicts = method_info(base_method(method)).family == "eviction"
    for c in caches:  # deep into compressed or evicted rows: refused with nothing changed, or exact
        before = (c.offset, c.size())
        try:
            deep = c.trim(60)
        except ValueError:
            assert (c.offset, c.size()) == before
        else:
            assert not evicts, f"{method}: evicted rows cannot be trimmed back"
            assert deep == 60 and (c.offset, c.size()) == (before[0] - 60, before[1] - 60)


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_a_chunk_holding_nan_makes_the_next_calls_raise(method):
    """A prefill chunk with NaN keys is found without a host sync inside the graph: its flag is queued with
    ``mx.async_eval`` and read at the cache's next call, which raises naming the chunk's positions, as do the
    later ones."""
    c = prefilled(method, decode=())[0]
    n, (H, Dk, Dv) = c.offset, c._shape
    c.update_and_fetch(mx.full((1, H, 4, Dk), mx.nan), mx.zeros((1, H, 4, Dv)))
    for _ in range(2):
        with pytest.raises(CacheInputError, match=rf"NaN or Inf .*positions {n}\.\.{n + 3}\)"):
            c.update_and_fetch(mx.zeros((1, H, 1, Dk)), mx.zeros((1, H, 1, Dv)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_finiteness_flag_tells_nan_and_inf_from_any_finite_value(dtype):
    """``contract.all_finite`` (``sum(x * 0) == 0``): False for a NaN, +Inf or -Inf anywhere in either array, True for
    finite arrays however large their elements or sums (the dtype's largest value in every element)."""
    big = float(mx.finfo(dtype).max)
    x = mx.full((2, 3, 257, 16), big, dtype)
    y = mx.full((2, 3, 257, 8), -big, dtype)
    assert bool(contract.all_finite(x, y)) and bool(contract.all_finite(mx.zeros((1, 1, 0, 4), dtype), y))
    for bad in (mx.nan, mx.inf, -mx.inf):
        for which in (0, 1):
            arrays = [x, y]
            arrays[which] = arrays[which].at[1, 2, 200, 3].add(mx.array(bad, dtype) - arrays[which][1, 2, 200, 3])
            assert not bool(contract.all_finite(*arrays)), (bad, which)


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_prefill_chunks_build_their_graph_without_a_host_sync(method, monkeypatch):
    """A prefill chunk's graph is built without waiting for the device (a wait in every layer cost KIVI +90% of
    its prefill on the H200), apart from the bounded waits (the contract's, and ``primitives.blocks``' on the CPU)
    and the data-dependent shapes of ``PREFILL_SYNCS``. Detector: a model call traced by ``mx.compile`` raises on
    any host read of its arrays (eval, item, numpy); queued evaluations (``mx.async_eval``) are not waits and are
    stubbed out."""
    monkeypatch.setattr(contract, "queue_chunk_check", lambda flag, wait=True: None)
    monkeypatch.setattr(blocks, "wait_for", lambda arrays: None)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)
    m, caches, synced = model(), build(method), []
    for stage, tokens in (("first", PROMPT[:60]), ("second", PROMPT[60:])):
        traced = copy.deepcopy(caches)
        try:
            mx.compile(lambda t: m(t, cache=traced))(mx.array([tokens]))
        except Exception as err:  # noqa: BLE001 -- MLX's refusal to evaluate inside a transformation
            assert "eval" in str(err), err
            synced.append(stage)
        mx.eval(m(mx.array([tokens]), cache=caches))
    assert tuple(synced) == PREFILL_SYNCS.get(method, ((),))[0]


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_decode_steps_build_their_graph_without_a_host_sync(method, monkeypatch):
    """No method reads a value back during a decode step (mlx_lm pipelines the steps: a read would stall it);
    traced with ``mx.compile`` as in the prefill test, over the steps after the prompt and three decoded tokens."""
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)
    m, caches = model(), prefilled(method)
    for t in NEXT:
        traced = copy.deepcopy(caches)
        mx.compile(lambda x: m(x, cache=traced))(mx.array([[t]]))  # raises on a read-back
        mx.eval(m(mx.array([[t]]), cache=caches))


def test_prefill_checks_keep_at_most_layers_in_flight_queued(monkeypatch):
    """Each prefill chunk's check is queued, and the one queued LAYERS_IN_FLIGHT calls before is waited for:
    the device runs at most that many layers behind the graph being built."""
    monkeypatch.setattr(contract, "LAYERS_IN_FLIGHT", 3)
    monkeypatch.setattr(contract, "_in_flight", collections.deque())
    caches = build("kivi")
    mx.eval(model()(mx.array([PROMPT[:40]]), cache=caches))
    assert len(contract._in_flight) == 3 and len(caches) == 4  # 4 layers' checks queued, the first waited for
    assert all(c._finite_check is not None for c in caches)


def test_a_first_chunk_attended_exactly_waits_for_no_layer(monkeypatch):
    """A residual-window cache attends its first chunk on the chunk's own rows (nothing decoded), so that chunk's
    checks are queued without a wait; from its second chunk on each layer waits as above."""
    monkeypatch.setattr(contract, "LAYERS_IN_FLIGHT", 3)
    monkeypatch.setattr(contract, "_in_flight", collections.deque())
    caches, m = build("waterfill"), model()
    assert not type(caches[0]).first_chunk_waits and build("kivi")[0].first_chunk_waits
    mx.eval(m(mx.array([PROMPT[:40]]), cache=caches))
    assert len(contract._in_flight) == 0 and all(c._finite_check[1:] == (0, 40) for c in caches)
    mx.eval(m(mx.array([PROMPT[40:60]]), cache=caches))
    assert len(contract._in_flight) == 3 and all(c._finite_check[1:] == (40, 60) for c in caches)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_generate_with_chunked_prefill(method, arch):
    m = ARCHS[arch]()
    caches = build(method, m)
    out = greedy(m, PROMPT[:75], caches, max_tokens=6, prefill_step_size=16)  # 75 > prefill step
    assert len(out) == 6 and all(0 <= t < VOCAB for t in out)
    ours = [c for c in caches if isinstance(c, method_class(method))]
    assert ours and all(c.offset == 75 + 6 for c in ours)
    assert all(c.nbytes == held_nbytes(c) for c in ours)


def test_state_meta_is_built_once_per_config_and_follows_a_new_one(monkeypatch):
    """mlx_lm reads ``state`` after every prefill chunk, per layer: the config's JSON is made once per config
    object, and a cache given another config (a loaded state) writes that one."""
    import json

    calls = []
    real = contract.config_to_json
    monkeypatch.setattr(contract, "config_to_json", lambda c: calls.append(c) or real(c))
    c = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=3))
    c.update_and_fetch(mx.zeros((1, 2, 40, 32)), mx.zeros((1, 2, 40, 32)))
    first = [json.loads(json.loads(c.state["meta"])["config"]) for _ in range(3)]
    assert len(calls) == 1 and all(m["bit_width_inlier"] == 3 for m in first)
    c.config = KVCacheConfig(method="kivi", bit_width_inlier=4)
    assert json.loads(json.loads(c.state["meta"])["config"])["bit_width_inlier"] == 4 and len(calls) == 2
    twin = copy.deepcopy(c)
    assert json.loads(json.loads(twin.state["meta"])["config"])["bit_width_inlier"] == 4


@pytest.mark.parametrize("method", CONTRACT_METHODS)
def test_a_cache_trimmed_to_empty_takes_a_new_prompt(method):
    """``trim(offset)`` of a short prompt (nothing compressed or evicted yet) leaves an empty cache that takes a
    new prompt as a fresh one does (mlx_lm's prefix reuse with no shared prefix)."""
    m, caches, short = model(), build(method), PROMPT[:10]
    mx.eval(m(mx.array([short]), cache=caches))
    assert [c.trim(c.offset) for c in caches] == [len(short)] * len(caches)
    assert all(c.empty() and c.size() == 0 and c.offset == 0 for c in caches)
    out = m(mx.array([PROMPT[20:30]]), cache=caches)
    assert all(c.offset == 10 for c in caches)
    if all(type(c).exact_trim for c in caches):  # as a fresh cache, up to summation order (buffer capacities differ)
        ref = m(mx.array([PROMPT[20:30]]), cache=build(method))
        assert float(mx.abs(out - ref).max()) <= 1e-4 * float(mx.abs(ref).max())


EXACT_OR_RAISING = [m for m in CONTRACT_METHODS if method_class(m).trim_exact_or_raises]


@pytest.mark.parametrize("keep", [0, 32])
@pytest.mark.parametrize("method", EXACT_OR_RAISING)
def test_a_trim_into_fitted_groups_raises_or_is_exact(method, keep):
    """``trim_exact_or_raises``: a trim back to ``keep`` tokens of a 64-token prompt (whole quantized groups,
    some or all of those a basis, a channel ranking or a codebook was fitted on) raises ValueError, or leaves
    caches that continue as caches fed only those ``keep`` tokens (a fit on the trimmed rows does not survive; up to
    summation order: the buffers' capacities differ)."""
    m, caches = model(), build(method)
    mx.eval(m(mx.array([PROMPT[:64]]), cache=caches))
    step(caches, DECODE[:2])
    try:
        assert [c.trim(c.offset - keep) for c in caches] == [66 - keep] * len(caches)
    except ValueError:
        return
    fresh = build(method)
    if keep:
        mx.eval(m(mx.array([PROMPT[:keep]]), cache=fresh))
    for cs in (caches, fresh):
        mx.eval(m(mx.array([PROMPT[70:90]]), cache=cs))
    for a, b in zip(step(caches, NEXT), step(fresh, NEXT)):
        assert float(mx.abs(a - b).max()) <= 0.05  # a stale fit differs by ~1 or more


@pytest.mark.parametrize("method", ["kivi", "turboquant_rvq", "snapkv"])
def test_a_float16_additive_mask_at_the_dtype_minimum_hides_its_keys(method):
    """An additive float16 mask marks hidden keys with -inf or float16's minimum (-65504, what
    ``mx.finfo(mx.float16).min`` gives): both hide them, as in MLX's own attention."""
    c = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=32, **CONFIGS[method]))
    k, v, q = (mx.random.normal((1, 2, 40, 32)).astype(mx.float16) for _ in range(3))
    c.update_and_fetch(k, v)
    k, v, q = (mx.random.normal(s).astype(mx.float16) for s in ((1, 2, 6, 32), (1, 2, 6, 32), (1, 4, 6, 32)))
    visible = c.make_mask(6, return_array=True) & (mx.random.uniform(shape=(6, 46)) > 0.5) | (mx.eye(6, 46, 40) > 0)
    mask = mx.where(visible, 0.0, mx.finfo(mx.float16).min).astype(mx.float16)
    K, V = c.update_and_fetch(k, v)
    out = dispatched_sdpa(q, K, V, cache=c, scale=32 ** -0.5, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=32 ** -0.5, mask=visible)
    assert float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max()) < 1e-2
