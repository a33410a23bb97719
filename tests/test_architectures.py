"""Every layer compressed, on the architectures people run (issue 14, part 2).

Tiny random-weight instances of mlx_lm's own model classes (tests/tiny_models.ARCHITECTURES: llama,
qwen2, qwen3, gemma3_text and ministral3 with sliding-window layers, phi3, gpt_oss with attention sinks):
``KVCacheBuilder.for_model`` gives a quantizer's compressed form to *every* attention layer (the
sliding ones get the compressed ring, cache/rotating.py), an eviction method to the full-attention
layers (sliding layers keep mlx_lm's ring, which the window bounds); generation follows the plain cache
within the method's tolerance; saved (mlx_lm's prompt-cache file) and copied caches continue identically;
architectures whose cache holds no K/V rows are refused.

Tolerances (mean next-token KL against mlx_lm's own caches, 32 teacher-forced decode steps after a
64-token prompt prefilled in chunks of 16): tiny random models attend sharply, so 4 bits moves them a
lot (kivi and waterfill measured 0.027-0.152 on these seven) and the bound is 0.5, as in test_kivi; 8 bits
must be nearly lossless (measured <= 6.4e-4; bound 5e-3) and at least 10x below 4 bits (a decision, whatever
the machine's float32 sums); an eviction budget above the context evicts nothing, so only the eviction
cache's float16 rows remain (measured <= 2.6e-6; bound 1e-4). Measured on the 2-core AMD EPYC build
machine, 2026-12-01.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (ArraysCache, KVCache, RotatingKVCache, load_prompt_cache, make_prompt_cache,
                                  save_prompt_cache)

from tiny_models import ARCHITECTURES, VOCAB, greedy, tiny_deepseek, tiny_lfm2, tiny_mamba
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, QuantizerConfigError, SnapKVOptions, WaterfillOptions
from veloxquant_mlx.cache.rotating import RING_CLASSES, RotatingQuantKVCache
from veloxquant_mlx.eval.fidelity import next_token_fidelity
from veloxquant_mlx.measure import fp16_kv_bytes, kv_bytes

N_CTX, N_SCORE, STEP = 64, 32, 16


def quant(method, bits):
    options = WaterfillOptions(residual_length=16) if method == "waterfill" else None
    return KVCacheConfig(method=method, bit_width_inlier=bits, options=options)


def snap(budget):
    return KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=budget, obs_window=8))


@pytest.fixture(scope="module")
def tokens():
    mx.random.seed(1)
    return mx.random.randint(0, VOCAB, (N_CTX + N_SCORE,)).tolist()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request):
    return request.param, ARCHITECTURES[request.param]()


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_a_quantizer_compresses_every_layer(arch, method):
    name, model = arch
    plain = make_prompt_cache(model)
    caches = KVCacheBuilder.for_model(model, quant(method, 4))
    for mine, theirs in zip(caches, plain):
        if type(theirs) is RotatingKVCache:
            assert type(mine) is RING_CLASSES[method]
            assert (mine.max_size, mine.keep) == (theirs.max_size, theirs.keep)
        else:
            assert type(theirs) is KVCache and type(mine).method_name == method
    if name in ("gemma3_text", "ministral3", "gpt_oss"):
        assert any(isinstance(c, RotatingQuantKVCache) for c in caches)


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_quantized_generation_follows_the_plain_cache(arch, method, tokens):
    _, model = arch
    kl = {b: next_token_fidelity(model, tokens, N_CTX, N_SCORE, quant(method, b), STEP).kld for b in (4, 8)}
    assert kl[8] < 5e-3 and kl[4] < 0.5 and kl[8] < kl[4] / 10, kl


def test_sliding_layers_hold_less_than_their_float16_window(arch):
    """kivi-4 after a 200-token prompt + 8 decode steps: a ring holds its window's codes (24 bytes per row
    and KV head at D = 16 vs 64 in float16: 0.375x), and the whole model less than 0.55x its float16 rows
    (KIVI's full layers keep a float16 residual of up to 31 rows: 0.49x at 208 tokens)."""
    _, model = arch
    caches = KVCacheBuilder.for_model(model, quant("kivi", 4))
    tokens = mx.random.randint(0, VOCAB, (208,), key=mx.random.key(2))
    model(tokens[None, :200], cache=caches)
    for i in range(200, 208):
        model(tokens[None, i : i + 1], cache=caches)
    mx.eval([c.state for c in caches])
    H, D = 2, 16  # every tiny model: 2 KV heads of 16 dims
    for c in caches:
        if isinstance(c, RotatingQuantKVCache):
            assert c.nbytes == 0.375 * c.max_size * H * 2 * D * 2, (type(c).__name__, c.nbytes)
    assert kv_bytes(caches) <= 0.55 * fp16_kv_bytes(model, 208)


def test_eviction_keeps_the_sliding_ring_and_evicts_full_layers(arch, tokens):
    _, model = arch
    caches = KVCacheBuilder.for_model(model, snap(16))
    greedy(model, tokens[:N_CTX], caches, max_tokens=4, prefill_step_size=STEP)
    for mine, theirs in zip(caches, make_prompt_cache(model)):
        if type(theirs) is RotatingKVCache:  # mlx_lm's own ring: its window already bounds the layer
            assert type(mine) is RotatingKVCache and mine.size() == theirs.max_size
        else:
            assert type(mine).method_name == "snapkv" and mine.size() < N_CTX // 2
    r = next_token_fidelity(model, tokens, N_CTX, N_SCORE, snap(4 * N_CTX), STEP)
    assert r.kld < 1e-4, r.kld  # a budget above the context evicts nothing


@pytest.mark.parametrize("store", sorted(RING_CLASSES))
def test_evict_and_quantize_compresses_every_layer(arch, store, tokens, tmp_path):
    """snapkv whose kept rows are a quantizer's codes: full layers get the composed cache, sliding layers the
    quantizer's ring; with a budget above the context only quantization error is left (8 bits: as small as
    the quantizer's own); the caches save, load and continue as they were."""
    _, model = arch

    def composed(budget, bits):
        q = WaterfillOptions(residual_length=16) if store == "waterfill" else store
        return KVCacheConfig(method="snapkv", bit_width_inlier=bits,
                             options=SnapKVOptions(budget=budget, obs_window=8, quantize=q))

    caches = KVCacheBuilder.for_model(model, composed(16, 4))
    greedy(model, tokens[:N_CTX], caches, max_tokens=4, prefill_step_size=STEP)
    for mine, theirs in zip(caches, make_prompt_cache(model)):
        if type(theirs) is RotatingKVCache:
            assert type(mine) is RING_CLASSES[store] and mine.size() == theirs.max_size
        else:
            assert type(mine).__name__ == "QuantizedSnapKVKVCache" and mine.size() < N_CTX // 2
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    t = mx.array([[tokens[N_CTX]]])
    mx.eval(model(t, cache=caches), model(t, cache=loaded))
    nxt = mx.array([[tokens[N_CTX + 1]]])
    assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=loaded))
    kl = next_token_fidelity(model, tokens, N_CTX, N_SCORE, composed(4 * N_CTX, 8), STEP).kld
    assert kl < 5e-3, kl


@pytest.mark.parametrize("version", [2, 3])
def test_mla_is_refused_with_a_clear_error(version):
    model = tiny_deepseek(version)
    assert model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)).shape == (1, 3, VOCAB)  # mlx_lm's own cache
    for config in (quant("kivi", 4), snap(16)):
        with pytest.raises(QuantizerConfigError, match="multi-head latent attention"):
            KVCacheBuilder.for_model(model, config)


def test_a_pure_state_space_model_is_refused():
    with pytest.raises(QuantizerConfigError, match="state-space layers hold no K/V rows"):
        KVCacheBuilder.for_model(tiny_mamba(), quant("kivi", 4))


def test_a_hybrid_keeps_its_state_layers_and_compresses_attention(tokens):
    model = tiny_lfm2()
    caches = KVCacheBuilder.for_model(model, quant("kivi", 8))
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["ArraysCache", "KIVIKVCache", "ArraysCache"]
    assert all(type(c) is ArraysCache for c in caches[::2])
    r = next_token_fidelity(model, tokens, N_CTX, N_SCORE, quant("kivi", 8), STEP)
    assert r.kld < 5e-3, r.kld


def test_a_bit_width_list_covers_the_sliding_layers_too():
    model = ARCHITECTURES["gemma3_text"]()  # sliding, full, sliding, full
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=[2, 4, 8, 4]))
    assert [c.config.bit_width_inlier for c in caches] == [2, 4, 8, 4]
    assert [type(c).__name__ for c in caches][::2] == ["RotatingKIVICache"] * 2
    with pytest.raises(QuantizerConfigError, match="list of 4 ints .*sliding windows"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=[4, 4]))


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_saved_and_copied_caches_continue_identically(arch, method, tokens, tmp_path):
    """The contract's state on every architecture: mlx_lm's save/load_prompt_cache and deepcopy of the
    whole model's caches (rings included) continue with the same logits as the original."""
    import copy

    _, model = arch
    caches = KVCacheBuilder.for_model(model, quant(method, 4))
    for a in range(0, 40, STEP):
        model(mx.array(tokens[a : min(a + STEP, 40)])[None], cache=caches)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    twins = [load_prompt_cache(path), copy.deepcopy(caches)]
    assert [type(c) for c in twins[0]] == [type(c) for c in caches]
    for t in tokens[40:44]:
        want = model(mx.array([[t]]), cache=caches)
        for twin in twins:
            assert mx.array_equal(model(mx.array([[t]]), cache=twin), want)
