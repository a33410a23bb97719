"""Cross-layer caches: MiniCache (arXiv 2405.14366). The mlx_lm contract's cross-layer specifics
(dispatch/dense equivalence, links kept by state and deepcopy, deep trims, generate; the rest for every
method: test_contract.py), the paper's defining property (retention follows the
cosine threshold; merged rows are magnitude · SLERP direction, the direction held once per pair) and
next-token KL on the real model."""

from __future__ import annotations

import copy
import math

import pytest

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache import (
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    dispatch,
)
from veloxquant_mlx.cache.methods.crosslayer.minicache import BLOCK, MiniCacheKVCache, slerp
from veloxquant_mlx.cache.options import MiniCacheOptions

from contract_table import run_chunks as _run_tokens
from numerics import float16_rounding_effect
from tiny_models import ARCHS, VOCAB, tiny_llama


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(5)


def rand(*shape):
    return mx.random.normal(shape)


def mc_config(**opts):
    return KVCacheConfig(method="minicache", head_dim=64, options=MiniCacheOptions(**opts))


def mc_pair(**opts):
    opts.setdefault("start_frac", 0.0)
    return MiniCacheKVCache.build_layers([mc_config(**opts)] * 2)


CASES = [(70, "causal"), (1, None), (1, None), (20, "array"), (1, None), (9, "additive"), (1, None)]


@pytest.mark.parametrize("field,value", [("start_frac", 1.5), ("group_size", 3), ("retention_threshold", 2.0),
                                         ("slerp_t", -0.1)])
def test_minicache_validation_names_field(field, value):
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheFactory.create(mc_config(**{field: value}))
    assert e.value.field == f"minicache_{field}"


def test_minicache_alone_is_lossless_primary():
    c = KVCacheFactory.create(mc_config())
    assert type(c) is MiniCacheKVCache and c.role == "primary" and c.group_id == 0
    k, v = rand(1, 2, 80, 64), rand(1, 2, 80, 64)
    c.update_and_fetch(k, v)
    K, V = c._dense()
    assert c.n_quant == 64 and bool(mx.array_equal(K, k.astype(mx.float16).astype(K.dtype)))


@pytest.mark.parametrize("use_sinks", [False, True])
def test_minicache_attend_through_dispatch_equals_dense(use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    prim, mer = mc_pair(retention_threshold=0.6)
    assert (prim.role, mer.role, mer.primary is prim, prim.group_id, mer.group_id) == ("primary", "merge", True, 0, 0)
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = mer.stored_rows()
        mask = mer.make_mask(n, return_array=kind in ("array", "additive"))
        if kind == "array":
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            mask = mx.where(mask, 0.0, -mx.inf)
        # the primary runs first; the merge layer's rows are similar for half the tokens
        similar = (mx.arange(n) % 2 == 0)[None, None, :, None]
        kp = mx.where(similar, k + 0.3 * rand(B, H, n, D), rand(B, H, n, D))
        prim.update_and_fetch(kp, v + 0.3 * rand(B, H, n, D))
        K, V = mer.update_and_fetch(k, v)
        assert bool(mx.array_equal(K[:, :, past:], k)) and bool(mx.array_equal(V[:, :, past:], v))
        for cache, (KK, VV) in ((mer, (K, V)),):
            out = dispatch.dispatched_sdpa(q, KK, VV, cache=cache, scale=scale, mask=mask, sinks=sinks)
            ref = mx.fast.scaled_dot_product_attention(q, KK, VV, scale=scale, mask=mask, sinks=sinks)
            assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert mer.n_quant == 96 and prim.n_quant == 96
    assert 0 < mer.n_retained < mer.n_retained + mer.n_merged


def test_minicache_retention_follows_threshold_and_merged_is_norm_times_slerp():
    """The defining property: tokens whose cosine with the primary is below θ are kept exactly, the
    others are restored as ||x|| · SLERP(e_primary, e_merge; t) from the one shared direction."""
    B, H, T, D, t = 1, 2, 128, 64, 0.4
    xp = rand(B, H, T, D)
    noise = mx.linspace(0.05, 3.0, T)[None, None, :, None]  # cosines spread over (0, 1)
    xm = 2.0 * xp + noise * rand(B, H, T, D)
    f16 = lambda a: a.astype(mx.float16).astype(mx.float32)  # noqa: E731
    xp, xm = f16(xp), f16(xm)
    ep = xp / mx.linalg.norm(xp, axis=-1, keepdims=True)
    em = xm / mx.linalg.norm(xm, axis=-1, keepdims=True)
    cos = mx.sum(ep * em, axis=-1)
    # reference SLERP from its definition
    om = mx.arccos(mx.clip(cos, -1, 1))[..., None]
    ref_dir = (mx.sin((1 - t) * om) * ep + mx.sin(t * om) * em) / mx.sin(om)
    assert float(mx.abs(slerp(ep, em, t) - ref_dir).max()) < 1e-4
    forms = set()
    for theta in (1.0, 0.8, 0.5, -1.0):
        prim, mer = mc_pair(retention_threshold=theta, slerp_t=t)
        prim.update_and_fetch(xp, xp)
        mer.update_and_fetch(xm, xm)
        assert mer.n_quant == T and mer.n_res == 0
        keep = cos < theta
        # a block whose merged form (both layers, keys and values: a direction and two magnitudes a row, 2D + 4
        # bytes a retained row) takes at least the bytes of both layers' float16 rows is kept as those rows
        r = keep.reshape(B, H, T // BLOCK, BLOCK).sum(axis=(0, 1, 3))
        raw = 2 * (2 * D + 4) * (B * H * BLOCK + r) >= 2 * 2 * 2 * D * B * H * BLOCK
        forms |= set(raw.tolist())
        exact = keep | mx.repeat(raw, BLOCK)[None, None, :]
        assert mer.n_raw == prim.n_raw == BLOCK * int(raw.sum())
        assert mer.n_retained_k == int((keep & ~mx.repeat(raw, BLOCK)).sum())
        assert mer.n_retained == 2 * int(exact.sum())
        assert abs(mer.retention_rate - float(exact.mean())) < 1e-6
        Km, Kp = mer._dense()[0].astype(mx.float32), prim._dense()[0].astype(mx.float32)
        expect_m = mx.linalg.norm(xm, axis=-1, keepdims=True) * ref_dir
        expect_p = mx.linalg.norm(xp, axis=-1, keepdims=True) * ref_dir
        err_m = mx.abs(Km - mx.where(exact[..., None], xm, expect_m)).max()
        err_p = mx.abs(Kp - mx.where(exact[..., None], xp, expect_p)).max()
        assert float(err_m) < 2e-2 and float(err_p) < 2e-2, theta  # float16 storage
        if theta == 1.0:  # everything retained: both layers exact (float16 input), every block raw
            assert mer.retention_rate == 1.0 and bool(mx.array_equal(Km, xm)) and bool(mx.array_equal(Kp, xp))
            assert mer.runs == prim.runs == [[1, T]] and mer.mn_k is None and prim.dir_k is None
        if theta == -1.0:
            assert mer.n_retained == 0 and mer.n_merged == 2 * B * H * T
            # one shared direction: both layers' merged rows are parallel
            cosm = mx.sum(Km * Kp, -1) / (mx.linalg.norm(Km, axis=-1) * mx.linalg.norm(Kp, axis=-1))
            assert float(cosm.min()) > 0.999
    assert forms == {True, False}  # some threshold mixes raw and merged blocks


def test_minicache_bytes_per_token_budget_and_shared_direction_counted_once():
    B, H, D, T = 1, 2, 64, 4 * BLOCK  # a multiple of BLOCK: empty windows
    prim, mer = mc_pair(retention_threshold=0.5)
    x = rand(B, H, T, D)
    similar = (mx.arange(T) % 4 != 0)[None, None, :, None]  # 1 token in 4 dissimilar
    prim.update_and_fetch(x, x)
    mer.update_and_fetch(mx.where(similar, x + 0.2 * rand(B, H, T, D), rand(B, H, T, D)), x * 1.5)
    assert mer.n_res == 0 and abs(mer.n_retained_k / (B * H * T) - 0.25) < 0.05 and mer.n_retained_v == 0
    # nbytes = arrays held; the shared direction is held by the primary only
    for c in (prim, mer):
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert mer.dir_k is None and prim.dir_k is not None
    assert not any(a is b for a in mer.held_arrays() for b in prim.held_arrays())
    r = mer.n_retained_k / (B * H * T)
    budget = 2 * (2 * D + 4) + r * (2 * D + 4)  # pair: K and V direction + 2 magnitudes; retained K rows
    measured = (prim.used_nbytes + mer.used_nbytes) / (B * H * T)
    assert abs(measured / budget - 1) < 0.10
    assert measured < 0.7 * 2 * 2 * D * 2  # vs two float16 layers
    # filled-part bytes == the arrays' filled rows
    held = sum(a[:, :, :T].nbytes for a in (prim.dir_k, prim.dir_v, prim.pn_k, prim.pn_v, mer.mn_k, mer.mn_v))
    held += mer.ret_k.nbytes + mer.idx_k.nbytes
    assert prim.used_nbytes + mer.used_nbytes == held
    assert mer.compressed_key_bytes + mer.compressed_value_bytes == mer.used_nbytes
    assert prim.fp16_key_bytes == B * H * T * D * 2 == mer.fp16_value_bytes


TOKENS = [(i * 37 + 11) % VOCAB for i in range(120)]
CHUNKS = [45, 1, 1, 1, 20, 1, 1, 16, 1]


def test_minicache_contract_on_tiny_models(tmp_path):
    from mlx_lm.generate import generate_step

    model = tiny_llama(n_layers=5)
    cfg = KVCacheConfig(method="minicache", options=MiniCacheOptions(start_frac=0.2, retention_threshold=0.1))
    dispatch.install()
    caches = KVCacheBuilder.for_model(model, cfg)
    assert [c.role for c in caches] == ["primary", "primary", "merge", "primary", "merge"]
    assert [c.mc_readers for c in caches] == [0, 1, 0, 1, 0]
    a = _run_tokens(model, caches, TOKENS, CHUNKS)
    dispatch.uninstall()
    b = _run_tokens(model, KVCacheBuilder.for_model(model, cfg, install_dispatch=False), TOKENS, CHUNKS)
    # the paths sum in different orders; a stored row on a float16 rounding edge then moves by an ulp
    for x, y, tol in zip(a, b, float16_rounding_effect(model, TOKENS, CHUNKS)):  # (tests/numerics.py)
        assert float(mx.abs(x - y).max()) <= tol
    dispatch.install()
    assert all(c.n_quant == 64 for c in caches) and caches[2].n_merged > 0
    # two prompt caches never share state
    other = KVCacheBuilder.for_model(model, cfg)
    assert other[1].coordinator is not caches[1].coordinator and other[2].primary is other[1]
    # state round trip relinks pairs; deepcopy keeps links inside the copy
    path = str(tmp_path / "mc.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    clone = copy.deepcopy(caches)
    assert loaded[2].primary is loaded[1] and clone[2].primary is clone[1] and clone[1] is not caches[1]
    assert caches[2].primary is caches[1]  # loading never relinks the originals (continuing, merge: test_contract.py)
    _run_tokens(model, caches, TOKENS[90:98], [1] * 8)  # 95 tokens: the trim below cuts into merged tokens
    # trim is exact: every remaining token keeps its stored form (per-token data, no group statistics)
    before = [c._dense() for c in caches]
    n_trim = caches[0].offset - 60
    assert n_trim > BLOCK and caches[0].n_res < n_trim  # cuts into merged tokens, not just the window
    for c in caches:
        assert c.trim(n_trim) == n_trim and c.offset == 60 and c.stored_rows() == 60
    for c, (K, V) in zip(caches, before):
        K2, V2 = c._dense()
        assert bool(mx.array_equal(K2, K[:, :, :60])) and bool(mx.array_equal(V2, V[:, :, :60]))
    assert len(_run_tokens(model, caches, TOKENS[:40], [1] * 40)) == 40  # merges again after the trim
    assert caches[2].n_quant == 92 and caches[1].n_quant == 92 and caches[2].n_res == 8
    # generation with a prompt longer than prefill_step_size, on every architecture
    for arch in ("llama", "qwen2", "gemma3"):
        m = ARCHS[arch]()
        cs = KVCacheBuilder.for_model(m, KVCacheConfig(method="minicache", options=MiniCacheOptions(start_frac=0.0)))
        steps = list(generate_step(mx.array(TOKENS[:75]), m, max_tokens=6, prompt_cache=cs, prefill_step_size=16))
        assert len(steps) == 6
        mine = [c for c in cs if isinstance(c, MiniCacheKVCache)]
        assert all(c.offset == 81 and c.n_quant == 64 for c in mine)
        assert any(c.role == "merge" for c in mine)


# ------------------------------------------------------------------------------------ real model
N_CTX, N_SCORE = 512, 32
# Measured by veloxquant eval --task kld (SmolLM2-135M float32 on the CPU, 512-token essay context
# + 32 scored decode steps, merging from half depth): theta 0 -> KL 0.444, kv/fp16 0.962, 55% of the
# merge layers' rows retained (adjacent SmolLM2 layers are nearly orthogonal token by token); the
# default theta 0.9 retains everything (KL 0, kv/fp16 1.064).
KL_LIMIT = {"minicache": 0.6}


@pytest.mark.real_model
def test_minicache_real_model_kl():
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=12 * (N_CTX + N_SCORE)), add_special_tokens=False)[: N_CTX + N_SCORE]
    cfg = KVCacheConfig(method="minicache", options=MiniCacheOptions(retention_threshold=0.0))
    r = next_token_fidelity(model, ids, N_CTX, N_SCORE, cfg)
    print(f"\nminicache: KL {r.kld:.4f} top1 {r.top1_agree:.2f} kv/fp16 {r.compression:.3f}")
    assert not math.isnan(r.kld) and r.kld < KL_LIMIT["minicache"] and r.compression < 1.0


# ==================================================================================== xKV
from veloxquant_mlx.cache.methods.crosslayer.xkv import XKVKVCache
from veloxquant_mlx.cache.options import XKVOptions
from veloxquant_mlx.cache.primitives import lowrank_fit as lr


def xkv_config(**opts):
    return KVCacheConfig(method="xkv", head_dim=64, options=XKVOptions(**opts))


def correlated_layers(g, B, H, T, D, k=8, noise=0.02):
    """g layers whose rows share one k-dimensional token basis (xKV's aligned singular vectors) but
    are not similar token by token (different mixing per layer)."""
    z = rand(B, H, T, k)
    return [z @ rand(k, D) + noise * rand(B, H, T, D) for _ in range(g)]


@pytest.mark.parametrize("field,value", [("group_size", 0), ("rank", 0), ("energy_threshold", 0.0),
                                         ("latent_bits", 9), ("group_quant_size", 0)])
def test_xkv_validation_names_field(field, value):
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheFactory.create(xkv_config(**{field: value}))
    assert e.value.field == f"xkv_{field}"


@pytest.mark.parametrize("use_sinks", [False, True])
def test_xkv_attend_through_dispatch_equals_dense(use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    layers = XKVKVCache.build_layers([xkv_config(rank=12, group_size=3)] * 3)
    assert [c.xk_index for c in layers] == [0, 1, 2] and all(c.owner is layers[0] for c in layers)
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        xs, q = correlated_layers(3, B, H, n, D), rand(B, Hq, n, D)
        past = layers[0].stored_rows()
        mask = layers[0].make_mask(n, return_array=kind in ("array", "additive"))
        if kind == "array":
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            mask = mx.where(mask, 0.0, -mx.inf)
        for c, x in zip(layers, xs):  # in layer order, as mlx_lm runs them
            K, V = c.update_and_fetch(x, 2 * x)
            assert bool(mx.array_equal(K[:, :, past:], x))
            out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=scale, mask=mask, sinks=sinks)
            ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask, sinks=sinks)
            assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind, c.xk_index)
    assert all(c.n_quant == 96 for c in layers) and layers[0].rank == 12


def test_xkv_shared_basis_beats_per_layer_svd_at_same_storage_and_bytes():
    """The defining property: on layers whose token subspaces are aligned, one SVD of the
    concatenated group at rank r reconstructs better than a per-layer SVD at rank r/g (the same
    latent storage: r token-side numbers per token for the group); and the cache (8-bit latents)
    gets the shared-basis error."""
    B, H, T, D, g, r = 1, 2, 256, 64, 2, 16
    xs = correlated_layers(g, B, H, T, D, k=12)
    # per-layer SVD at rank r/g each
    per_layer = 0.0
    for x in xs:
        basis = lr.fit_basis(x)[0][..., : r // g]
        per_layer += float(mx.sum((x @ basis @ basis.swapaxes(-1, -2) - x) ** 2))
    layers = XKVKVCache.build_layers([xkv_config(rank=r, latent_bits=8)] * g)
    for c, x in zip(layers, xs):
        c.update_and_fetch(x, x)
    shared = sum(float(mx.sum((c._dense()[0].astype(mx.float32) - x) ** 2)) for c, x in zip(layers, xs))
    assert shared < 0.1 * per_layer, (shared, per_layer)
    # on unrelated layers (independent 12-dim subspaces) the shared basis has no such advantage
    ys = [rand(B, H, T, 12) @ rand(12, D) for _ in range(g)]
    per_layer_u = 0.0
    for y in ys:
        basis = lr.fit_basis(y)[0][..., : r // g]
        per_layer_u += float(mx.sum((y @ basis @ basis.swapaxes(-1, -2) - y) ** 2))
    layers = XKVKVCache.build_layers([xkv_config(rank=r, latent_bits=8)] * g)
    for c, y in zip(layers, ys):
        c.update_and_fetch(y, y)
    shared_u = sum(float(mx.sum((c._dense()[0].astype(mx.float32) - y) ** 2)) for c, y in zip(layers, ys))
    assert shared_u > 0.5 * per_layer_u, (shared_u, per_layer_u)
    # bytes: the owner holds the group's arrays once; the other layers hold only their windows
    a, b = XKVKVCache.build_layers([xkv_config(rank=r, latent_bits=4)] * g)
    for c, x in zip((a, b), xs):
        c.update_and_fetch(x, x)
    assert b.n_res == 0 and b.proj_k is None and b.zk_codes is None
    for c in (a, b):
        assert c.nbytes == sum(arr.nbytes for arr in c.held_arrays())
    assert not any(x is y for x in a.held_arrays() for y in b.held_arrays())
    G = 32
    budget = 2 * (r * 4 / 8 + 4 * r / G)  # K and V latents + float16 scale/bias per G tokens
    measured = (a.used_nbytes + b.used_nbytes - a.proj_k.nbytes - a.proj_v.nbytes) / (B * H * T)
    assert abs(measured / budget - 1) < 0.10
    assert a.proj_k.nbytes == B * H * g * D * r * 2


def test_xkv_energy_threshold_picks_rank():
    xs = correlated_layers(2, 1, 2, 128, 64, k=6, noise=0.0)
    layers = XKVKVCache.build_layers([xkv_config(energy_threshold=0.999)] * 2)
    for c, x in zip(layers, xs):
        c.update_and_fetch(x, x)
    assert layers[0].rank <= 7 and layers[1].rank == layers[0].rank


@pytest.mark.parametrize("method", ["xkv", "minicache"])
def test_a_prompt_in_one_chunk_keeps_no_layer_s_rows_alive_past_the_layer(method):
    """A one-chunk prefill waits for each layer's window and its group's codes (the owner's or the primary's,
    written by a later layer) before the layer's attention is queued: left to the chunk's end, every layer's float32
    rows and fit temporaries were alive together (ten more layers: 1.1-1.3 MB more peak than bytes held, here under
    0.05 MB; SmolLM2 at 1023 tokens: xkv 1.23x, minicache 1.19x -> 0.33x, 0.47x the plain cache's peak)."""
    from test_lowrank import one_chunk_depth_excess

    excess, rows = one_chunk_depth_excess(method)
    assert excess <= rows / 4, f"{method}: {excess} B more peak than bytes held over {rows} B of rows"


def test_xkv_contract_on_tiny_models(tmp_path):
    from mlx_lm.generate import generate_step

    model = tiny_llama(n_layers=5)
    cfg = KVCacheConfig(method="xkv", options=XKVOptions(rank=12, latent_bits=8))
    dispatch.install()
    caches = KVCacheBuilder.for_model(model, cfg)
    assert [c.xk_index for c in caches] == [0, 1, 0, 1, 0] and caches[4].xk_size == 1
    a = _run_tokens(model, caches, TOKENS, CHUNKS)
    dispatch.uninstall()
    b = _run_tokens(model, KVCacheBuilder.for_model(model, cfg, install_dispatch=False), TOKENS, CHUNKS)
    # the paths sum in different orders; a stored row on a float16 rounding edge then moves by an ulp
    for x, y, tol in zip(a, b, float16_rounding_effect(model, TOKENS, CHUNKS)):  # (tests/numerics.py)
        assert float(mx.abs(x - y).max()) <= tol
    dispatch.install()
    assert all(c.n_quant == 64 for c in caches)
    other = KVCacheBuilder.for_model(model, cfg)
    assert other[1].owner is other[0] and other[0].group_obj is not caches[0].group_obj
    path = str(tmp_path / "xkv.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    clone = copy.deepcopy(caches)
    assert loaded[1].owner is loaded[0] and clone[1].owner is clone[0] and clone[0] is not caches[0]
    assert caches[1].owner is caches[0]  # continuing, merge, trims of the newest rows: test_contract.py
    with pytest.raises(ValueError, match="latent group"):
        caches[0].trim(40)
    for arch in ("llama", "qwen2", "gemma3"):
        m = ARCHS[arch]()
        cs = KVCacheBuilder.for_model(m, KVCacheConfig(method="xkv", options=XKVOptions(rank=8)))
        steps = list(generate_step(mx.array(TOKENS[:75]), m, max_tokens=6, prompt_cache=cs, prefill_step_size=16))
        assert len(steps) == 6
        mine = [c for c in cs if isinstance(c, XKVKVCache)]
        assert all(c.offset == 81 and c.n_quant == 64 for c in mine) and mine[0].rank == 8


# Measured by veloxquant eval --task kld (same setting as minicache above): default xkv (pairs,
# energy 0.95, 4-bit latents) KL 0.191, kv/fp16 0.342.
@pytest.mark.real_model
def test_xkv_real_model_kl():
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=12 * (N_CTX + N_SCORE)), add_special_tokens=False)[: N_CTX + N_SCORE]
    r = next_token_fidelity(model, ids, N_CTX, N_SCORE, KVCacheConfig(method="xkv"))
    print(f"\nxkv: KL {r.kld:.4f} top1 {r.top1_agree:.2f} kv/fp16 {r.compression:.3f}")
    assert not math.isnan(r.kld) and r.kld < 0.3 and r.compression < 0.5
