"""Attention-scoring eviction methods: H2O, TOVA, K-norm, Keyformer, MorphKV.

For each: attention over exactly the kept rows (per head, at their positions), real queries beating
key proxies, the paper's defining property, bounded memory over a long decode, the trims the slack
makes exact, and option validation (state round trip, deepcopy, merge: test_contract.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from contract_table import gather, layer_call
from tiny_models import ARCHS, VOCAB, greedy, tiny_llama
from veloxquant_mlx.cache.eviction import default_slack
from veloxquant_mlx.cache import (
    H2OOptions,
    KeyformerOptions,
    KNormOptions,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    MorphKVOptions,
    QuantizerConfigError,
    TOVAOptions,
    dispatch,
)

B, HQ, H, D = 2, 4, 2, 16
F32 = mx.float32
METHODS = ["h2o", "tova", "knorm", "keyformer", "morphkv"]


def options(method, budget, n_sink=1, recent=4, **kw):
    """Options of ``method``; ``recent`` is h2o's grace, morphkv's window (tova has none)."""
    if method == "h2o":
        return H2OOptions(budget=budget, n_sink=n_sink, grace=recent, **kw)
    if method == "tova":
        return TOVAOptions(budget=budget, n_sink=n_sink, **kw)
    if method == "knorm":
        return KNormOptions(budget=budget, n_sink=n_sink, recent=recent, **kw)
    if method == "keyformer":
        return KeyformerOptions(budget=budget, n_sink=n_sink, recent=recent, **kw)
    return MorphKVOptions(budget=budget, n_sink=n_sink, window=recent, **kw)


def config(method, budget, dtype=F32, **kw):
    return KVCacheConfig(method=method, options=options(method, budget, **kw), dtype=dtype)


def make(method, budget, **kw):
    return KVCacheFactory.create(config(method, budget, **kw))


def held(cache):
    if cache.positions is None:
        return mx.zeros((B, H, 0), mx.int32)
    return cache.positions[:, :, : cache.size()]


def probs(q, K, scale):
    """[B, H, rep, N, M] causal (bottom-right) attention probabilities, float32."""
    h = K.shape[1]
    b, hq, n, d = q.shape
    logits = (q.reshape(b, h, hq // h, n, d) * scale) @ K[:, :, None].swapaxes(-1, -2)
    m = K.shape[2]
    vis = mx.arange(m - n, m)[:, None] >= mx.arange(m)[None]
    return mx.softmax(mx.where(vis, logits, -mx.inf), axis=-1)


# ---------------------------------------------------------------------------- positions and masks
@pytest.mark.parametrize("use_dispatch", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_attention_is_dense_attention_over_the_kept_rows_per_head(method, use_dispatch):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    mx.random.seed(11)
    chunks = [40] + [1] * 25 + [7] + [1] * 12
    T = sum(chunks)
    K, V = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    Q = mx.random.normal((B, HQ, T, D))
    cache = make(method, 16, n_sink=2, recent=3)
    start, differs = 0, False
    for n in chunks:
        pos = held(cache)
        sl = slice(start, start + n)
        out = layer_call(cache, Q[:, :, sl], K[:, :, sl], V[:, :, sl])
        Kk = mx.concatenate([gather(K, pos), K[:, :, sl]], axis=2) if pos.shape[-1] else K[:, :, sl]
        Vk = mx.concatenate([gather(V, pos), V[:, :, sl]], axis=2) if pos.shape[-1] else V[:, :, sl]
        ref = mx.fast.scaled_dot_product_attention(Q[:, :, sl], Kk, Vk, scale=D**-0.5,
                                                   mask="causal" if n > 1 else None)
        assert mx.allclose(out, ref, atol=1e-5), (method, start, n)
        start += n
        after = held(cache)
        assert cache.offset == start
        # the rows held are the original rows, in position order, sinks kept
        assert mx.array_equal(cache.keys[:, :, : cache.size()], gather(K, after))
        assert mx.array_equal(cache.values[:, :, : cache.size()], gather(V, after))
        assert bool(mx.all(after[..., 1:] > after[..., :-1]))
        assert bool(mx.all(after[..., :2] == mx.array([0, 1])))
        differs |= not mx.array_equal(after[0, 0], after[1, 1])
        assert cache.size() <= 16 + cache.evict_slack
    assert differs  # heads/batch rows choose their own tokens


# ---------------------------------------------------------------------------- real queries
def needle_data():
    """Queries look along u. Needle keys point along u (moderately: k.k stays small); decoy keys, and
    the last 4 keys, point along v, strongly. Real attention concentrates on the needles; keys used
    as stand-in queries concentrate on the decoys."""
    T = 128
    mx.random.seed(5)
    u = mx.zeros((D,)).at[0].add(1.0)
    v = mx.zeros((D,)).at[1].add(1.0)
    K = mx.random.normal((1, 1, T, D)) * 0.3
    K = K.at[..., :2].multiply(0.0)
    needles, decoys = [10, 33, 67, 95], [20, 50, 80, 110, 124, 125, 126, 127]
    for i in needles:
        K = K.at[0, 0, i].add(u * 2.5)
    for i in decoys:
        K = K.at[0, 0, i].add(v * 4.0)
    V = mx.random.normal((1, 1, T, D))
    Q = mx.broadcast_to(u * 8.0, (1, 2, T, D))
    return Q, K, V, needles


@pytest.mark.parametrize("method", ["h2o", "tova", "keyformer", "morphkv"])
def test_real_queries_keep_what_real_attention_concentrates_on(method):
    Q, K, V, needles = needle_data()
    recent = 0 if method == "tova" else 4
    budget = 1 + recent + len(needles)

    def kept(use_dispatch):
        (dispatch.install if use_dispatch else dispatch.uninstall)()
        c = make(method, budget, n_sink=1, recent=recent)
        layer_call(c, Q, K, V)
        assert c.size() == budget
        return set(held(c)[0, 0].tolist())

    assert set(needles) <= kept(True)
    assert not set(needles) <= kept(False)


def test_knorm_needs_no_queries_and_is_the_same_with_or_without_dispatch():
    mx.random.seed(6)
    K, V, Q = mx.random.normal((B, H, 60, D)), mx.random.normal((B, H, 60, D)), mx.random.normal((B, HQ, 60, D))
    runs = []
    for use_dispatch in (True, False):
        (dispatch.install if use_dispatch else dispatch.uninstall)()
        c = make("knorm", 20, n_sink=1, recent=2)
        outs = [layer_call(c, Q[:, :, :40], K[:, :, :40], V[:, :, :40])]
        outs += [layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1]) for t in range(40, 60)]
        runs.append((held(c), mx.concatenate(outs, axis=2)))
        assert not c.uses_attention_weights and not c._pending
    assert mx.array_equal(runs[0][0], runs[1][0]) and mx.allclose(runs[0][1], runs[1][1], atol=1e-6)


# ---------------------------------------------------------------------------- defining properties
def test_h2o_keeps_the_heavy_hitters_of_accumulated_attention():
    """One prefill chunk, no decay: the unprotected rows kept are exactly the top rows by attention
    mass received from every query (summed over each KV head's query heads)."""
    dispatch.install()
    mx.random.seed(7)
    T, budget, n_sink, grace = 64, 24, 2, 4
    K, V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    c = make("h2o", budget, n_sink=n_sink, recent=grace, decay=1.0)
    layer_call(c, Q, K, V)
    mass = np.array(probs(Q, K, D**-0.5).sum(axis=(2, 3)))  # [B, H, T]
    pos = np.array(held(c))
    for b in range(B):
        for h in range(H):
            cand = np.arange(n_sink, T - grace)
            top = cand[np.argsort(-mass[b, h, cand])[: budget - n_sink - grace]]
            want = set(range(n_sink)) | set(range(T - grace, T)) | set(top.tolist())
            assert set(pos[b, h].tolist()) == want
            # the kept rows carry their accumulated mass
            assert np.allclose(np.array(c.acc[b, h, :budget]), mass[b, h, pos[b, h]], atol=1e-4)


def test_h2o_decay_is_applied_query_by_query_across_chunks():
    dispatch.install()
    mx.random.seed(8)
    T, decay = 30, 0.9
    K, V, Q = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D)), mx.random.normal((1, HQ, T, D))
    c = make("h2o", 64, decay=decay)  # no eviction
    for a, b in [(0, 12), (12, 13), (13, 20), (20, 30)]:
        layer_call(c, Q[:, :, a:b], K[:, :, a:b], V[:, :, a:b])
    p = np.array(probs(Q, K, D**-0.5).sum(axis=2))  # [1, H, T(query), T(key)]
    want = (decay ** np.arange(T - 1, -1, -1)[:, None] * p[0]).sum(axis=-2)  # [H, T]
    assert np.allclose(np.array(c.acc[0, :, :T]), want, atol=1e-5)


def test_h2o_heavy_hitters_survive_a_long_decode():
    """Tokens every query attends to (in the prompt, and one arriving during decoding) survive 280
    decode steps of batched eviction; tokens the queries ignore are gone."""
    dispatch.install()
    mx.random.seed(9)
    u = mx.zeros((D,)).at[0].add(1.0)
    T = 340
    K = (mx.random.normal((1, 1, T, D)) * 0.3).at[..., 0].multiply(0.0)
    heavy, light = [7, 19, 40, 200], list(range(21, 31))
    for i in heavy:
        K = K.at[0, 0, i].add(u * 3.0)
    for i in light:
        K = K.at[0, 0, i].add(u * -3.0)
    V, Q = mx.random.normal((1, 1, T, D)), mx.broadcast_to(u * 3.0, (1, 2, T, D))
    c = make("h2o", 32, n_sink=1, recent=16)
    layer_call(c, Q[:, :, :60], K[:, :, :60], V[:, :, :60])
    for t in range(60, T):
        layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        assert c.size() <= 32 + c.evict_slack
    pos = set(held(c)[0, 0].tolist())
    assert set(heavy) <= pos and not pos & set(light)


@pytest.mark.parametrize("use_dispatch", [True, False])
def test_tova_evicts_exactly_the_current_query_minimum(use_dispatch):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    mx.random.seed(10)
    T, budget, n_sink = 80, 20, 2
    K, V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    c = make("tova", budget, n_sink=n_sink)
    layer_call(c, Q[:, :, :30], K[:, :, :30], V[:, :, :30])
    assert c.size() == budget
    for t in range(30, T):
        before = np.array(held(c))
        layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        after = np.array(held(c))
        assert c.size() == budget
        cand = np.concatenate([before, np.full(before.shape[:2] + (1,), t)], axis=-1)
        Kc = gather(K, mx.array(cand))
        q = Q[:, :, t : t + 1] if use_dispatch else mx.repeat(K[:, :, t : t + 1], HQ // H, axis=1)
        att = np.array(probs(q, Kc, D**-0.5).mean(axis=2)[:, :, 0])  # mean over the group
        att[..., :n_sink] = np.inf
        for b in range(B):
            for h in range(H):
                gone = set(cand[b, h].tolist()) - set(after[b, h].tolist())
                assert gone == {int(cand[b, h, np.argmin(att[b, h])])}


@pytest.mark.parametrize("keep", ["low", "high"])
def test_knorm_keeps_exactly_the_lowest_norm_keys_seen(keep):
    """At each eviction the unprotected rows held are the lowest-norm (or highest, keep='high') of
    every unprotected token seen so far, as if one row were dropped per step."""
    mx.random.seed(12)
    T, budget, n_sink, recent = 200, 32, 2, 3
    K = mx.random.normal((B, H, T, D)) * mx.random.uniform(0.2, 3.0, (B, H, T, 1))
    V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    c = make("knorm", budget, n_sink=n_sink, recent=recent, keep=keep)
    norms = np.linalg.norm(np.array(K), axis=-1) * (1 if keep == "low" else -1)
    layer_call(c, Q[:, :, :50], K[:, :, :50], V[:, :, :50])
    checked = 0
    for t in range(50, T + 1):
        if c.size() == budget:  # right after an eviction
            pos = np.array(held(c))
            cand = np.arange(n_sink, t - recent)
            for b in range(B):
                for h in range(H):
                    low = cand[np.argsort(norms[b, h, cand])[: budget - n_sink - recent]]
                    want = set(range(n_sink)) | set(range(t - recent, t)) | set(low.tolist())
                    assert set(pos[b, h].tolist()) == want
            checked += 1
        if t < T:
            layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        assert c.size() <= budget + c.evict_slack
    assert checked > 50 // c.evict_slack


def test_keyformer_without_noise_at_tau_1_is_accumulated_attention():
    dispatch.install()
    mx.random.seed(13)
    T = 48
    K, V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    kf, h2o = make("keyformer", 64), make("h2o", 64, decay=1.0)
    kf.gumbel_noise = False
    for c in (kf, h2o):
        layer_call(c, Q[:, :, :40], K[:, :, :40], V[:, :, :40])
        for t in range(40, T):
            layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
    mass = probs(Q, K, D**-0.5).sum(axis=(2, 3))
    assert mx.allclose(kf.acc[:, :, :T], mass, atol=1e-4)
    assert mx.allclose(kf.acc[:, :, :T], h2o.acc[:, :, :T], atol=1e-5)


def test_keyformer_tau_to_zero_limit_is_attention_in_expectation():
    """Gumbel-max: as tau -> 0, softmax((log p + g) / tau) is one-hot with P(i) = p_i."""
    c = make("keyformer", 64, tau=1e-4, seed=3)
    M, n = 8, 4000
    p = mx.softmax(mx.random.normal((M,), key=mx.random.key(1)) * 1.5)
    c.update_and_fetch(mx.zeros((1, 1, M, D)), mx.zeros((1, 1, M, D)))
    c.acc = mx.zeros_like(c.acc)  # drop what the key-proxy observation of this call added
    c.observe(mx.broadcast_to(p, (1, 1, 1, n, M)))
    freq = np.array(c.acc[0, 0, :M]) / n
    assert np.allclose(freq, np.array(p), atol=0.03)
    assert np.isclose(freq.sum(), 1.0, atol=1e-4)


def test_keyformer_temperature_schedule_follows_the_config():
    dispatch.install()
    c = make("keyformer", 64, tau_init=0.5, tau_end=2.0, anneal_steps=10)
    c.gumbel_noise = False
    mx.random.seed(14)
    T = 30
    K, V, Q = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D)), mx.random.normal((1, HQ, T, D))
    layer_call(c, Q[:, :, :8], K[:, :, :8], V[:, :, :8])  # prompt: tau_init
    assert c.decode_steps == 0
    for t in range(8, T):
        step = t - 8
        want_tau = 0.5 + 1.5 * min(step, 10) / 10
        assert c.tau() == pytest.approx(want_tau)
        before = c.acc[:, :, :t]
        layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        p = probs(Q[:, :, t : t + 1], K[:, :, : t + 1], D**-0.5)
        f = mx.softmax(mx.log(p) / want_tau, axis=-1).sum(axis=(2, 3))
        assert mx.allclose(c.acc[:, :, : t + 1] - mx.pad(before, [(0, 0), (0, 0), (0, 1)]), f, atol=1e-5)
    assert c.tau() == 2.0 and make("keyformer", 64, tau=0.7).tau(123) == 0.7


def test_keyformer_noise_is_seeded():
    mx.random.seed(15)
    K, V, Q = mx.random.normal((1, H, 40, D)), mx.random.normal((1, H, 40, D)), mx.random.normal((1, HQ, 40, D))
    accs = []
    for seed in (1, 1, 2):
        c = make("keyformer", 64, seed=seed)
        layer_call(c, Q, K, V)
        accs.append(c.acc[:, :, :40])
    assert mx.array_equal(accs[0], accs[1]) and not mx.allclose(accs[0], accs[2])
    # under for_model every layer draws its own noise stream
    caches = KVCacheBuilder.for_model(tiny_llama(), config("keyformer", 64))
    assert [c.noise_stream for c in caches] == [0, 1, 2]


def test_keyformer_gumbel_softmax_at_tau_1_is_the_log_domain_softmax():
    """At tau = 1 the score is p / E normalised (E = -log u): the same as softmax(log p - log(-log u)) (float64)."""
    from veloxquant_mlx.cache.methods.eviction.keyformer import _over_exponential

    w = mx.softmax(mx.random.normal((1, 2, 2, 8, 16), key=mx.random.key(3)) * 3, axis=-1)
    u = mx.random.uniform(shape=w.shape, key=mx.random.key(4))
    r = np.array(_over_exponential(w, u), dtype=np.float64)
    got = r / r.sum(-1, keepdims=True)
    z = np.log(np.array(w, dtype=np.float64)) - np.log(-np.log(np.array(u, dtype=np.float64)))
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_keyformer_scores_a_long_call_in_tiles_of_queries_exactly(tau, monkeypatch):
    """A 300-query call scored in many tiles of query rows (the tile budget made tiny) adds exactly the summed
    softmax(log p / tau) of every query (noise off), as one pass would."""
    from veloxquant_mlx.cache.methods.eviction import keyformer

    monkeypatch.setattr(keyformer, "block_entries", lambda: 4096)  # tiles of a few query rows
    c = make("keyformer", 512, tau=tau)
    c.gumbel_noise = False
    c.update_and_fetch(mx.zeros((1, 1, 64, D)), mx.zeros((1, 1, 64, D)))
    c.acc = mx.zeros_like(c.acc)  # drop what the key-proxy observation of this call added
    w = mx.softmax(mx.random.normal((1, 1, 2, 300, 64), key=mx.random.key(5)) * 2, axis=-1)
    c.observe(w)
    p = np.array(w, dtype=np.float64) ** (1 / tau)
    want = (p / p.sum(-1, keepdims=True)).sum(axis=(2, 3))
    assert np.allclose(np.array(c.acc[:, :, :64]), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("use_dispatch", [True, False])
def test_morphkv_keeps_what_the_recent_window_attends_to_at_constant_size(use_dispatch):
    (dispatch.install if use_dispatch else dispatch.uninstall)()
    mx.random.seed(16)
    T, budget, n_sink, W = 120, 20, 1, 5
    K, V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    c = make("morphkv", budget, n_sink=n_sink, recent=W)
    layer_call(c, Q[:, :, :30], K[:, :, :30], V[:, :, :30])
    for t in range(30, T):
        assert c.size() == budget
        before = np.array(held(c))
        layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
        after = np.array(held(c))
        cand = np.concatenate([before, np.full(before.shape[:2] + (1,), t)], axis=-1)
        Kc = gather(K, mx.array(cand))
        # the window's queries (real, or its keys as stand-ins) vote over the candidate rows
        win = slice(t + 1 - W, t + 1)
        q = Q[:, :, win] if use_dispatch else K[:, :, win]
        votes = np.array(probs(q, Kc, D**-0.5).sum(axis=(2, 3)))
        votes[..., :n_sink] = np.inf
        votes[..., -W:] = np.inf
        for b in range(B):
            for h in range(H):
                gone = set(cand[b, h].tolist()) - set(after[b, h].tolist())
                assert gone == {int(cand[b, h, np.argmin(votes[b, h])])}
    assert c.size() == budget


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("method", METHODS)
def test_lossless_budget_matches_plain_cache_through_generate(arch, method):
    """Nothing to evict: mlx_lm's generation with chunked prefill gives the plain cache's tokens."""
    model = ARCHS[arch]()
    prompt = mx.random.randint(0, VOCAB, (45,)).tolist()
    ref = greedy(model, prompt, make_prompt_cache(model), 8, prefill_step_size=16)
    caches = KVCacheBuilder.for_model(model, config(method, 1024))
    assert greedy(model, prompt, caches, 8, prefill_step_size=16) == ref


# ---------------------------------------------------------------------------- memory
@pytest.mark.parametrize("method", METHODS)
def test_memory_stays_bounded_over_a_long_decode(method):
    model = tiny_llama(n_layers=1)
    budget = 32
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, options=options(method, budget)))
    c = caches[0]
    model(mx.random.randint(0, VOCAB, (1, 50)), cache=caches)
    tok, sizes, caps = mx.array([[1]]), [], []
    for _ in range(1000):
        logits = model(tok, cache=caches)
        tok = logits[:, -1:].argmax(-1)
        mx.eval(tok)
        sizes.append(c.size())
        caps.append(c.keys.shape[2])
    assert c.offset == 1050
    if method in ("tova", "morphkv"):
        assert set(sizes) == {budget}  # exactly the budget after every step
    assert max(sizes) <= budget + c.evict_slack and max(caps) <= budget + c.evict_slack + 1
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert c.nbytes < c.full_seq_bytes / 10


# ---------------------------------------------------------------------------- mlx_lm contract
@pytest.mark.parametrize("method", ["h2o", "knorm", "keyformer"])
def test_trim_is_exact_while_trimmed_tokens_are_held(method):
    """Batched-eviction methods: trimming decode tokens inside the slack gives the cache a cache that
    never saw them would have (same rows, same logits)."""
    model = tiny_llama()
    mx.random.seed(18)
    toks = mx.random.randint(0, VOCAB, (1, 100))
    cfg = KVCacheConfig(method=method, options=options(method, 64))
    caches = KVCacheBuilder.for_model(model, cfg)
    model(toks, cache=caches)
    assert caches[0].size() == 64 and caches[0].evict_slack == default_slack(64) >= 3
    for t in range(3):
        model(mx.array([[t + 1]]), cache=caches)
    assert all(c.is_trimmable() for c in caches)
    assert [c.trim(2) for c in caches] == [2] * 3
    assert caches[0].size() == 65 and caches[0].offset == 101
    fresh = KVCacheBuilder.for_model(model, cfg)
    model(toks, cache=fresh)
    model(mx.array([[1]]), cache=fresh)
    for c, f in zip(caches, fresh):
        assert mx.array_equal(held(c), held(f))
        assert all(getattr(c, n)[:, :, : c.size()].shape == (1, 2, 65) for n in c.row_fields)
    if method == "keyformer":
        assert caches[0].decode_steps == fresh[0].decode_steps == 1
    assert mx.array_equal(model(mx.array([[9]]), cache=caches), model(mx.array([[9]]), cache=fresh))


@pytest.mark.parametrize("method", ["tova", "morphkv"])
def test_trim_of_per_step_eviction_methods_drops_exactly_the_newest_tokens(method):
    dispatch.install()
    mx.random.seed(19)
    T = 50
    K, V, Q = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)), mx.random.normal((B, HQ, T, D))
    c = make(method, 16, n_sink=1, recent=4)
    layer_call(c, Q[:, :, :40], K[:, :, :40], V[:, :, :40])
    for t in range(40, T - 1):
        layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
    tail_held = bool(mx.all(held(c)[..., -2:] == mx.array([T - 3, T - 2])))
    if not tail_held:  # TOVA may have evicted its newest tokens: then trim refuses
        with pytest.raises(ValueError):
            c.trim(2)
        return
    before = held(c)
    assert c.trim(2) == 2 and c.offset == T - 3 and c.size() == 14
    assert mx.array_equal(held(c), before[..., :-2])
    if method == "morphkv":
        assert c.query_positions.tolist() == list(range(T - 3 - c.query_positions.shape[0], T - 3))
    # and it keeps working: the next step is attention over exactly the rows held
    pos = held(c)
    t = T - 3
    out = layer_call(c, Q[:, :, t : t + 1], K[:, :, t : t + 1], V[:, :, t : t + 1])
    ref = mx.fast.scaled_dot_product_attention(
        Q[:, :, t : t + 1], mx.concatenate([gather(K, pos), K[:, :, t : t + 1]], axis=2),
        mx.concatenate([gather(V, pos), V[:, :, t : t + 1]], axis=2), scale=D**-0.5, mask=None)
    assert mx.allclose(out, ref, atol=1e-5)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("method, field", [("h2o", "h2o_budget"), ("tova", "tova_budget"), ("knorm", "knorm_budget"),
                                           ("keyformer", "keyformer_budget"), ("morphkv", "morphkv_budget")])
def test_budget_must_exceed_the_protected_rows(method, field):
    recent = 0 if method == "tova" else 4
    with pytest.raises(QuantizerConfigError, match=field):
        make(method, 2 + recent, n_sink=2, recent=recent)
    assert make(method, 3 + recent, n_sink=2, recent=recent).budget == 3 + recent


def test_keyformer_temperature_validation():
    with pytest.raises(QuantizerConfigError, match="keyformer_tau"):
        make("keyformer", 64, tau=0.0)
    with pytest.raises(QuantizerConfigError, match="keyformer_anneal_steps"):
        make("keyformer", 64, tau_init=1.0, tau_end=2.0, anneal_steps=0)


def test_spec_telemetry_properties():
    h, t = make("h2o", 16), make("tova", 16)
    x = mx.random.normal((1, H, 40, D))
    for c in (h, t):
        c.update_and_fetch(x, x)
        assert c.tokens_kept == 16 and c.tokens_seen == 40
        assert c.compression_ratio == c.full_seq_bytes / c.nbytes
    assert h.h2o_kept_bytes == h.nbytes and t.tova_kept_bytes == t.nbytes


# ---------------------------------------------------------------------------- real model
@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_smoke_at_half_budget():
    """On SmolLM2-135M, one method per scoring path (accumulated attention through the dispatch
    point, a real-query window, query-free): evicting half of a 192-token essay context keeps the
    next-token distribution close. docs/RESULTS.md has all methods at 1024 tokens."""
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=3000), add_special_tokens=False)[:200]
    for method in ("h2o", "morphkv", "knorm"):
        cfg = KVCacheConfig(method=method, options=options(method, 96, n_sink=4, recent=8))
        r = next_token_fidelity(model, ids, 192, 8, cfg)
        assert r.kld < 0.6 and r.top1_agree >= 0.6, (method, r)  # K-norm (query-free) is the weakest
        assert r.kv_bytes / r.kv_bytes_fp16 < 0.6


@pytest.mark.parametrize("decay,n", [(1.0, 1), (1.0, 5), (0.9, 1), (0.9, 5)])
def test_h2o_decayed_add_equals_query_by_query_decay(decay, n):
    """``decayed_add``'s shortcuts (no decay, one query) equal decaying the sum query by query, in float64."""
    from veloxquant_mlx.cache.methods.eviction.h2o import decayed_add

    acc = mx.random.uniform(shape=(1, H, 9), key=mx.random.key(1))
    w = mx.random.uniform(shape=(1, H, HQ // H, n, 9), key=mx.random.key(2))
    want = np.array(acc).astype(np.float64)
    for j in range(n):
        want = want * decay + np.array(w[:, :, :, j]).astype(np.float64).sum(axis=2)
    assert np.allclose(np.array(decayed_add(acc, w, decay)), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["h2o", "tova", "morphkv", "keyformer"])
def test_a_decode_step_builds_no_constant_kernels(method, monkeypatch):
    """On a GPU a decode step is bound by the host's kernel launches: a step's graph (the layer's attention, the
    observation, TOVA's / MorphKV's one-row eviction) rebuilds no index ramps, zero fills or decay powers; the
    new row's position and zero row fields come from the host and the index constants are shared
    (``index_constant``)."""
    import io
    import re

    dispatch.install()
    c = make(method, 24)
    mx.random.seed(4)
    for n in (40, 1, 1):  # a prompt over budget, then decode steps (the first builds the shared constants)
        q, k, v = mx.random.normal((B, HQ, n, D)), mx.random.normal((B, H, n, D)), mx.random.normal((B, H, n, D))
        mx.eval(q, k, v)
        if c.offset == 41:  # the last step's graph stays whole (eviction schedules its positions)
            monkeypatch.setattr(mx, "async_eval", lambda *a: None)
        out = layer_call(c, q, k, v)
        if c.offset < 42:
            mx.eval(out, c.state)
    assert c.offset == 42 and (method not in ("tova", "morphkv") or c.size() == 24)
    dot = io.StringIO()
    mx.export_to_dot(dot, out, c.keys, c.values, c.positions, *(getattr(c, f) for f in c.row_fields))
    ops = set(re.findall(r'label ="([A-Za-z]+)"', dot.getvalue()))
    # the one-row drop: gathers on the op path, one launch on CUDA (``kernels.drop_row``, a CustomKernel as is the
    # observing caches' step, ``kernels.observed_decode``), one primitive with the CPU kernels (``native``)
    one = {"CustomKernel", "VeloxquantDropRow"}
    dropped = "GatherAxis" in ops or (bool(ops & one) and method in ("tova", "morphkv"))
    assert "SliceUpdate" in ops and dropped == (method in ("tova", "morphkv")), ops
    # (MorphKV's window positions stay an arange: from the host they cost it 15% on an H100)
    assert not ops & ({"Full", "Power"} if method == "morphkv" else {"Arange", "Full", "Power"}), ops
