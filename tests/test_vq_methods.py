"""Vector-quantization caches: vecinfer (arXiv 2510.06175) and a2ats (arXiv 2502.12665, if registered).

Shared contract (every method): attention through the dispatch point equals dense attention over what
update_and_fetch returned, dense path without the dispatch point, mlx_lm generation with chunked
prefill on tiny llama/qwen2/gemma3, save/load_prompt_cache round trip, deepcopy, trim (exact or
ValueError), merge refusal. Then each method's defining property and its bytes-per-token budget."""

from __future__ import annotations

import copy
import math

import pytest

from veloxquant_mlx import _blas

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from veloxquant_mlx.cache import (  # noqa: E402
    BatchingNotSupported,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    dispatch,
)
from veloxquant_mlx.cache import options as O  # noqa: E402
from veloxquant_mlx.cache.base import method_info  # noqa: E402

from tiny_models import ARCHS, VOCAB, greedy, tiny_llama  # noqa: E402

CONFIGS = {
    # small codebooks keep the tests fast; the defaults (12/8 bits) are measured in scripts/quality_vq.py
    "vecinfer": lambda **kw: KVCacheConfig(method="vecinfer", key_codebook_bits=kw.pop("kbits", 8),
                                           value_codebook_bits=kw.pop("vbits", 6),
                                           options=O.VecInferOptions(**kw)),
    "a2ats": lambda **kw: KVCacheConfig(method="a2ats", options=O.A2ATSOptions(**{"window": 16, **kw})),
}
METHODS = [m for m in CONFIGS if method_info(m).implemented]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # key_sub_dim etc. are shared flat fields


# a2ats attends to retrieved rows only at decode; with retrieval_fraction=1 every row is retrieved and its
# attention must equal dense attention (the sparse case is tested against attention over the retrieved rows)
DENSE_KW = {"a2ats": {"retrieval_fraction": 1.0}}


def make(method, head_dim=64, **kw):
    return KVCacheFactory.create(CONFIGS[method](**kw).replace(head_dim=head_dim))


def rand(*shape, dtype=mx.float32):
    return mx.random.normal(shape).astype(dtype)


def sdpa(q, k, v, mask, scale, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


# ------------------------------------------------------------------------------------- contract
CASES = [(70, "causal"), (1, None), (1, None), (20, "array"), (1, None), (9, "additive"), (1, None), (40, "causal"),
         (1, None)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_attend_through_dispatch_equals_dense_attention(method, use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    cache = make(method, **DENSE_KW.get(method, {}))
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = cache.stored_rows()
        if kind == "array":
            mask = cache.make_mask(n, return_array=True)
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            mask = mx.where(cache.make_mask(n, return_array=True), 0.0, -mx.inf)
        else:
            mask = cache.make_mask(n)
        K, V = cache.update_and_fetch(k, v)
        assert K.shape[2] == past + n
        assert bool(mx.array_equal(K[:, :, past:], k)) and bool(mx.array_equal(V[:, :, past:], v))
        out = dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask, sinks=sinks)
        ref = sdpa(q, K, V, mask, scale, sinks)
        assert out.shape == (B, Hq, n, D)
        assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert cache.offset == sum(n for n, _ in CASES) == cache.stored_rows()
    dk, dv = cache._dense()
    assert dk.shape == (B, H, cache.offset, D) and dv.shape == dk.shape


def _run(model, caches, tokens, chunks):
    out, i = [], 0
    for n in chunks:
        out.append(model(mx.array(tokens[i : i + n])[None], cache=caches)[0, -1].astype(mx.float32))
        i += n
    mx.eval(out)
    return out


TOKENS = [(i * 37 + 11) % VOCAB for i in range(140)]


def _caches(model, method, install=True, **kw):
    return KVCacheBuilder.for_model(model, CONFIGS[method](**kw), install_dispatch=install)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_generate_with_chunked_prefill(method, arch):
    model = ARCHS[arch]()
    caches = _caches(model, method)
    out = greedy(model, TOKENS[:75], caches, max_tokens=10, prefill_step_size=16)  # 75 > prefill step
    assert len(out) == 10 and all(0 <= t < VOCAB for t in out)
    ours = [c for c in caches if getattr(type(c), "method_name", None) == method]
    assert ours and all(c.offset == 75 + 10 and c.stored_rows() == c.offset for c in ours)


@pytest.mark.parametrize("method", METHODS)
def test_dense_path_without_dispatch(method):
    model = tiny_llama()
    dispatch.install()
    kw = DENSE_KW.get(method, {})
    a = _run(model, _caches(model, method, **kw), TOKENS, [70, 1, 1, 1, 20, 1])
    dispatch.uninstall()
    b = _run(model, _caches(model, method, install=False, **kw), TOKENS, [70, 1, 1, 1, 20, 1])
    for x, y in zip(a, b):
        assert float(mx.abs(x - y).max()) < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_state_round_trip_deepcopy_merge(method, tmp_path):
    model = tiny_llama()
    caches = _caches(model, method)
    _run(model, caches, TOKENS, [70, 1, 1])
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    clone = copy.deepcopy(caches)
    assert all(type(c) is type(caches[0]) for c in loaded)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    nxt = TOKENS[72:80]
    la = _run(model, caches, nxt, [1] * 8)
    lb = _run(model, loaded, nxt, [1] * 8)
    lc = _run(model, clone, nxt, [1] * 8)
    for a, b, c in zip(la, lb, lc):
        assert bool(mx.array_equal(a, b)) and bool(mx.array_equal(a, c))
    with pytest.raises(BatchingNotSupported):
        type(caches[0]).merge(caches[:2])


@pytest.mark.parametrize("method", METHODS)
def test_trim_exact_or_valueerror(method):
    k, v = rand(1, 2, 200, 64, dtype=mx.float16), rand(1, 2, 200, 64, dtype=mx.float16)

    def fed(chunks):
        c = make(method)
        i = 0
        for m in chunks:
            c.update_and_fetch(k[:, :, i : i + m], v[:, :, i : i + m])
            i += m
        return c

    c = fed([115] + [1] * 10)
    assert c.trim(3) == 3  # the newest rows are float16 residual rows: exact
    ref = fed([115] + [1] * 7)
    assert c.offset == ref.offset == c.stored_rows()
    for x, y in zip(c._dense(), ref._dense()):
        assert bool(mx.array_equal(x, y))
    before = c.offset
    if method == "vecinfer":
        with pytest.raises(ValueError):
            c.trim(77)  # into the block the statistics were fitted on
        assert c.offset == before
    else:  # float16 rows: any trim is exact
        assert c.trim(77) == 77 and c.offset == 45
        for x, y in zip(c._dense(), fed([45])._dense()):
            assert bool(mx.array_equal(x, y))
    if method == "vecinfer":  # whole blocks after the calibration block: exact
        c = fed([64, 64, 5])
        assert c.trim(5 + 32) == 37
        ref = fed([64, 32])
        for x, y in zip(c._dense(), ref._dense()):
            assert bool(mx.array_equal(x, y))


# ------------------------------------------------------------------------------------- vecinfer
def _outlier_keys(B=1, H=2, T=256, D=64, n_out=4, mag=20.0):
    k = rand(B, H, T, D)
    boost = mx.where(mx.arange(D) < n_out, mag, 1.0)
    return k * boost


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_lut_scores_equal_scores_over_dequantized_keys():
    c = make("vecinfer")
    k = _outlier_keys()
    c.update_and_fetch(k, rand(*k.shape))
    q = rand(1, 2, 5, 64) * 0.125
    a = c.lut_scores(q, c.n_quant)
    b = q @ c._keys_t(c.n_quant)
    assert a.shape == (1, 2, 5, 256)
    assert float(mx.abs(a - b).max()) < 1e-4 * max(1.0, float(mx.abs(b).max()))


def _rel_key_error(c, k):
    c.update_and_fetch(k, mx.zeros_like(k))
    kh = c._keys_t(c.n_quant).swapaxes(-1, -2)
    return float(mx.sum((kh - k[:, :, : c.n_quant]) ** 2) / mx.sum(k[:, :, : c.n_quant] ** 2))


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_error_falls_with_codebook_size_and_transform_helps_outliers():
    from veloxquant_mlx.cache.methods import vecinfer as vi

    k = _outlier_keys()
    errs = [_rel_key_error(make("vecinfer", kbits=b), k) for b in (2, 4, 6, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    # the same product VQ (4-dim sub-vectors, 256 codewords) fitted on the raw keys, no smoothing/rotation
    rows = k.reshape(1, -1, 4)
    cb = vi.fit_codebook(rows, 256, seed=0)
    plain = mx.take(cb[0], vi.vq_assign(rows, cb)[0], axis=0).reshape(k.shape)
    e_plain = float(mx.sum((plain - k) ** 2) / mx.sum(k ** 2))
    assert errs[-1] < 0.8 * e_plain, (errs[-1], e_plain)


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_bytes_per_token_and_packed_bits():
    B, H, D = 1, 3, 64
    c = KVCacheFactory.create(KVCacheConfig(method="vecinfer", head_dim=D, key_codebook_bits=8,
                                            value_codebook_bits=4, options=O.VecInferOptions()))
    k, v = rand(B, H, 640, D), rand(B, H, 640, D)
    c.update_and_fetch(k[:, :, :320], v[:, :, :320])
    u1, n1 = c.used_nbytes, c.n_quant
    c.update_and_fetch(k[:, :, 320:], v[:, :, 320:])
    per_tok = (c.used_nbytes - u1) / (c.n_quant - n1) / (B * H)
    budget = c.bytes_per_token_budget(D, D)  # 16 * 8 / 8 + 8 * 4 / 8 = 20 bytes (vs 256 float16)
    assert budget == 20.0 and abs(per_tok - budget) <= 0.1 * budget, per_tok
    assert c.nbytes >= c.used_nbytes and c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert c.key_cb.shape == (1, 256, 4) and c.val_cb.shape == (1, 16, 8)
    # codes wider than 8 bits: low byte + high bits in two streams, exactly `bits` bits per code
    from veloxquant_mlx.cache.methods import vecinfer as vi

    codes = mx.random.randint(0, 1 << 12, (2, 3, 16))
    lo, hi = vi.pack_codes(codes, 12)
    assert lo.shape[-1] * 32 + hi.shape[-1] * 32 == 16 * 12
    assert bool(mx.array_equal(vi.unpack_codes(lo, hi, 12, 16), codes))


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_config_arrays_and_validation():
    D = 16
    cb = mx.random.normal((16, 4))
    vcb = mx.random.normal((16, 8))
    c = KVCacheFactory.create(KVCacheConfig(method="vecinfer", head_dim=D, key_codebook_bits=4, value_codebook_bits=4,
                                            smooth_factors=[1.0] * D, key_codebook=cb, value_codebook=vcb))
    c.update_and_fetch(rand(1, 2, 32, D), rand(1, 2, 32, D))
    assert bool(mx.array_equal(c.key_cb[0], cb.astype(mx.float16)))
    assert bool(mx.array_equal(c.smooth, mx.ones((2, D))))
    with pytest.raises(QuantizerConfigError) as e:
        make("vecinfer", kbits=17)
    assert e.value.field == "key_codebook_bits"
    with pytest.raises(QuantizerConfigError) as e:
        make("vecinfer", fused_sdpa_max_ctx=0)
    assert e.value.field == "fused_sdpa_max_ctx"
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheFactory.create(KVCacheConfig(method="vecinfer", key_codebook_bits=4, key_codebook=mx.zeros((32, 4))))
    assert e.value.field == "key_codebook"
    with pytest.raises(QuantizerConfigError) as e:  # checked against the real head dim at calibration
        KVCacheFactory.create(KVCacheConfig(method="vecinfer", key_sub_dim=5, head_dim=24)).update_and_fetch(
            rand(1, 1, 40, 24), rand(1, 1, 40, 24))
    assert e.value.field == "key_sub_dim"
    assert not hasattr(make("vecinfer"), "bits")


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
@pytest.mark.parametrize("opts", [dict(fused_sdpa=True), dict(fused_sdpa=True, fused_sdpa_memory_bound=True),
                                  dict(fused_sdpa=True, fused_sdpa_max_ctx=50)])
def test_vecinfer_fused_sdpa_routes_same_result(opts):
    a, b = make("vecinfer"), make("vecinfer", **opts)
    for n in (64, 1, 30, 1):
        k, v, q = rand(1, 2, n, 64), rand(1, 2, n, 64), rand(1, 4, n, 64)
        outs = []
        for c in (a, b):
            K, V = c.update_and_fetch(k, v)
            outs.append(dispatch.dispatched_sdpa(q, K, V, cache=c, scale=0.125, mask=c.make_mask(n) if n > 1 else None))
        assert float(mx.abs(outs[0] - outs[1]).max()) < 1e-4


# ------------------------------------------------------------------------------------- a2ats
def _needle_data(B=1, H=2, T=600, D=64, n_needles=12, seed=3):
    mx.random.seed(seed)
    k, v = rand(B, H, T, D), rand(B, H, T, D)
    q = rand(B, 2 * H, 1, D)
    pos = mx.array([37 * i + 5 for i in range(n_needles)])
    # keys of the needle tokens point along their KV head's queries: large true attention
    qk = q.reshape(B, H, 2, D).mean(axis=2)[:, :, None] * 2.5
    k[:, :, pos] = k[:, :, pos] * 0.3 + qk
    return k, v, q, pos


@pytest.mark.skipif("a2ats" not in METHODS, reason="not registered")
@pytest.mark.parametrize("query_aware", [True, False])
def test_a2ats_vq_retrieval_recall_and_sparse_attention(query_aware):
    """Defining property: the top tokens by VQ-approximated scores are the true top-attention tokens."""
    k, v, q, pos = _needle_data()
    c = make("a2ats", window=32, retrieval_fraction=0.05, use_query_aware=query_aware)
    scale = 0.125
    K, V = c.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    qp = rand(1, 4, 599, 64)  # prefill queries (their second moment is the query-aware metric)
    dispatch.dispatched_sdpa(qp, K, V, cache=c, scale=scale, mask="causal")
    assert c.codebook is not None and c.n_coded == 599
    K, V = c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=scale, mask=None)
    sel = c.last_selected  # [B, H, kk]
    cand = 600 - 32 - 1
    kk = c.n_retrieved(cand)
    assert sel.shape == (1, 2, kk) and kk == math.ceil(0.05 * cand)
    # recall against the exact GQA-summed attention over the candidate tokens: the true top-12 are
    # retrieved, and the retrieved set holds >= 95% of the attention mass of the ideal top-kk set
    s = (q.reshape(1, 2, 2, 64) * scale) @ K[:, :, :cand].swapaxes(-1, -2)
    p = mx.softmax(s, axis=-1).sum(axis=2)  # [1, 2, cand]
    true = mx.argsort(-p, axis=-1)
    for h in range(2):
        top, got = set(true[0, h, :12].tolist()), set(sel[0, h].tolist())
        assert len(top & got) / 12 >= 0.9
        ideal = float(mx.sum(mx.take(p[0, h], true[0, h, :kk])))
        assert float(mx.sum(mx.take(p[0, h], sel[0, h]))) >= 0.95 * ideal
    assert all(set(pos.tolist()) <= set(r) for r in sel.reshape(2, kk).tolist())  # every needle retrieved
    # the sparse step is exact attention over [retrieved tokens, window + uncoded rows + this row]
    idx = mx.concatenate([sel, mx.broadcast_to(mx.arange(cand, 600)[None, None], (1, 2, 600 - cand))], axis=-1)
    ref = sdpa(q, mx.take_along_axis(K, idx[..., None], axis=2), mx.take_along_axis(V, idx[..., None], axis=2),
               None, scale)
    assert float(mx.abs(out - ref).max()) < 1e-5
    # and close to full attention (the needles carry the mass)
    full = sdpa(q, K, V, None, scale)
    assert float(mx.abs(out - full).max()) < 0.1


@pytest.mark.skipif("a2ats" not in METHODS, reason="not registered")
def test_a2ats_bytes_and_validation():
    B, H, D = 1, 3, 64
    c = make("a2ats", head_dim=D, window=16)
    k, v = rand(B, H, 400, D), rand(B, H, 400, D)
    K, V = c.update_and_fetch(k, v)
    dispatch.dispatched_sdpa(rand(B, 6, 400, D), K, V, cache=c, scale=0.125, mask="causal")
    per_tok = (c.used_nbytes - sum(a.nbytes for a in (c.codebook, c.metric_l, c.metric_linv))) / (400 * B * H)
    budget = c.bytes_per_token_budget(D, D)  # 256 float16 bytes (offloaded in the paper) + 8 code bytes
    assert budget == 264 and abs(per_tok - budget) <= 0.1 * budget
    assert c.nbytes >= c.used_nbytes and c.resident_nbytes < 0.2 * c.used_nbytes
    for field, bad in (("a2ats_codebook_bits", 9), ("a2ats_retrieval_fraction", 0.0), ("a2ats_beta", 2.0),
                       ("a2ats_window", -1)):
        with pytest.raises(QuantizerConfigError) as e:
            KVCacheFactory.create(KVCacheConfig(method="a2ats", options=O.A2ATSOptions(
                **{field.removeprefix("a2ats_"): bad})))
        assert e.value.field == field
    assert not hasattr(c, "bits")
