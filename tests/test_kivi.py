"""KIVI (arXiv 2402.02750): group quantization primitive, cache layout, attention on the codes, the
mlx_lm contract's KIVI specifics (dispatch/dense equivalence, group trims, generate; state, deepcopy and
merge for every method: test_contract.py) and, on the real
embedded model, next-token KL divergence against mlx_lm's plain KVCache."""

from __future__ import annotations

import math
import re

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
from veloxquant_mlx.cache.methods.quantization.kivi import KIVIKVCache
from veloxquant_mlx.cache.primitives import groupquant as gq

from contract_table import kl as _kl
from contract_table import run_chunks as _run_tokens
from numerics import float16_rounding_effect
from tiny_models import ARCHS, VOCAB, tiny_llama

# MLX's CUDA backend: no quantized_matmul for these layouts, so "auto" never picks it there
ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()

G = 32


def make_cache(bits=4, group=G, head_dim=64) -> KIVIKVCache:
    cache = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bits, head_dim=head_dim,
                                                options=_kivi_options(group)))
    assert isinstance(cache, KIVIKVCache)
    return cache


def _kivi_options(group):
    from veloxquant_mlx.cache.options import KIVIOptions

    return KIVIOptions(group_size=group)


def rand(*shape, dtype=mx.float32):
    return mx.random.normal(shape).astype(dtype)


def sdpa(q, k, v, mask, scale, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


@pytest.fixture
def dispatch_installed():
    dispatch.install()  # conftest restores the previous state


# ------------------------------------------------------------------------------------- primitive
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("group", [16, 32, 48, 64])
def test_groupquant_roundtrip_layout_and_append(bits, group):
    x = rand(2, 3, 4, 192)
    q = gq.quantize(x, bits, group)
    ng = 192 // group
    assert q.codes.dtype == mx.uint32 and q.codes.shape == (2, 3, 4, ng * gq.words_per_group(bits, group))
    assert q.scales.dtype == mx.float16 and q.biases.dtype == mx.float16 and q.scales.shape == (2, 3, 4, ng)
    y = gq.dequantize(*q, bits, group)
    xg = x.reshape(2, 3, 4, ng, group)
    step = (xg.max(-1) - xg.min(-1)) / (2**bits - 1)
    err = mx.abs(y - x).reshape(2, 3, 4, ng, group).max(-1)
    # half a step for exact min/max rounding; MLX's kernel (float16 input, edge-exact zero point) up to ~1 step
    assert bool(mx.all(err <= step * 1.0 + 2e-3)), float((err / step).max())
    # every group owns whole words: quantizing a prefix of groups gives a prefix of the codes
    head = gq.quantize(x[..., : 2 * group], bits, group)
    assert bool(mx.array_equal(q.codes[..., : head.codes.shape[-1]], head.codes))
    assert bool(mx.array_equal(gq.dequantize(q.codes[..., : head.codes.shape[-1]], q.scales[..., :2],
                                             q.biases[..., :2], bits, group), gq.dequantize(*head, bits, group)))
    budget = (4 * math.ceil(group * bits / 32) + 4) / group
    assert gq.group_bytes_per_element(bits, group) == budget
    assert (q.codes.nbytes + q.scales.nbytes + q.biases.nbytes) == x.size * budget


def test_per_channel_beats_per_token_on_outlier_channel():
    """The KIVI observation: a key tensor with one outlier channel quantizes far better per-channel."""
    k = rand(1, 2, 256, 64)
    k = k + 25.0 * (mx.arange(64) == 11).astype(mx.float32)  # channel 11 is a fixed large outlier
    pc = gq.dequantize_per_channel(*gq.quantize_per_channel(k, 2, G), 2, G)
    pt = gq.dequantize(*gq.quantize(k, 2, G), 2, G)
    err_pc = float(mx.mean((pc - k) ** 2))
    err_pt = float(mx.mean((pt - k) ** 2))
    assert err_pc < 0.25 * err_pt, (err_pc, err_pt)
    # the cache stores keys that way: its dequantized keys have the per-channel error
    cache = make_cache(bits=2)
    cache.update_and_fetch(k, rand(1, 2, 256, 64))
    dk, _ = cache._dense()
    assert cache.n_quant == 256
    assert abs(float(mx.mean((dk - k) ** 2)) - err_pc) < 0.05 * err_pc


# ------------------------------------------------------------------------------------- cache
def test_bits_validation_names_field():
    for bad in (1, 5, 6, 7):
        with pytest.raises(QuantizerConfigError) as e:
            KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bad))
        assert e.value.field == "bit_width_inlier"
    assert not hasattr(make_cache(), "bits")  # mlx_lm would route a cache with ``bits`` to its own kernel


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_residual_rows_exact_and_groups_quantized(dtype):
    cache = make_cache(bits=2)
    chunks = [37, 1, 1, 30, 5, 1]  # 75 tokens: 2 groups quantized, 11 in the residual
    ks, vs = [], []
    for n in chunks:
        k, v = rand(1, 2, n, 64, dtype=dtype), rand(1, 2, n, 64, dtype=dtype)
        ks.append(k)
        vs.append(v)
        cache.update_and_fetch(k, v)
    k, v = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
    assert (cache.n_quant, cache.n_res, cache.offset, cache.size()) == (64, 11, 75, 75)
    dk, dv = cache._dense()
    assert dk.dtype == dtype and dk.shape == k.shape and dv.shape == v.shape
    assert bool(mx.array_equal(dk[:, :, 64:], k[:, :, 64:].astype(mx.float16).astype(dtype)))
    assert bool(mx.array_equal(dv[:, :, 64:], v[:, :, 64:].astype(mx.float16).astype(dtype)))
    err = float(mx.abs(dk[:, :, :64] - k[:, :, :64]).max())
    assert 0 < err < 3.0  # 2-bit codes: lossy but bounded


def test_bfloat16_rows_stay_bfloat16_in_kivis_residual_only():
    """KIVI keeps a bfloat16 model's residual rows as given (no cast each step, and rows past float16's range stay
    finite); a variant reading the residual as float16 keeps float16; the codes are the same either way."""
    k, v = rand(1, 2, 45, 64, dtype=mx.bfloat16), rand(1, 2, 45, 64, dtype=mx.bfloat16)
    k = mx.concatenate([k[:, :, :44], mx.full((1, 2, 1, 64), 1e5, mx.bfloat16)], axis=2)  # past float16's max
    cache = make_cache(bits=4)
    cache.update_and_fetch(k, v)
    assert cache.res_k.dtype == mx.bfloat16 and cache.n_res == 13
    dk, dv = cache._dense()
    assert bool(mx.array_equal(dk[:, :, 32:], k[:, :, 32:])) and bool(mx.array_equal(dv[:, :, 32:], v[:, :, 32:]))
    assert abs(float(dk[0, 0, 44, 0]) - 1e5) < 1e3  # bfloat16's 1e5, not float16's inf
    as_f16 = make_cache(bits=4)
    as_f16.update_and_fetch(k[:, :, :32].astype(mx.float16), v[:, :, :32].astype(mx.float16))
    assert bool(mx.array_equal(as_f16.k_codes[..., :4], cache.k_codes[..., :4]))
    for variant in ("kivi_sink", "age_tiered"):
        c = KVCacheFactory.create(KVCacheConfig(method=variant, bit_width_inlier=4, head_dim=64))
        c.update_and_fetch(k[:, :, :40], v[:, :, :40])
        assert c.res_k.dtype == mx.float16


def _attend_cases():
    # (n_new, mask kind)
    return [(70, "causal"), (1, None), (1, None), (20, "array"), (1, None), (9, "additive"), (1, None)]


@pytest.mark.parametrize("path", ["dequant", "quantized_matmul"])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_attend_through_dispatch_equals_dense_attention(path, use_sinks):
    if path == "quantized_matmul" and ON_CUDA:
        pytest.skip("MLX's CUDA backend has no 3-bit quantized_matmul (transpose=False)")
    B, H, Hq, D = 1, 2, 6, 64
    cache = make_cache(bits=3)
    cache.attend_path = path
    scale = D**-0.5
    sinks = rand(Hq) if use_sinks else None
    for n, kind in _attend_cases():
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = cache.stored_rows()
        if kind == "causal":
            mask = cache.make_mask(n)
        elif kind == "array":
            mask = cache.make_mask(n, return_array=True)
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            m = cache.make_mask(n, return_array=True)
            mask = mx.where(m, 0.0, -mx.inf)
        else:
            mask = cache.make_mask(n)
            assert mask is None
        K, V = cache.update_and_fetch(k, v)
        assert K.shape[2] == past + n
        # the rows returned: stored rows (stored form) followed by this call's rows as given
        assert bool(mx.array_equal(K[:, :, past:], k)) and bool(mx.array_equal(V[:, :, past:], v))
        out = dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask, sinks=sinks)
        ref = sdpa(q, K, V, mask, scale, sinks)
        assert out.shape == (B, Hq, n, D) and out.dtype == q.dtype
        assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert cache.n_quant > 0 and cache.n_res > 0


def test_attend_equals_attention_over_dense_stored_form():
    """When a decode step completes no group and the rows are float16 (stored exactly), the stored
    form ``_dense()`` is exactly what the step attends."""
    D, scale = 64, 0.125
    cache = make_cache(bits=2)
    cache.update_and_fetch(rand(1, 2, 45, D, dtype=mx.float16), rand(1, 2, 45, D, dtype=mx.float16))
    for _ in range(5):
        k, v, q = (rand(1, 2, 1, D, dtype=mx.float16), rand(1, 2, 1, D, dtype=mx.float16),
                   rand(1, 4, 1, D, dtype=mx.float16))
        K, V = cache.update_and_fetch(k, v)
        out = cache.attend(q, K, V, scale=scale, mask=None)
        dk, dv = cache._dense()
        ref = sdpa(q.astype(mx.float32), dk.astype(mx.float32), dv.astype(mx.float32), None, scale)
        assert float(mx.abs(out.astype(mx.float32) - ref).max()) < 1e-3  # float16 output rounding
        out32 = cache.attend(q.astype(mx.float32), dk.astype(mx.float32), dv.astype(mx.float32),
                             scale=scale, mask=None)  # no pending call: dense attention over the rows
        assert float(mx.abs(out32 - ref).max()) < 1e-5
    assert (cache.n_quant, cache.n_res) == (32, 18)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_attend_batch_gqa_and_low_precision_inputs(dtype):
    B, H, Hq, D, scale = 2, 2, 8, 64, 0.125
    cache = make_cache(bits=4)
    for n in (33, 1, 30, 1, 1, 5):
        k, v, q = rand(B, H, n, D, dtype=dtype), rand(B, H, n, D, dtype=dtype), rand(B, Hq, n, D, dtype=dtype)
        mask = cache.make_mask(n)
        K, V = cache.update_and_fetch(k, v)
        assert K.dtype == dtype
        out = dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask)
        assert out.dtype == dtype and out.shape == (B, Hq, n, D)
        f32 = [a.astype(mx.float32) for a in (q, K, V)]
        ref = sdpa(*f32, mask, scale)
        assert float(mx.abs(out.astype(mx.float32) - ref).max()) < (1e-4 if dtype == mx.float32 else 2e-2)
    assert (cache.n_quant, cache.n_res) == (64, 7)


def _kivi_caches(model, bits=4, install=True):
    return KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=bits),
                                    install_dispatch=install)


TOKENS = [(i * 37 + 11) % VOCAB for i in range(120)]
CHUNKS = [45, 1, 1, 1, 20, 1, 1, 16, 1]  # crosses group boundaries in prefill and in decode


def test_dense_path_without_dispatch_gives_same_logits():
    model = tiny_llama()
    dispatch.install()
    with_dispatch = _run_tokens(model, _kivi_caches(model, 2), TOKENS, CHUNKS)
    dispatch.uninstall()
    caches = _kivi_caches(model, 2, install=False)
    without = _run_tokens(model, caches, TOKENS, CHUNKS)
    assert not dispatch.installed()
    # the paths sum in different orders; a residual row on a float16 rounding edge then moves by an ulp
    tols = float16_rounding_effect(model, TOKENS, CHUNKS)  # (tests/numerics.py)
    for a, b, tol in zip(with_dispatch, without, tols):
        assert float(mx.abs(a - b).max()) <= tol
    assert caches[0].n_quant == 64 and caches[0].n_res == sum(CHUNKS) - 64


@pytest.mark.parametrize("bits", [2, 4])
def test_nbytes_and_bytes_per_token_budget(bits):
    B, H, D, T = 1, 2, 64, 4096
    cache = make_cache(bits=bits)
    cache.update_and_fetch(rand(B, H, T - 40, D), rand(B, H, T - 40, D))
    for _ in range(40):  # decode steps append groups into the preallocated buffers
        cache.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
    assert (cache.n_quant, cache.n_res) == (T, 0)
    held = cache.held_arrays()
    assert len(held) == 8
    assert cache.nbytes == sum(a.nbytes for a in held)
    # exact accounting: used part + spare capacity of the grown buffers + the G-row residual buffers
    cap_t = cache.v_codes.shape[2]  # value rows allocated; keys follow in whole groups
    cap_g = cache.k_scales.shape[-1]
    assert cap_g == cap_t // G and cache.k_codes.shape[-1] == cap_g * gq.words_per_group(bits, G)
    per_group_k = D * (4 * gq.words_per_group(bits, G) + 4)  # per head: codes + fp16 scale/bias per channel
    per_tok_v = (D // G) * (4 * gq.words_per_group(bits, G) + 4)
    residual = 2 * B * H * G * D * 2
    assert cache.used_nbytes == B * H * (T // G * per_group_k + T * per_tok_v) + residual
    assert cache.nbytes == B * H * (cap_g * per_group_k + cap_t * per_tok_v) + residual
    # theoretical budget per token per head: b*D/8 code bytes + 2*2 bytes per group, for K and V
    budget = 2 * (bits * D / 8 + 4 * D / G)
    measured = cache.used_nbytes / (B * H * T)  # residual buffers amortised over T
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert cache.full_seq_bytes == B * H * T * 2 * D * 2
    assert cache.full_seq_bytes / cache.used_nbytes > (4.5 if bits == 2 else 2.9)


def test_trim_exact_cases_and_refusal():
    D = 64
    k, v = rand(1, 2, 104, D), rand(1, 2, 104, D)

    def fed(n):
        c = make_cache(bits=2)
        c.update_and_fetch(k[:, :, :n], v[:, :, :n])
        return c

    def same(a, b):
        assert (a.offset, a.n_quant, a.n_res) == (b.offset, b.n_quant, b.n_res)
        for x, y in zip(a._dense(), b._dense()):
            assert bool(mx.array_equal(x, y))
        q, k1, v1 = rand(1, 4, 1, D), rand(1, 2, 1, D), rand(1, 2, 1, D)
        oa = a.attend(q, *a.update_and_fetch(k1, v1), scale=0.1, mask=None)
        ob = b.attend(q, *b.update_and_fetch(k1, v1), scale=0.1, mask=None)
        assert bool(mx.array_equal(oa, ob))

    c = fed(104)  # 96 quantized + 8 residual
    assert c.trim(5) == 5  # residual only
    same(c, fed(99))
    c = fed(104)
    assert c.trim(8 + 32) == 40  # residual + one whole group
    same(c, fed(64))
    c = fed(104)
    with pytest.raises(ValueError, match="quantized group"):
        c.trim(20)  # would cut into the group of positions 64..95
    assert (c.offset, c.n_quant, c.n_res) == (104, 96, 8)  # unchanged
    assert c.trim(104) == 104 and c.empty()
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    same(c, fed(40))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_mlx_lm_generate_step_with_chunked_prefill(arch, dispatch_installed):
    from mlx_lm.generate import generate_step

    model = ARCHS[arch]()
    prompt = mx.array(TOKENS[:75])
    caches = _kivi_caches(model, 4)
    kinds = [type(c) for c in caches]
    assert KIVIKVCache in kinds
    if arch == "gemma3":
        from veloxquant_mlx.cache.rotating import RotatingKIVICache

        assert RotatingKIVICache in kinds  # sliding layers: kivi's compressed ring (cache/rotating.py)
    else:
        assert set(kinds) == {KIVIKVCache}
    steps = list(generate_step(prompt, model, max_tokens=12, prompt_cache=caches, prefill_step_size=16))
    plain = list(generate_step(prompt, model, max_tokens=1, prompt_cache=mlx_cache.make_prompt_cache(model),
                               prefill_step_size=16))
    assert len(steps) == 12 and all(0 <= t < VOCAB for t, _ in steps)
    kivi = [c for c in caches if isinstance(c, KIVIKVCache)]
    for c in kivi:
        # generate_step runs one step ahead of what it yields: 75 prompt + 12 fed tokens
        assert c.offset == 75 + 12 and c.stored_rows() == c.offset
        assert c.n_quant == 64 and c.n_res == 23
    # first generated token after a prompt prefilled in 16-token chunks (earlier chunks compressed).
    # Random tiny models attend very sharply, so 4-bit keys move them a lot (measured KL: llama 0.17,
    # qwen2 0.03, gemma3 0.02); 8-bit must be nearly lossless (measured <= 7e-4).
    kl4 = _kl(plain[0][1], steps[0][1])
    assert kl4 < 0.5, kl4
    steps8 = list(generate_step(prompt, model, max_tokens=1, prompt_cache=_kivi_caches(model, 8),
                                prefill_step_size=16))
    kl8 = _kl(plain[0][1], steps8[0][1])
    assert kl8 < 5e-3, kl8


# ------------------------------------------------------------------------------------- real model
N_CTX = 512
N_DECODE = 32


@pytest.fixture(scope="module")
def real():
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.model import load_model

    model, tokenizer = load_model()
    ids = tokenizer.encode(essays_text(max_chars=8 * N_CTX), add_special_tokens=False)[:N_CTX]
    assert len(ids) == N_CTX
    plain = mlx_cache.make_prompt_cache(model)
    ref = _teacher_forced(model, plain, ids)
    return model, ids, ref, plain


def _teacher_forced(model, caches, ids):
    """Prefill ``N_CTX - N_DECODE`` tokens, then decode the remaining ones one at a time; return the
    next-token logits of every decode position [N_DECODE + 1, V] (the first from the prefill)."""
    p = N_CTX - N_DECODE
    out = [model(mx.array(ids[:p])[None], cache=caches)[0, -1]]
    for t in ids[p:]:
        out.append(model(mx.array([[t]]), cache=caches)[0, -1])
    logits = mx.stack(out).astype(mx.float32)
    mx.eval(logits)
    return logits


def _mean_kl(ref, test):
    lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lq = test - mx.logsumexp(test, axis=-1, keepdims=True)
    return mx.sum(mx.exp(lp) * (lp - lq), axis=-1)


# Measured (SmolLM2-135M float32, 480-token prefill + 32 teacher-forced decode steps over the essays,
# G = 32): mean KL 0.0122 at 4 bits (top-1 agreement 1.00), 0.207 at 2 bits (0.75); with 64 decode
# steps 0.0096 / 0.236. mlx_lm's QuantizedKVCache (per-token K and V, group 32) measured 0.065 / 1.27.
KL_LIMIT = {4: 0.03, 2: 0.35}


@pytest.mark.real_model
@pytest.mark.parametrize("bits", [4, 2])
def test_real_model_kl_and_compression(real, bits, dispatch_installed):
    model, ids, ref, plain = real
    caches = _kivi_caches(model, bits)
    test = _teacher_forced(model, caches, ids)
    kl = _mean_kl(ref[1:], test[1:])  # decode positions (the prefill's own last token is exact)
    mean_kl = float(kl.mean())
    top1 = float(mx.mean((ref[1:].argmax(-1) == test[1:].argmax(-1)).astype(mx.float32)))
    kivi = [c for c in caches if isinstance(c, KIVIKVCache)]
    used = sum(c.used_nbytes for c in kivi)
    held = sum(c.nbytes for c in kivi)
    fp16 = sum(c.full_seq_bytes for c in kivi)
    print(f"\nKIVI {bits}-bit: mean next-token KL {mean_kl:.5f} (max {float(kl.max()):.4f}), top-1 agreement "
          f"{top1:.3f}; fp16/used bytes {fp16 / used:.2f}x, fp16/held bytes {fp16 / held:.2f}x")
    # prefill attends in full precision: float32 attention summed in another order (the CPU's native softmax, 30
    # layers) moves the last prompt token's KL to ~1e-6; quantized rows would give the decode steps' ~1e-2
    assert float(_mean_kl(ref[:1], test[:1])[0]) < 1e-5
    assert mean_kl < KL_LIMIT[bits], mean_kl
    assert fp16 / used > (3.3 if bits == 2 else 2.3)


@pytest.mark.parametrize("method", ["gear", "kivi_sink", "vecinfer", "zipcache"])
def test_variants_with_their_own_codes_refuse_quantized_matmul_naming_why(method):
    """A KIVI variant whose codes are not MLX's affine layout always dequantizes; asking for
    ``attend_path="quantized_matmul"`` raises with the variant's reason (``dequant_only``)."""
    c = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=64))
    c.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    assert c.dequant_only and not c._uses_qmm()
    c.attend_path = "quantized_matmul"
    with pytest.raises(ValueError, match=re.escape(f"{method} attends through dequantize + matmul ({c.dequant_only})")):
        c._uses_qmm()
    plain = make_cache()  # KIVI's own codes (4 bits, groups of 32): MLX's layout
    plain.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    plain.attend_path = "quantized_matmul"
    assert plain.dequant_only == "" and plain._uses_qmm()


def test_auto_path_reads_codes_with_quantized_matmul_only_for_few_query_rows(monkeypatch, op_path):
    """On the CPU ``attend_path="auto"`` sends a decode step (a few query rows per head) through
    ``mx.quantized_matmul`` and a prefill chunk through the rows dequantized (qmm's cost grows with the rows); both
    give the attention of the stored rows. A forced "quantized_matmul" path keeps qmm for any rows. (The op path:
    where the CPU kernel is built, it takes the decode steps.)"""
    if ON_CUDA:
        pytest.skip("on CUDA 'auto' dequantizes (or runs the decode kernel): no quantized_matmul there")
    from veloxquant_mlx.cache.grouped import QMM_MAX_ROWS

    calls = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: calls.append(x.shape[-2]) or real(x, *a, **k))
    c = make_cache()
    K, V = c.update_and_fetch(rand(1, 2, 256, 64), rand(1, 2, 256, 64))
    q = rand(1, 4, 40, 64)  # a 40-row chunk over 256 stored rows, GQA 2
    K, V = c.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    got = c.attend(q, K, V, scale=0.125, mask="causal")
    assert calls == [] and not c._uses_qmm(QMM_MAX_ROWS + 1) and c._uses_qmm(QMM_MAX_ROWS)
    want = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125, mask="causal")
    assert float(mx.abs(got - want).max()) <= 1e-4 * float(mx.abs(want).max()) + 1e-5
    K, V = c.update_and_fetch(rand(1, 2, 1, 64), rand(1, 2, 1, 64))
    c.attend(rand(1, 4, 1, 64), K, V, scale=0.125, mask=None)
    assert calls and max(calls) <= QMM_MAX_ROWS  # the decode step: codes read by quantized_matmul
    c.attend_path = "quantized_matmul"
    assert c._uses_qmm(10 * QMM_MAX_ROWS)



def test_metal_auto_path_dequantizes_where_mlx_quantized_matmul_is_wrong(monkeypatch):
    """On Metal "auto" reads the codes with ``quantized_matmul`` only where a once-per-shape check finds it computes
    what dequantize + matmul does (``groupquant.qmm_agrees``; mlx#4250 left a head dim 96's last 32 value channels
    unwritten past 1024 tokens). Simulated here: a GPU device that is Metal, and that bug in the kernel."""
    from veloxquant_mlx.cache.primitives import groupquant as gq

    real = mx.quantized_matmul

    def unwritten_tail(x, w, *a, **k):
        out = real(x, w, *a, **k)
        keep = mx.arange(out.shape[-1]) < out.shape[-1] // 64 * 64
        return out if x.shape[-1] < 1024 or out.shape[-1] % 64 == 0 else mx.where(keep, out, 0.0)

    c64, c96 = make_cache(head_dim=64), make_cache(head_dim=96)
    for c, d in ((c64, 64), (c96, 96)):
        c.update_and_fetch(rand(1, 2, 64, d), rand(1, 2, 64, d))
    monkeypatch.setattr(mx, "quantized_matmul", unwritten_tail)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    gq.qmm_agrees.cache_clear()
    try:
        assert c64._uses_qmm()
        with pytest.warns(RuntimeWarning, match="mlx#4250"):
            assert not c96._uses_qmm()
    finally:
        gq.qmm_agrees.cache_clear()


def test_long_cpu_decode_step_splits_its_contraction_over_cpu_streams(monkeypatch, op_path):
    """Past ``CPU_SPLIT_MIN_ROWS`` stored rows a CPU decode step reads the codes in ``CPU_STREAMS`` parts (keys by
    channel halves, values by token halves; MLX runs each CPU stream on its own thread) and gets the attention of
    the stored rows, as the one-part step does (the op path: the CPU kernel, where built, takes these steps)."""
    from veloxquant_mlx.cache import attention

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the split is the CPU backend's")
    calls = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, w, *a, **k: calls.append(w.shape) or real(x, w, *a, **k))
    monkeypatch.setattr(attention, "CPU_SPLIT_MIN_ROWS", 128)
    c = make_cache()
    K, V = c.update_and_fetch(rand(1, 2, 96, 64), rand(1, 2, 96, 64))
    q, k1, v1 = rand(1, 4, 1, 64), rand(1, 2, 1, 64), rand(1, 2, 1, 64)
    outs = {}
    for streams, rows in [(2, 96), (2, 160), (1, 160)]:  # below the threshold, split, one part
        monkeypatch.setattr(attention, "CPU_STREAMS", streams)
        if c.n_quant < rows:
            K, V = c.update_and_fetch(rand(1, 2, rows - c.n_quant, 64), rand(1, 2, rows - c.n_quant, 64))
        calls.clear()
        Ks, Vs = c.update_and_fetch(k1, v1)
        got = c.attend(q, Ks, Vs, scale=0.125, mask=None)
        c.trim(1)
        want = mx.fast.scaled_dot_product_attention(q, Ks, Vs, scale=0.125, mask=None)
        assert float(mx.abs(got - want).max()) <= 1e-4 * float(mx.abs(want).max()) + 1e-5, (streams, rows)
        parts = 2 if (streams, rows) == (2, 160) else 1
        assert calls == [(1, 2, 64 // parts, rows // G * 4)] * parts + [(1, 2, rows // parts, 8)] * parts, calls
        outs[streams, rows] = got
    assert float(mx.abs(outs[2, 160] - outs[1, 160]).max()) <= 1e-5 * float(mx.abs(outs[1, 160]).max())



@pytest.mark.parametrize("bits, group", [(4, 32), (2, 32), (8, 64), (4, 16), (2, 12)])
def test_byte_dequantize_equals_dequantize_and_allocates_nothing(bits, group):
    """``dequantize_bytes`` reads either layout (MLX's for its groups, ``bitpack``'s else; a 2-bit group of 12 pads
    its word) exactly as ``dequantize``, and building it allocates no array (its constants are process-wide)."""
    q = gq.quantize(rand(2, 3, 5, group * 4), bits, group)
    want = gq.dequantize(*q, bits, group)
    assert bool(mx.array_equal(gq.dequantize_bytes(*q, bits, group), want))
    mx.eval(q)
    mx.synchronize()  # a GPU frees the comparison's temporaries when its stream finishes
    base, kept = mx.get_active_memory(), [gq.dequantize_bytes(*q, bits, group) for _ in range(8)]
    assert mx.get_active_memory() - base == 0 and len(kept) == 8
    with pytest.raises(ValueError, match="bits must be one of"):
        gq.dequantize_bytes(*gq.quantize(rand(1, 64), 3, 32), 3, 32)


@pytest.mark.parametrize("path", ["auto", "sdpa"])
def test_decode_steps_off_the_kernels_reuse_the_dense_rows_they_return(dispatch_installed, monkeypatch, path):
    """Off the CUDA kernels a decode step's attention reads the codes (``_attend_codes``): the dense rows that
    ``update_and_fetch`` returns are built once per group completion (``dequantize_bytes``: no array of their own)
    and reused by the next steps; still the stored rows' values. With ``attend_path="sdpa"`` the attention reads
    those rows: nothing kept."""
    from veloxquant_mlx.cache import kernels

    monkeypatch.setattr(kernels, "kernels_enabled", lambda: False)
    c = make_cache()
    c.attend_path = path
    c.update_and_fetch(rand(1, 2, 100, 64), rand(1, 2, 100, 64))  # 96 quantized rows, 4 residual
    builds = []
    real = c._byte_rows
    monkeypatch.setattr(c, "_byte_rows", lambda n: builds.append(n) or real(n))
    q = rand(1, 4, 1, 64)
    for step in range(3):
        K, V = c.update_and_fetch(rand(1, 2, 1, 64), rand(1, 2, 1, 64))
        n = c.n_quant
        memo = c.__dict__["_dense_memo"]
        if path == "auto":
            assert builds == [96] and memo.key == (n, c.k_codes) and memo.value[0].shape == (1, 2, 96, 64)
        else:
            assert builds == [] and memo.key is None
        assert bool(mx.array_equal(K[:, :, :n], c._keys_t(n).swapaxes(-1, -2)))
        assert bool(mx.array_equal(V[:, :, :n], c._values(n)))
        got = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=0.125, mask=None)
        want = sdpa(q, K, V, None, 0.125)
        assert float(mx.abs(got - want).max()) <= 1e-5 * float(mx.abs(want).max()) + 1e-6
