"""XQuant (arXiv 2510.11236): the higher layers of a group read the base layer's quantized codes with their own
scales / zero points. The defining properties: a shared layer holds no codes (exact bytes: a pair costs one
KIVI layer's codes less than two KIVI layers at the same bits), and sharing wins at equal bytes when adjacent
layers are similar and loses when they are not; the mlx_lm contract's XQuant specifics (dispatch == dense,
state round trip and deepcopy relinking the group, deep trims refused, generate on every tiny architecture;
the rest for every method: test_contract.py)."""

from __future__ import annotations

import copy

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
from veloxquant_mlx.cache.methods.crosslayer.xquant import XQuantKVCache
from veloxquant_mlx.cache.options import XQuantOptions

from contract_table import run_chunks as _run_tokens
from test_crosslayer import CASES, CHUNKS, TOKENS  # the cross-layer tests' inputs
from numerics import float16_rounding_effect
from tiny_models import ARCHS, tiny_llama


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(3)


def rand(*shape):
    return mx.random.normal(shape)


def xq_config(**opts):
    return KVCacheConfig(method="xquant", head_dim=64, options=XQuantOptions(**opts))


def xq_pair(**opts):
    return XQuantKVCache.build_layers([xq_config(**opts)] * 2)


def kivi(bits):
    return KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bits, head_dim=64))


@pytest.mark.parametrize("field,value", [("group_size", 0), ("base_bits", 5), ("residual_bits", 1),
                                         ("group_quant_size", 0)])
def test_xquant_validation_names_field(field, value):
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheFactory.create(xq_config(**{field: value}))
    assert e.value.field == f"xquant_{field}"


@pytest.mark.parametrize("use_sinks", [False, True])
def test_xquant_attend_through_dispatch_equals_dense(use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    base, shared = xq_pair()
    assert (base.xq_role, shared.xq_role, shared.base is base, base.qbits, shared.qbits) == \
        ("base", "shared", True, 2, 2)
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = shared.stored_rows()
        mask = shared.make_mask(n, return_array=kind in ("array", "additive"))
        if kind == "additive":
            mask = mx.where(mask, 0.0, -mx.inf)
        base.update_and_fetch(k + 0.1 * rand(B, H, n, D), v)  # the base layer runs first
        K, V = shared.update_and_fetch(k, v)
        assert bool(mx.array_equal(K[:, :, past:], k))
        out = dispatch.dispatched_sdpa(q, K, V, cache=shared, scale=scale, mask=mask, sinks=sinks)
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask, sinks=sinks)
        assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert shared.n_quant == 96 and shared.k_codes is None and shared.v_codes is None


def test_xquant_shared_layer_reads_the_base_codes_with_its_own_scales():
    """The shared layer's stored form is s * c_base + z per group (per channel over G tokens for keys, per
    token and channel group for values): at most 2^b distinct values per group, and (least squares) no worse
    than any other affine map of the base's codes, e.g. the affine image of the base's own reconstruction."""
    B, H, D, T = 1, 2, 64, 64
    base, shared = xq_pair(base_bits=2)
    x1, v1 = rand(B, H, T, D), rand(B, H, T, D)
    x2, v2 = 3.0 * x1 + 1.0 + 0.3 * rand(B, H, T, D), v1 - 2.0 + 0.3 * rand(B, H, T, D)
    base.update_and_fetch(x1, v1)
    shared.update_and_fetch(x2, v2)
    dk, dv = shared._dense()
    bk, bv = base._dense()
    for c in range(0, D, 7):  # key channel c of group 1 (tokens 32..63): 2-bit codes, <= 4 levels
        assert len(set(dk[0, 1, 32:64, c].tolist())) <= 4
    for t in range(0, T, 5):  # value row t, channel group 0: <= 4 levels
        assert len(set(dv[0, 0, t, :32].tolist())) <= 4
    mse = lambda a, b: float(mx.mean((a - b) ** 2))  # noqa: E731
    assert mse(dk, x2) <= 1.01 * mse(3.0 * bk + 1.0, x2)
    assert mse(dv, v2) <= 1.01 * mse(bv - 2.0, v2)
    # and it is not the base's reconstruction: its own scales
    assert mse(dk, x2) < 0.5 * mse(bk, x2)


def test_xquant_pair_bytes_below_two_kivi_layers_exactly():
    """Exact bytes: the shared layer holds its scales / zero points and residual only, so a pair costs one
    KIVI layer's code arrays less than two KIVI layers at the same bits."""
    B, H, D, T = 1, 2, 64, 1024 + 7
    for bits in (2, 4):
        base, shared = xq_pair(base_bits=bits)
        alone = kivi(bits)
        x, v = rand(B, H, T, D), rand(B, H, T, D)
        base.update_and_fetch(x, v)
        shared.update_and_fetch(x + 0.1 * rand(B, H, T, D), v)
        alone.update_and_fetch(x, v)
        for c in (base, shared):
            assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
        assert not any(a is b for a in shared.held_arrays() for b in base.held_arrays())
        codes = alone.k_codes.nbytes + alone.v_codes.nbytes
        assert base.nbytes == alone.nbytes
        assert base.nbytes + shared.nbytes == 2 * alone.nbytes - codes
        assert base.used_nbytes + shared.used_nbytes < 2 * alone.used_nbytes
        # the filled part, per token per head: the shared layer's 4 B per 32 key tokens per channel + 4 B per
        # 32 value channels per token, i.e. (64 + 64) * 4 / 32 = 16 bytes
        per_token = (shared.used_nbytes - shared.res_k.nbytes - shared.res_v.nbytes) / (B * H * shared.n_quant)
        assert per_token == 16.0


def test_xquant_sharing_wins_at_equal_bytes_only_when_layers_are_similar():
    """Equal bytes: a pair sharing 4-bit codes holds 4-bit codes once + two sets of scales, exactly what two
    2-bit KIVI layers hold. With layer 2 = layer 1 + small noise the pair reconstructs both layers better;
    with an unrelated layer 2 the shared codes carry nothing about it and it is far worse."""
    B, H, D, T = 1, 2, 64, 1024
    x1, v1 = rand(B, H, T, D), rand(B, H, T, D)
    errs = {}
    for name, (x2, v2) in {"similar": (x1 + 0.05 * rand(B, H, T, D), v1 + 0.05 * rand(B, H, T, D)),
                           "unrelated": (rand(B, H, T, D), rand(B, H, T, D))}.items():
        base, shared = xq_pair(base_bits=4)
        k1, k2 = kivi(2), kivi(2)
        base.update_and_fetch(x1, v1)
        shared.update_and_fetch(x2, v2)
        k1.update_and_fetch(x1, v1)
        k2.update_and_fetch(x2, v2)
        assert base.nbytes + shared.nbytes == k1.nbytes + k2.nbytes  # the same bytes

        def err(c, x, v):
            dk, dv = c._dense()
            return float(mx.mean((dk - x) ** 2) + mx.mean((dv - v) ** 2))

        errs[name] = (err(shared, x2, v2), err(k2, x2, v2))
        assert err(base, x1, v1) < 0.2 * err(k1, x1, v1)  # the base layer has 4-bit codes
    assert errs["similar"][0] < 0.5 * errs["similar"][1], errs
    assert errs["unrelated"][0] > 2 * errs["unrelated"][1], errs


def test_xquant_shared_layer_needs_the_base_first_and_same_shapes():
    base, shared = xq_pair()
    with pytest.raises(RuntimeError, match="base layer has not quantized"):
        shared.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    base, shared = xq_pair()
    base.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    with pytest.raises(ValueError, match="shapes"):
        shared.update_and_fetch(rand(1, 3, 40, 64), rand(1, 3, 40, 64))


def test_xquant_contract_on_tiny_models(tmp_path):
    from mlx_lm.generate import generate_step

    model = tiny_llama(n_layers=4)
    cfg = KVCacheConfig(method="xquant", options=XQuantOptions(base_bits=4))
    dispatch.install()
    caches = KVCacheBuilder.for_model(model, cfg)
    a = _run_tokens(model, caches, TOKENS, CHUNKS)
    dispatch.uninstall()
    b = _run_tokens(model, KVCacheBuilder.for_model(model, cfg, install_dispatch=False), TOKENS, CHUNKS)
    for x, y, tol in zip(a, b, float16_rounding_effect(model, TOKENS, CHUNKS)):  # tests/numerics.py
        assert float(mx.abs(x - y).max()) <= tol
    dispatch.install()
    # two prompt caches never share state: fresh group ids, no shared objects
    other = KVCacheBuilder.for_model(model, cfg)
    assert {c.xq_uid for c in other}.isdisjoint({c.xq_uid for c in caches})
    assert [c.xq_role for c in caches] == ["base", "shared"] * 2 and caches[1].base is caches[0]
    assert caches[1].k_codes is None and caches[1].nbytes < caches[0].nbytes
    # state round trip relinks the groups; deepcopy keeps links inside the copy
    path = str(tmp_path / "xq.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    clone = copy.deepcopy(caches)
    assert loaded[1].base is loaded[0] and clone[1].base is clone[0] and clone[0] is not caches[0]
    # continuing, bytes, merge and trims of the newest rows: test_contract.py; deeper trims are refused
    with pytest.raises(ValueError, match="quantized group"):
        caches[0].trim(40)
    # generation with a prompt longer than prefill_step_size, on every architecture
    for arch in ("llama", "qwen2", "gemma3"):
        m = ARCHS[arch]()
        cs = KVCacheBuilder.for_model(m, cfg)
        steps = list(generate_step(mx.array(TOKENS[:75]), m, max_tokens=6, prompt_cache=cs, prefill_step_size=16))
        assert len(steps) == 6
        mine = [c for c in cs if isinstance(c, XQuantKVCache)]
        assert all(c.offset == 81 and c.n_quant == 64 for c in mine)
        assert any(c.xq_role == "shared" for c in mine)
