"""The reader's path of docs/ARCHITECTURE.md, walked once: a throw-away eviction method is added the way
the guide says (an options class, a scoring function on the shared eviction base, a registration), and
gets the whole mlx_lm contract -- building per layer, generation, the budget, exact ``nbytes``, a saved
and reloaded prompt cache -- from the shared layers, without a line of bookkeeping of its own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, QuantizerConfigError
from veloxquant_mlx.cache.base import EVICTION, add_method, register
from veloxquant_mlx.cache.contract import register_with_mlx_lm
from veloxquant_mlx.cache.eviction import BatchedEviction, EvictionKVCache, default_slack
from veloxquant_mlx.cache.options import EvictionOptions
from tiny_models import greedy, tiny_llama

NAME = "toy_value_norm"


# 1. the settings: one declaration each (budget and n_sink come from EvictionOptions)
class ValueNormOptions(EvictionOptions, method=NAME, evicts=True):
    """Options of the throw-away ``toy_value_norm``."""


# 2. the method: a scoring function on the shared base (which keeps, masks, trims, saves and counts)
class ValueNormKVCache(BatchedEviction, EvictionKVCache):
    """Keeps, per KV head, the sinks and the rows whose value vectors are longest (a throw-away rule)."""

    chunk_invariant = False  # evicts per call
    exact_trim = False  # evicted rows are gone

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink = o.budget, o.n_sink
        self.evict_slack = default_slack(self.budget)

    def score(self, obs_queries, obs_positions, scale):
        v = self.values[:, :, : self.rows].astype(mx.float32)
        return (v * v).sum(axis=-1)


@pytest.fixture(scope="module")
def toy_method():
    # 3. the registration (a built-in method instead adds a row to base._METHOD_TABLE and its options class
    # to options.ALL_OPTIONS, and decorates the class with @register_with_mlx_lm @register(NAME))
    remove = add_method(NAME, EVICTION, options=ValueNormOptions)
    cls = register_with_mlx_lm(register(NAME)(ValueNormKVCache))
    yield cls
    remove()


def config(**kw):
    return KVCacheConfig(method=NAME, options=ValueNormOptions(**kw))


def test_settings_are_checked_by_their_declaration(toy_method):
    assert config(budget=24).options.budget == 24 and KVCacheConfig(method=NAME).options.budget == 512
    with pytest.raises(QuantizerConfigError) as e:
        ValueNormOptions(budget=0)
    assert (e.value.field, e.value.value) == ("budget", 0)
    with pytest.raises(QuantizerConfigError):
        KVCacheConfig(method=NAME, options=ValueNormOptions(decode_evict="yes"))


def test_keeps_the_sinks_and_the_longest_values(toy_method):
    rng = np.random.default_rng(0)
    B, H, T, D, budget, sinks = 1, 2, 50, 16, 20, 3
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    v = rng.standard_normal((B, H, T, D)).astype(np.float32) * rng.uniform(0.1, 3.0, (B, H, T, 1)).astype(np.float32)
    cache = KVCacheFactory.create(config(budget=budget, n_sink=sinks))
    assert type(cache) is toy_method
    cache.update_and_fetch(mx.array(k), mx.array(v))  # no dispatch point: evicts right after returning the rows
    mx.eval(cache.state)
    kept = np.sort(np.array(cache.positions[:, :, : cache.rows]), axis=-1)
    norms = (v.astype(np.float64) ** 2).sum(-1)[0]  # [H, T]
    for h in range(H):
        best = sinks + np.argsort(-norms[h, sinks:], kind="stable")[: budget - sinks]
        assert kept[0, h].tolist() == sorted(list(range(sinks)) + best.tolist())
    assert cache.rows == budget and cache.offset == T


def test_the_contract_comes_from_the_shared_layers(toy_method, tmp_path):
    model = tiny_llama(seed=1, head_dim=16, n_layers=3)
    prompt = [(i * 37 + 11) % 100 for i in range(70)]
    caches = KVCacheBuilder.for_model(model, config(budget=24, n_sink=2, decode_evict=True))
    assert all(type(c) is toy_method for c in caches)
    out = greedy(model, prompt, caches, max_tokens=12, prefill_step_size=32)
    assert len(out) == 12
    slack = default_slack(24)
    for c in caches:
        assert c.offset == len(prompt) + len(out)  # mlx_lm feeds each token back (the last one ahead of time)
        assert c.rows <= 24 + slack  # the budget holds while decoding (decode_evict=True)
        held = sum(a.nbytes for a in (c.keys, c.values, c.positions))
        assert c.nbytes == held  # nbytes = the arrays it holds
    # a saved prompt cache reloads as the same method and continues exactly as the original
    path = str(tmp_path / "toy.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [toy_method] * 3
    token = mx.array([[out[-1]]])
    a, b = model(token, cache=caches), model(token, cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))


# ------------------------------------------------------------------ a quantizer on the grouped (KIVI) layout
from veloxquant_mlx.cache.base import QUANTIZATION  # noqa: E402
from veloxquant_mlx.cache.grouped import GroupedQuantCache  # noqa: E402
from veloxquant_mlx.cache.options import MethodOptions, groups, rng_seed  # noqa: E402

QNAME = "toy_sign_kivi"


class SignFlipOptions(MethodOptions, method=QNAME):
    """Options of the throw-away ``toy_sign_kivi``."""

    group_size: int = groups(32)
    seed: int = rng_seed(7)


class SignFlipKIVICache(GroupedQuantCache):
    """KIVI's codes of keys whose channels are multiplied by fixed random signs (a throw-away transform:
    the codes change, the layout, residual, attention, trim, state and bytes are the base's)."""

    chunk_invariant = True  # KIVI groups
    exact_trim = False  # KIVI's rule: raises when the trimmed rows completed a group
    dequant_only = "keys are stored with flipped channel signs"

    def _signs(self, d: int) -> mx.array:
        rng = np.random.default_rng(self.config.options.seed)
        return mx.array(np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float16))

    def _append_groups(self, kb, vb):
        super()._append_groups(kb * self._signs(kb.shape[-1]), vb)

    def _keys_t(self, n, dtype=mx.float32):
        kt = super()._keys_t(n, dtype)  # [B, H, D, n]
        return kt * self._signs(kt.shape[2])[:, None].astype(kt.dtype)


@pytest.fixture(scope="module")
def toy_quantizer():
    remove = add_method(QNAME, QUANTIZATION, options=SignFlipOptions)
    cls = register_with_mlx_lm(register(QNAME)(SignFlipKIVICache))
    yield cls
    remove()


def test_a_quantizer_gets_the_layout_and_the_contract(toy_quantizer, tmp_path):
    # its defining property: every stored key within one quantization step of its channel's group range
    # (MLX's affine grid keeps 0 exact, so its error reaches ~0.9 of a step, not the min/max rule's half)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 2, 70, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 70, 16)).astype(np.float32)
    cache = KVCacheFactory.create(KVCacheConfig(method=QNAME, bit_width_inlier=4, options=SignFlipOptions()))
    assert type(cache) is toy_quantizer
    cache.update_and_fetch(mx.array(k), mx.array(v))
    keys, _ = cache.update_and_fetch(mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 1, 16)))
    got = np.array(keys[:, :, :64].astype(mx.float32))
    g = k[:, :, :64].reshape(1, 2, 2, 32, 16)
    step = (g.max(axis=3) - g.min(axis=3)) / 15  # [1, 2, groups, D]
    err = np.abs(got.reshape(1, 2, 2, 32, 16) - g)
    assert (err <= step[:, :, :, None] + 2e-3 * (np.abs(g) + step[:, :, :, None])).all()
    assert (np.array(keys[:, :, 64:70].astype(mx.float32)) == k[:, :, 64:].astype(np.float16)).all()  # residual
    assert cache.nbytes == sum(a.nbytes for a in cache.held_arrays())
    # the contract on a model: generation through the compressed attention, save/load
    model = tiny_llama(seed=2, head_dim=16, n_layers=2)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=QNAME, bit_width_inlier=4, options=SignFlipOptions()))
    prompt = [(i * 13 + 5) % 100 for i in range(80)]
    out = greedy(model, prompt, caches, max_tokens=6, prefill_step_size=32)
    assert len(out) == 6 and all(c.offset == 86 for c in caches)
    kivi = KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=4))
    greedy(model, prompt, kivi, max_tokens=6, prefill_step_size=32)
    assert [c.nbytes for c in caches] == [c.nbytes for c in kivi]  # the base's layout: KIVI's bytes exactly
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    token = mx.array([[out[-1]]])
    np.testing.assert_array_equal(np.array(model(token, cache=caches)), np.array(model(token, cache=loaded)))


def test_method_modules_sit_in_their_family_folder_and_keep_their_old_paths():
    import importlib

    from veloxquant_mlx.cache import all_methods

    folder = {QUANTIZATION: "quantization", EVICTION: "eviction", "cross_layer": "crosslayer"}
    for info in all_methods():
        if info.implemented:
            module = info.cls.__module__
            assert module.split(".")[-2] == folder[info.family], (info.name, module)
            short = importlib.import_module("veloxquant_mlx.cache.methods." + module.rsplit(".", 1)[-1])
            assert short is importlib.import_module(module)  # the pre-family import path still works
