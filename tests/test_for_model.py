"""KVCacheBuilder.for_model: layer discovery, per-layer head_dim and bits, wrappers, coordinators."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from tiny_models import VOCAB, greedy, tiny_gemma3, tiny_llama
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, QuantizerConfigError, SnapKVOptions, base, dispatch


def snap_config(**kw):
    return KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=64), dtype=mx.float32, **kw)


def test_head_dim_is_taken_from_each_layer():
    caches = KVCacheBuilder.for_model(tiny_llama(head_dim=32), snap_config(head_dim=128))
    assert [c.config.head_dim for c in caches] == [32, 32, 32]


def test_per_layer_bit_widths_are_consumed_in_order():
    caches = KVCacheBuilder.for_model(tiny_llama(n_layers=3), snap_config(bit_width_inlier=[2, 4, 8]))
    assert [c.config.bit_width_inlier for c in caches] == [2, 4, 8]
    with pytest.raises(QuantizerConfigError, match="list of 3 ints"):
        KVCacheBuilder.for_model(tiny_llama(n_layers=3), snap_config(bit_width_inlier=[2, 4]))


def test_sliding_window_layers_keep_the_models_own_cache():
    model = tiny_gemma3()
    caches = KVCacheBuilder.for_model(model, snap_config(bit_width_inlier=[4, 2]))
    kinds = [type(c).__name__ for c in caches]
    assert kinds == [type(c).__name__ if type(c) is not KVCache else "SnapKVKVCache" for c in make_prompt_cache(model)]
    assert "RotatingKVCache" in kinds and "SnapKVKVCache" in kinds
    assert [c.config.bit_width_inlier for c in caches if hasattr(c, "config")] == [4, 2]


class Wrapper(nn.Module):
    """A VLM-style wrapper: the text model lives in ``language_model``."""

    def __init__(self, lm):
        super().__init__()
        self.language_model = lm

    def __call__(self, *a, **kw):
        return self.language_model(*a, **kw)

    @property
    def layers(self):
        return self.language_model.layers


def test_vlm_style_wrapper():
    lm = tiny_llama()
    caches = KVCacheBuilder.for_model(Wrapper(lm), snap_config())
    assert len(caches) == len(lm.layers) and all(type(c).__name__ == "SnapKVKVCache" for c in caches)
    prompt = mx.random.randint(0, VOCAB, (20,)).tolist()
    assert greedy(lm, prompt, caches, 4) == greedy(lm, prompt, make_prompt_cache(lm), 4)


def test_for_model_installs_the_dispatch_point_unless_told_not_to():
    dispatch.uninstall()
    KVCacheBuilder.for_model(tiny_llama(), snap_config(), install_dispatch=False)
    assert not dispatch.installed()
    KVCacheBuilder.for_model(tiny_llama(), snap_config())
    assert dispatch.installed()


def test_unimplemented_method_is_refused_not_faked(monkeypatch):
    monkeypatch.delitem(base._CLASSES, "snapkv")
    with pytest.raises(NotImplementedError, match="snapkv.*not implemented"):
        KVCacheBuilder.for_model(tiny_llama(), snap_config())


def test_cross_layer_coordinator_hook_gets_every_layer_and_lives_per_prompt_cache(monkeypatch):
    """A class with ``build_layers`` receives all layer configs at once (for a shared coordinator);
    two prompt caches built from one model never share it."""
    snap_cls = base._CLASSES["snapkv"]

    class Coordinated(snap_cls):
        @classmethod
        def build_layers(cls, configs):
            coordinator = {"layers": len(configs)}
            out = [cls(c) for c in configs]
            for c in out:
                c.coordinator = coordinator
            return out

    monkeypatch.setitem(base._CLASSES, "snapkv", Coordinated)
    a = KVCacheBuilder.for_model(tiny_llama(n_layers=3), snap_config())
    b = KVCacheBuilder.for_model(tiny_llama(n_layers=3), snap_config())
    assert a[0].coordinator is a[2].coordinator and a[0].coordinator == {"layers": 3}
    assert a[0].coordinator is not b[0].coordinator
