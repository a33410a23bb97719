"""Query-aware eviction methods: Q-Filters, KVzip, CurDKV, NestedKV, RocketKV.

For each: decode attention equals dense attention over exactly the rows it keeps (per head), memory
stays bounded over a long decode (trim/state/deepcopy/merge: test_contract.py), real queries (through
the dispatch point) keep what real attention concentrates on where the fallback does not, and the
paper's defining property holds on synthetic data."""

import math
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from contract_table import gather, layer_call
from tiny_models import VOCAB, greedy, tiny_gemma3, tiny_llama
from veloxquant_mlx.cache import (KVCacheBuilder, KVCacheConfig, KVCacheFactory,
                                  QuantizerConfigError, dispatch)
from veloxquant_mlx.cache.methods.eviction.curdkv import leverage_scores
from veloxquant_mlx.cache.methods.eviction.kvzip import KVzipKVCache, kvzip_compress
from veloxquant_mlx.cache.methods.eviction.qfilters import QFiltersRetentionError
from veloxquant_mlx.cache.options import CurDKVOptions, KVzipOptions, NestedKVOptions, QFiltersOptions, RocketKVOptions

B, HQ, H, D = 2, 4, 2, 16
F32 = mx.float32
SCALE = D**-0.5

OPTIONS = {
    "qfilters": lambda **kw: QFiltersOptions(**{"budget": 16, "n_sink": 2, "calib_tokens": 16, "min_retention": None,
                                                 **kw}),
    "kvzip": lambda **kw: KVzipOptions(**{"budget": 16, "n_sink": 2, **kw}),
    "curdkv": lambda **kw: CurDKVOptions(**{"budget": 16, "n_sink": 2, "rank_cap": 4, **kw}),
    "nestedkv": lambda **kw: NestedKVOptions(**{"budget": 16, "n_sink": 2, "window": 4, **kw}),
    "rocketkv": lambda **kw: RocketKVOptions(**{"compression_ratio": 4.0, "n_sink": 2, "obs_window": 4, **kw}),
}
BOUNDED = ["qfilters", "kvzip", "curdkv", "nestedkv"]  # evict while decoding (rocketkv keeps decode rows)
ALL = BOUNDED + ["rocketkv"]


def config(method, dtype=F32, **kw):
    return KVCacheConfig(method=method, options=OPTIONS[method](**kw), dtype=dtype)


def make(method, **kw):
    return KVCacheFactory.create(config(method, **kw))


def needle_data(T=128, needles=(40, 63, 87, 110)):
    """Real queries all point along u; needle keys point along +u, every other key along -u (by a
    varying amount) and along a common offset w. Real attention concentrates on the needles; keys used
    as queries (the fallback) attend to the anti-needles instead."""
    mx.random.seed(2)
    u = mx.zeros((D,)).at[0].add(1.0)
    K = mx.random.normal((1, 1, T, D)) * 0.3
    K = K.at[..., 0].add(-mx.abs(mx.random.normal((1, 1, T))) * 3 - K[..., 0]).at[..., 1].add(3.0)
    for i in needles:
        K = K.at[0, 0, i, 0].add(4.0 - K[0, 0, i, 0])
    return mx.broadcast_to(u * 6.0, (1, 1, T, D)), K, mx.random.normal((1, 1, T, D)), set(needles)


# ---------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("use_dispatch", [True, False])
@pytest.mark.parametrize("method", BOUNDED)
def test_each_step_attends_exactly_the_kept_rows_per_head(method, use_dispatch):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    mx.random.seed(1)
    cache = make(method)
    T, steps = 40, 14  # budget 16 + slack 8: decode evicts at least once
    K, V = mx.random.normal((B, H, T + steps, D)), mx.random.normal((B, H, T + steps, D))
    Q = mx.random.normal((B, HQ, T + steps, D))
    out = layer_call(cache, Q[:, :, :T], K[:, :, :T], V[:, :, :T])  # prefill: dense causal
    assert mx.allclose(out, mx.fast.scaled_dot_product_attention(Q[:, :, :T], K[:, :, :T], V[:, :, :T],
                                                                  scale=SCALE, mask="causal"), atol=1e-5)
    sizes = []
    for t in range(T, T + steps):
        pos = cache.positions[:, :, : cache.size()]
        assert mx.all(pos[..., 1:] > pos[..., :-1]) and mx.all(pos[..., :2] == mx.array([0, 1]))
        assert mx.array_equal(cache.keys[:, :, : cache.size()], gather(K, pos))  # original rows
        out = layer_call(cache, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        Kk = mx.concatenate([gather(K, pos), K[:, :, t : t + 1]], axis=2)
        Vk = mx.concatenate([gather(V, pos), V[:, :, t : t + 1]], axis=2)
        ref = mx.fast.scaled_dot_product_attention(Q[:, :, t : t + 1], Kk, Vk, scale=SCALE, mask=None)
        assert mx.allclose(out, ref, atol=1e-5), t
        sizes.append(cache.size())
    assert max(sizes) <= 16 + cache.slack and min(sizes) == 16
    if method != "kvzip" or use_dispatch:  # heads choose their own tokens
        assert not mx.array_equal(cache.positions[0, 0, :16], cache.positions[0, 1, :16])


@pytest.mark.parametrize("native_on", [True, False])
def test_rocketkv_decode_attends_exactly_the_selected_rows_per_head(native_on, monkeypatch):
    """The stage-2 step attends exactly the selected pages' rows of each KV head: on the CPU in native
    ``joint_finish`` (the rows past the end cut off, read in place), else MLX's fused attention with a mask."""
    from veloxquant_mlx.cache import native
    from veloxquant_mlx.cache.methods.eviction import rocketkv

    calls = []
    real = rocketkv.finish_partials
    monkeypatch.setattr(rocketkv, "finish_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    if not native_on:
        monkeypatch.setattr(native, "available", lambda: False)
    dispatch.install()
    mx.random.seed(3)
    cache = make("rocketkv", compression_ratio=16.0, page_size=4, head_topk1=4)
    T = 200
    K, V = mx.random.normal((B, H, T + 1, D)), mx.random.normal((B, H, T + 1, D))
    Q = mx.random.normal((B, HQ, T + 1, D))
    layer_call(cache, Q[:, :, :T], K[:, :, :T], V[:, :, :T])
    assert cache.size() == math.ceil(T / 4)  # stage 1: ceil(T / sqrt(c))
    q1 = Q[:, :, T:]
    out = layer_call(cache, q1, K[:, :, T:], V[:, :, T:])
    rows = cache.size()
    assert cache.last_attended_rows < rows
    pos = cache.positions[:, :, :rows]
    for b in range(B):
        for h in range(H):
            group = q1[b, 2 * h : 2 * h + 2, 0]
            sel = cache.select_indices(group, b, h, keep_recent=cache.recent)
            assert sel.tolist() == sorted(set(sel.tolist())) and rows - 1 in sel.tolist()
            p = pos[b, h][sel]
            ref = mx.fast.scaled_dot_product_attention(group[None, :, None], K[b : b + 1, h : h + 1, p],
                                                       V[b : b + 1, h : h + 1, p], scale=SCALE, mask=None)
            assert mx.allclose(out[b, 2 * h : 2 * h + 2], ref[0], atol=1e-5), (b, h)
    assert len(calls) == int(native_on and native.available())


def test_rocketkv_pages_follow_an_eviction_left_pending_by_calls_without_attention():
    """With the dispatch point installed, a prefill chunk's eviction waits for its attention; calls that never reach
    it (caches filled directly) run it at the next call's store, which then summarizes the pages of the rows held
    after that eviction (it used the count from before it and failed on the page buffers)."""
    dispatch.install()
    cache = make("rocketkv", compression_ratio=16.0, page_size=4, head_topk1=4)
    for _ in range(3):
        cache.update_and_fetch(mx.random.normal((B, H, 300, D)), mx.random.normal((B, H, 300, D)))
    rows, P = cache.rows, cache.page_size
    assert rows < 900 and cache.page_max.shape[2] >= -(-rows // P)
    keys = cache.keys[:, :, :rows].astype(mx.float32)
    pad = -(-rows // P) * P - rows
    full = mx.concatenate([keys, mx.full((B, H, pad, D), -mx.inf)], axis=2) if pad else keys
    want = full.reshape(B, H, -1, P, D).max(axis=3)
    assert bool(mx.array_equal(cache.page_max[:, :, : -(-rows // P)].astype(mx.float32), want))


@pytest.mark.parametrize("method", ALL)
def test_long_decode_memory_stays_bounded(method):
    model = tiny_llama(n_layers=1)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, options=OPTIONS[method]()))
    greedy(model, mx.random.randint(0, VOCAB, (30,)).tolist(), caches, 1000)
    c = caches[0]
    assert c.offset == 1030
    if method == "rocketkv":  # stage 1 compresses the prompt; decode rows are stored, not attended
        assert c.size() == math.ceil(29 / 2) + 1001
        assert c.last_attended_rows == c.n_selected_pages() * c.page_size <= 0.55 * c.size()
    else:
        assert c.size() <= c.budget + c.slack
        assert c.keys.shape[2] <= c.budget + c.slack + 64  # buffer: never proportional to tokens seen
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())


@pytest.mark.parametrize("method, field, kw", [
    ("qfilters", "qfilters_budget", {"budget": 6, "n_sink": 4, "recent": 2}),
    ("qfilters", "qfilters_sign", {"sign": 0}),
    ("kvzip", "kvzip_budget", {"budget": 2, "n_sink": 4}),
    ("curdkv", "curdkv_budget", {"budget": 4, "n_sink": 4}),
    ("nestedkv", "nestedkv_budget", {"budget": 68, "n_sink": 4, "window": 64}),
    ("rocketkv", "rocketkv_head_topk1", {"head_topk1": 200}),
])
def test_invalid_method_values_are_refused(method, field, kw):
    with pytest.raises(QuantizerConfigError, match=field):
        make(method, **kw)


# ------------------------------------------------------------------------------ real queries
def _kept_needles(method, use_dispatch):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    Q, K, V, needles = needle_data()
    opts = {"qfilters": dict(budget=12, n_sink=1, calib_tokens=32), "curdkv": dict(budget=12, n_sink=1),
            "nestedkv": dict(budget=20, n_sink=1, window=8), "rocketkv": dict(compression_ratio=16.0, n_sink=1),
            "kvzip": dict(budget=12, n_sink=1)}[method]
    c = make(method, **opts)
    if method == "kvzip":  # context prefill with unrelated queries, then reconstruction queries along u
        layer_call(c, mx.random.normal(Q.shape), K, V)
        c.begin_reconstruction(reset=True)
        layer_call(c, Q[:, :, :16], K[:, :, -16:], V[:, :, -16:])
        c.end_reconstruction()
        c.compress()
        assert c.offset == K.shape[2]  # the reconstruction rows are not kept
    else:
        layer_call(c, Q, K, V)
    return needles, set(c.positions[0, 0, : c.size()].tolist())


@pytest.mark.parametrize("method", ALL)
def test_real_queries_keep_what_real_attention_concentrates_on(method):
    needles, kept = _kept_needles(method, True)
    assert needles <= kept
    needles, kept = _kept_needles(method, False)  # keys standing in for queries miss them
    assert not needles <= kept


# ------------------------------------------------------------------------- defining properties
def _ranks(x):
    r = mx.argsort(mx.argsort(x, axis=-1), axis=-1).astype(F32)
    return r - r.mean(-1, keepdims=True)


def _qfilters_run(shared, **kw):
    dispatch.install()
    mx.random.seed(0)
    T = 200
    u = mx.repeat(mx.random.normal((H, D)), HQ // H, axis=0)  # one direction per GQA group
    u = u / mx.linalg.norm(u, axis=-1, keepdims=True)
    a = mx.random.uniform(12, 16, (B, HQ, T, 1))
    if not shared:  # half the queries look the other way: no dominant direction
        a = a * mx.where(mx.random.uniform(shape=(B, HQ, T, 1)) < 0.5, -1, 1)
    Q = a * u[None, :, None, :] + 0.3 * mx.random.normal((B, HQ, T, D))
    K, V = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    c = make("qfilters", budget=50, n_sink=0, calib_tokens=64, **kw)
    layer_call(c, Q, K, V)
    return c, Q, K


def test_qfilters_ranking_matches_attention_when_queries_share_a_direction_and_retention_check_fires():
    c, Q, K = _qfilters_run(True, min_retention=0.75, on_low_retention="raise")
    assert c.retention > 0.75 and c.size() == 50
    attn = mx.softmax((Q.reshape(B, H, HQ // H, -1, D) * SCALE) @ K[:, :, None].swapaxes(-1, -2), axis=-1)
    rf, ra = _ranks(c.filter_scores(K)), _ranks(attn.mean(axis=(2, 3)))
    spearman = (rf * ra).sum(-1) / mx.sqrt((rf * rf).sum(-1) * (ra * ra).sum(-1))
    assert mx.all(spearman > 0.95), spearman
    with pytest.raises(QFiltersRetentionError):
        _qfilters_run(False, min_retention=0.75, on_low_retention="raise")
    with pytest.warns(RuntimeWarning, match="attention mass"):
        c, _, _ = _qfilters_run(False, min_retention=0.75)
    assert c.retention < 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _qfilters_run(False, min_retention=0.75, on_low_retention="ignore")


def test_qfilters_starts_its_query_accumulator_only_near_its_budget():
    """The [query heads, D, D] Gram accumulator is started by the call that brings the cache within
    ``calib_tokens`` rows of its budget (none is held below that), and the filters are ready, from
    exactly the next ``calib_tokens`` real queries, when the first eviction comes."""
    from veloxquant_mlx.cache.methods.eviction.qfilters import principal_direction

    dispatch.install()
    mx.random.seed(4)
    T = 50
    u = mx.random.normal((HQ, D))
    Q = mx.random.uniform(4, 6, (B, HQ, T, 1)) * u[None, :, None, :] + 0.3 * mx.random.normal((B, HQ, T, D))
    K, V = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    c = make("qfilters", budget=40, calib_tokens=16)  # within reach once more than 24 rows are held
    for a, b in ((0, 20), (20, 30), (30, 50)):
        if a == 20:
            assert c.qf_gram is None and c.qf_count == 0 and not c.calibrated
        layer_call(c, Q[:, :, a:b], K[:, :, a:b], V[:, :, a:b])
        if a == 20:
            assert c.qf_gram is not None and c.qf_count == 10 and c.qf_source == "queries"
    assert c.calibrated and c.qf_gram is None and c.qf_count == 16 and c.size() == 40
    q = Q[:, :, 20:36]
    want = principal_direction(mx.einsum("bhnd,bhne->hde", q, q), q.sum(axis=(0, 2)))
    assert mx.allclose(c.qf_filter, want, atol=1e-3)


def test_kvzip_keeps_what_reconstruction_attends_to_and_beats_random_tokens():
    def lsm(x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    kld = {"kvzip": [], "random": []}
    for seed in range(4):
        model = tiny_llama(seed=seed, n_layers=2)
        mx.random.seed(100 + seed)
        ctx, cont = mx.random.randint(0, VOCAB, (96,)), mx.random.randint(0, VOCAB, (16,))
        full = make_prompt_cache(model)
        model(ctx[None], cache=full)
        ref = lsm(model(cont[None], cache=full))
        for mode in kld:
            caches = KVCacheBuilder.for_model(model, config("kvzip", budget=24))
            model(ctx[None], cache=caches)
            if mode == "kvzip":
                KVzipKVCache.compress_with_model(model, caches, ctx, prompt_tokens=[1, 2, 3])
                assert all(c.offset == 96 and c.size() == 24 and c.compressed for c in caches)
            else:
                for c in caches:
                    c.evict(mx.random.uniform(shape=(1, H, c.size())))
            kld[mode].append(float((mx.exp(ref) * (ref - lsm(model(cont[None], cache=caches)))).sum(-1).mean()))
    assert all(z < r for z, r in zip(kld["kvzip"], kld["random"])), kld
    assert sum(kld["kvzip"]) < 0.9 * sum(kld["random"]), kld


@pytest.mark.parametrize("probe", ["context", "repeat"])
def test_kvzip_reconstruction_leaves_other_layer_types_untouched(probe):
    model = tiny_gemma3()
    ctx = mx.random.randint(0, VOCAB, (40,))
    caches = KVCacheBuilder.for_model(model, config("kvzip", budget=12, probe=probe))
    model(ctx[None], cache=caches)
    others = [(c, c.offset, c.keys) for c in caches if not isinstance(c, KVzipKVCache)]
    assert others
    kvzip_compress(model, caches, ctx, prompt_tokens=[3, 4], chunk_size=16)
    assert all(c.offset == off and mx.array_equal(c.keys, k) for c, off, k in others)
    assert all(c.size() == 12 and c.offset == 40 and c.compressed for c in caches if isinstance(c, KVzipKVCache))


def test_curdkv_keeps_high_leverage_rows_and_beats_random_rows_at_reconstruction():
    mx.random.seed(5)
    # (a) an outlier value row (a direction no other value takes) has leverage ~1 and is kept
    T = 80
    K, V = mx.random.normal((1, 1, T, D)), mx.random.normal((1, 1, T, D)) * 0.1
    V = V.at[0, 0, :, 0].multiply(0.0).at[0, 0, 37, 0].add(3.0)
    assert leverage_scores(V, 16)[0, 0, 37] > 0.99
    dispatch.install()
    c = make("curdkv", budget=12, n_sink=1, rank_cap=8)
    layer_call(c, mx.random.normal((1, 2, T, D)), K, V)
    assert 37 in c.positions[0, 0, : c.size()].tolist()
    # (b) rows picked by leverage span a rank-k approximation far better than random rows
    M, k = 200, 24
    X = mx.random.normal((M, D)) * (0.7 ** mx.arange(D))  # decaying spectrum
    rare = mx.random.randint(0, M, (6,))
    X = X.at[rare].add(mx.random.normal((6, D)) * 4.0)  # a few rows in their own directions

    def err(idx):
        R = X[idx]
        return float(mx.linalg.norm(X - X @ mx.linalg.pinv(R, stream=mx.cpu) @ R))

    top = mx.argsort(-leverage_scores(X, 8))[:k]
    rand = [err(mx.random.permutation(M)[:k]) for _ in range(20)]
    assert err(top) < 0.7 * sum(rand) / len(rand), (err(top), rand)


def test_nestedkv_nested_memories_and_safeguard():
    dispatch.install()
    mx.random.seed(6)
    T, window = 64, 4
    common = mx.random.normal((D,))
    K = common + 0.3 * mx.random.normal((1, 1, T, D))
    # token 20: a globally distinctive key that no query attends to (a diffuse head: queries ~ 0)
    K = K.at[0, 0, 20].add(-common + mx.random.normal((D,)) * 3.0)
    # token 30: the most *typical* key (the common direction itself, larger), attended most
    K = K.at[0, 0, 30].add(common * 2.0 - K[0, 0, 30] + common)
    V = mx.random.normal((1, 1, T, D))
    Q = 0.05 * mx.random.normal((1, 2, T, D)) + common * 0.2

    def kept(**kw):
        c = make("nestedkv", budget=12, n_sink=1, window=window, tau=0.0, kappa=50.0, **kw)
        layer_call(c, Q, K, V)
        pos = c.positions[0, 0, : c.size()].tolist()
        assert pos[:1] == [0] and pos[-window:] == list(range(T - window, T))  # sinks + sliding window
        return set(pos)

    whole = make("nestedkv", budget=200, n_sink=1, window=window)
    layer_call(whole, Q, K, V)
    assert int(mx.argmax(whole.cur[0, 0, :T])) == 30 and int(mx.argmin(whole.cur[0, 0, :T])) == 20

    # A diffuse head (lambda ~ 0) with tau = 0 routes every surprising token to the key memories:
    # the distinctive key is kept though it gets the least attention ...
    assert 20 in kept(safeguard_alpha=0.0)
    # ... and the typical key, though attended most, is lost (gate 1/2, long-term rank 0) ...
    assert 30 not in kept(safeguard_alpha=0.0)
    # ... unless the safeguard holds the highest-attention old rows
    assert 30 in kept(safeguard_alpha=0.15)


def test_rocketkv_selected_pages_hold_the_top_attention_tokens_and_ratio_one_is_dense():
    dispatch.install()
    mx.random.seed(7)
    T = 256
    cache = make("rocketkv", compression_ratio=4.0, page_size=8, head_topk1=4)
    K, V = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    q = mx.random.normal((B, HQ, 1, D)) * 3
    layer_call(cache, mx.random.normal((B, HQ, T, D)), K, V)
    rows = cache.size()
    Ks = cache.keys[:, :, :rows]
    # plant 6 keys along the group's query direction among the kept rows
    for r in (9, 40, 41, 77, 100, 120):
        Ks = Ks.at[:, :, r].add(mx.sum(q.reshape(B, H, 2, D), axis=2) * 1.5)
    cache.keys[:, :, :rows] = Ks
    cache.page_max = cache.page_min = None
    cache._refresh_pages(0)
    attn = mx.softmax((q.reshape(B, H, 2, D) * SCALE) @ Ks.swapaxes(-1, -2), axis=-1).sum(2)  # [B, H, rows]
    for b in range(B):
        for h in range(H):
            sel = set(cache.select_indices(q.reshape(B, H, 2, D)[b, h], b, h, keep_recent=4).tolist())
            top = set(mx.argsort(-attn[b, h])[:6].tolist())
            assert top <= sel and len(sel) < rows, (b, h)
    # ratio -> 1: nothing evicted, every page selected, generation equals the plain cache
    model = tiny_llama()
    prompt = mx.random.randint(0, VOCAB, (45,)).tolist()
    ref = greedy(model, prompt, make_prompt_cache(model), 8, prefill_step_size=16)
    caches = KVCacheBuilder.for_model(model, config("rocketkv", compression_ratio=1.0001))
    assert greedy(model, prompt, caches, 8, prefill_step_size=16) == ref
    assert caches[0].size() == caches[0].offset


@pytest.mark.real_model
def test_kvzip_on_the_real_model_beats_random_tokens():
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = mx.array(tok.encode(essays_text(max_chars=4000))[:208])
    ctx, cont = ids[:192], ids[192:]

    def lsm(x):
        return x - mx.logsumexp(x.astype(F32), axis=-1, keepdims=True)

    full = make_prompt_cache(model)
    model(ctx[None], cache=full)
    ref = lsm(model(cont[None], cache=full))
    kld = {}
    for mode in ("kvzip", "random"):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", options=KVzipOptions(budget=48)))
        model(ctx[None], cache=caches)
        if mode == "kvzip":
            kvzip_compress(model, caches, ctx, tokenizer=tok)
        else:
            mx.random.seed(0)
            for c in caches:
                c.evict(mx.random.uniform(shape=(1, c.keys.shape[1], c.size())))
        kld[mode] = float((mx.exp(ref) * (ref - lsm(model(cont[None], cache=caches)))).sum(-1).mean())
    assert kld["kvzip"] < 0.8 * kld["random"], kld
