"""Vector-quantization caches: vecinfer (arXiv 2510.06175) and a2ats (arXiv 2502.12665, if registered).

Each method's defining property and its bytes-per-token budget. The shared contract (dispatch attention,
dense path, generation, save/load round trip, deepcopy, trim, merge refusal, validation) and the
per-method configs (``make``) are in test_quant_contract.py."""

from __future__ import annotations

import math

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, QuantizerConfigError, dispatch
from veloxquant_mlx.cache import options as O

from contract_table import make, rand, sdpa
from contract_table import QUANT_METHODS as METHODS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # key_sub_dim etc. are shared flat fields


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


# ------------------------------------------------------------------------------------- vecinfer
@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_trim_whole_blocks_after_calibration_exact():
    k, v = rand(1, 2, 200, 64, dtype=mx.float16), rand(1, 2, 200, 64, dtype=mx.float16)

    def fed(chunks):
        c, i = make("vecinfer"), 0
        for m in chunks:
            c.update_and_fetch(k[:, :, i : i + m], v[:, :, i : i + m])
            i += m
        return c

    c = fed([64, 64, 5])  # trims into the calibration block are refused: test_quant_contract.py
    assert c.trim(5 + 32) == 37
    for x, y in zip(c._dense(), fed([64, 32])._dense()):
        assert bool(mx.array_equal(x, y))


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
    from veloxquant_mlx.cache.methods.quantization import vecinfer as vi

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
    from veloxquant_mlx.cache.methods.quantization import vecinfer as vi

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
        KVCacheFactory.create(KVCacheConfig(method="vecinfer", key_codebook_bits=4, key_codebook=mx.zeros((32, 4))))
    assert e.value.field == "key_codebook"
    with pytest.raises(QuantizerConfigError) as e:  # checked against the real head dim at calibration
        KVCacheFactory.create(KVCacheConfig(method="vecinfer", key_sub_dim=5, head_dim=24)).update_and_fetch(
            rand(1, 1, 40, 24), rand(1, 1, 40, 24))
    assert e.value.field == "key_sub_dim"


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
@pytest.mark.parametrize("native_on", [True, False])
def test_a2ats_sparse_step_with_sinks_in_one_primitive_or_on_the_op_path(native_on, monkeypatch):
    """The sparse step with sink logits -- exact attention over the retrieved rows, the window and the call's row --
    in native ``joint_finish`` where the CPU kernels are built (the float16 rows read in place; the rows chosen by
    native ``vq_vote``), else concatenated into MLX's fused attention: both equal the reference over the same rows."""
    from veloxquant_mlx.cache import native
    from veloxquant_mlx.cache.methods.quantization import a2ats

    calls = []
    real = a2ats.finish_partials
    monkeypatch.setattr(a2ats, "finish_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    if not native_on:
        monkeypatch.setattr(native, "available", lambda: False)
    k, v, q, _ = _needle_data()
    c, scale, sinks = make("a2ats", window=32, retrieval_fraction=0.05), 0.125, rand(4)
    K, V = c.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    dispatch.dispatched_sdpa(rand(1, 4, 599, 64), K, V, cache=c, scale=scale, mask="causal")
    K, V = c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=scale, mask=None, sinks=sinks)
    cand = 600 - 32 - 1
    idx = mx.concatenate([c.last_selected, mx.broadcast_to(mx.arange(cand, 600)[None, None], (1, 2, 600 - cand))], -1)
    ref = mx.fast.scaled_dot_product_attention(q, mx.take_along_axis(K, idx[..., None], axis=2),
                                               mx.take_along_axis(V, idx[..., None], axis=2), scale=scale,
                                               sinks=sinks)
    assert float(mx.abs(out - ref).max()) < 1e-5
    assert len(calls) == int(native_on and native.available())
    if calls:  # the vote (native vq_vote) passed its first-use check against the op path
        from veloxquant_mlx.cache.kernels import _common
        assert "a2ats_vote" in _common._checked and "a2ats_vote" not in _common._disabled


@pytest.mark.skipif("a2ats" not in METHODS, reason="not registered")
def test_a2ats_bytes_per_token():
    B, H, D = 1, 3, 64
    c = make("a2ats", head_dim=D, window=16)
    k, v = rand(B, H, 400, D), rand(B, H, 400, D)
    K, V = c.update_and_fetch(k, v)
    dispatch.dispatched_sdpa(rand(B, 6, 400, D), K, V, cache=c, scale=0.125, mask="causal")
    per_tok = (c.used_nbytes - sum(a.nbytes for a in (c.codebook, c.metric_l, c.metric_linv))) / (400 * B * H)
    budget = c.bytes_per_token_budget(D, D)  # 256 float16 bytes (offloaded in the paper) + 8 code bytes
    assert budget == 264 and abs(per_tok - budget) <= 0.1 * budget
    assert c.nbytes >= c.used_nbytes and c.resident_nbytes < 0.2 * c.used_nbytes


@pytest.mark.skipif("vecinfer" not in METHODS, reason="not registered")
def test_vecinfer_holds_float16_rows_until_codes_and_codebooks_are_smaller():
    """Issue #13 item 20: a short chat holds its float16 rows, not 36 KiB of fitted codebooks; the first
    blocks calibrate once the codebooks, the 32-row residual and the codes take fewer bytes than the
    rows would (D = 32, 2 KV heads, defaults: at 178 rows); at no point more than the float16 rows plus
    the documented slack."""
    from veloxquant_mlx.cache.contract import short_prompt_bound

    D, H = 32, 2
    c = KVCacheFactory.create(KVCacheConfig(method="vecinfer", head_dim=D))
    c.update_and_fetch(rand(1, H, 40, D), rand(1, H, 40, D))
    assert c.key_cb is None and (c.n_quant, c.n_res) == (0, 40)
    assert c.nbytes <= short_prompt_bound(40, 1, H, D, D)
    c.update_and_fetch(rand(1, H, 137, D), rand(1, H, 137, D))  # 177 rows: encoding would not pay yet
    assert c.key_cb is None and c.n_res == 177
    assert c.nbytes <= short_prompt_bound(177, 1, H, D, D)
    k, v = rand(1, H, 1, D), rand(1, H, 1, D)
    c.update_and_fetch(k, v)  # 178 rows: five blocks calibrate and are encoded at once, 18 stay float16
    assert (c.n_quant, c.n_res, c.calib_tokens) == (160, 18, 160)
    assert c.res_k.shape[2] == 32  # back to the 32-row residual
    assert bool(mx.array_equal(c.res_k[:, :, 17:18], k.astype(mx.float16)))
    assert c.nbytes <= short_prompt_bound(178, 1, H, D, D)
    for _ in range(64):  # decode: codes grow by 32 B per token against 256 B of float16 rows
        c.update_and_fetch(rand(1, H, 1, D), rand(1, H, 1, D))
    assert c.n_quant == 224 and c.nbytes <= short_prompt_bound(242, 1, H, D, D) - 10 * H * 2 * D * 2


# ------------------------------------------------------------------------------------- the shared search
def test_vq_assign_finds_the_nearest_codeword_in_blocks_without_holding_the_distances():
    """``vq_assign`` over more rows than one block: every row's codeword is the nearest (float64 check; a float32
    near-tie may pick either, so the chosen distance must be within rounding of the least), and the search peaks at
    a small fraction of the [rows, K] distances (47K pieces x 4096 codewords: 780 MB as one matrix; 202 MB with the
    blocks left to one evaluation, before session 30; ~3.4 MB queued block by block). On the CPU device whatever the
    machine's default: the bound is the CPU's block size (a GPU's blocks are 2^22 entries; 201 MB on an H100 in
    session 33, when they were 2^24 and not waited for)."""
    with mx.stream(mx.cpu):
        _vq_assign_in_blocks()


def _vq_assign_in_blocks():
    import numpy as np

    from peak_memory import peak_of
    from veloxquant_mlx.cache.primitives.vq import vq_assign

    x = mx.random.normal((1, 47616, 4), key=mx.random.key(1))
    cb = mx.random.normal((1, 4096, 4), key=mx.random.key(2))
    mx.eval(x, cb)
    got, peak = peak_of(vq_assign, x, cb)
    assert got.shape == (1, 47616) and got.dtype == mx.int32
    assert peak <= 16e6, f"vq_assign peaked at {peak / 1e6:.1f} MB"
    xs, cs = np.array(x[0], dtype=np.float64), np.array(cb[0], dtype=np.float64)
    idx = np.array(got[0])
    best = np.full(len(xs), np.inf)
    for a in range(0, len(xs), 4096):  # float64 reference, in blocks to bound the test's own memory
        d = ((xs[a : a + 4096, None, :] - cs[None]) ** 2).sum(-1)
        best[a : a + 4096] = d.min(axis=1)
    chosen = ((xs - cs[idx]) ** 2).sum(-1)
    scale = (xs ** 2).sum(-1) + (cs[idx] ** 2).sum(-1)  # magnitude of the float32 terms |c|^2 - 2 x.c
    assert np.all(chosen <= best + 1e-5 * scale + 1e-6)
    assert np.mean(chosen == best) > 0.99


@pytest.mark.parametrize("K", [256, 4096, 96])
def test_vq_assign_picks_the_first_of_tied_codewords_as_argmin_does(K):
    """Integer codewords and rows (every distance exact in float32, whatever the summation order), each codeword
    repeated: the grouped CPU search (``_nearest_grouped``, K a multiple of its groups) and the plain one (K = 96)
    return numpy's argmin, the first of the tied least codewords, for every row."""
    import numpy as np

    from veloxquant_mlx.cache.primitives.vq import vq_assign

    rng = np.random.default_rng(K)
    half = rng.integers(-6, 7, size=(K // 2, 4)).astype(np.float32)
    cb = np.concatenate([half, half])[rng.permutation(K)]  # every codeword twice, at unrelated positions
    x = rng.integers(-7, 8, size=(2, 3000, 4)).astype(np.float32)
    got = np.array(vq_assign(mx.array(x), mx.array(np.stack([cb, cb[::-1]]))))
    for h, book in enumerate((cb, cb[::-1])):
        d = ((x[h, :, None, :].astype(np.float64) - book[None]) ** 2).sum(-1)
        assert np.array_equal(got[h], d.argmin(axis=1))


@pytest.mark.skipif(not __import__("veloxquant_mlx.cache.kernels", fromlist=["x"]).kernels_enabled(),
                    reason="the nearest-codeword kernel needs MLX's CUDA backend (none here)")
@pytest.mark.parametrize("Hc,n,K,d", [(1, 47616, 4096, 4), (3, 1000, 256, 8), (2, 257, 5000, 16), (1, 33, 96, 64)])
def test_vq_nearest_kernel_finds_the_nearest_codeword_without_the_distances(Hc, n, K, d):
    """``kernels.vq_nearest`` (what ``vq_assign`` runs on CUDA): every row's codeword is the nearest (float64 check,
    a float32 near-tie may pick either), the op path's code for all but rounding ties, over codebooks of several
    shared-memory tiles (K = 4096 at d 4: three, the last partial) and rows that do not fill the last block; and it
    peaks at its output, where the op path's one block of distances is 16 MB."""
    import gc

    import numpy as np

    from veloxquant_mlx.cache.kernels import _common, vq_nearest
    from veloxquant_mlx.cache.primitives import vq

    x = mx.random.normal((Hc, n, d), key=mx.random.key(n))
    cb = mx.random.normal((Hc, K, d), key=mx.random.key(K))
    sq = mx.sum(cb * cb, axis=-1)
    mx.eval(x, cb, sq)
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    got = vq_nearest.nearest(x, cb, sq)
    mx.eval(got)
    peak = mx.get_peak_memory() - base
    assert got.shape == (Hc, n) and got.dtype == mx.int32
    assert peak <= 2 * Hc * n * 4 + (1 << 20), f"the kernel peaked at {peak / 1e6:.1f} MB"
    want = np.array(vq._assign_ops(x, cb, sq[:, None, :]))
    idx = np.array(got)
    assert np.mean(idx != want) <= 1e-3
    xs, cs = np.array(x, dtype=np.float64), np.array(cb, dtype=np.float64)
    for h in range(Hc):
        c2 = (cs[h] ** 2).sum(-1)
        for a in range(0, n, 2048):  # float64 distances, in blocks to bound the test's own memory
            xa, ia = xs[h, a : a + 2048], idx[h, a : a + 2048]
            x2 = (xa ** 2).sum(-1)
            best = (x2[:, None] + c2[None] - 2 * xa @ cs[h].T).min(axis=1)
            chosen = ((xa - cs[h][ia]) ** 2).sum(-1)
            assert np.all(chosen <= best + 1e-5 * (x2 + c2[ia]) + 1e-6)
    assert np.array_equal(np.array(vq.vq_assign(x, cb)), idx)  # vq_assign takes the kernel on this backend
    assert "vq_nearest" in _common._checked and "vq_nearest" not in _common._disabled
