"""The standalone-method API and the configuration layer against the API reference
(shared/spec/cache-api-reference.txt): defects found in a conformance pass, each seen failing first."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx.cache as cache_pkg
from veloxquant_mlx.cache import (KVCacheBuilder, KVCacheConfig, KVCacheFactory, QuantizationObserver,
                                  QuantizerConfigError, SlidingWindowKVCache)
from veloxquant_mlx.cache.methods.quantization import turboquant as tq

STANDALONE = ["turboquant_prod", "turboquant_mse", "polar", "qjl", "spectral"]
D = 16


def _cache(method, **kw):
    return KVCacheFactory.create(KVCacheConfig(method=method, head_dim=D, **kw))


def _filled(method, n=12, seed=0, **kw):
    c = _cache(method, **kw)
    rng = np.random.default_rng(seed)
    c.append_key(rng.standard_normal((n, D)).astype(np.float32))
    c.append_value(rng.standard_normal((n, D)).astype(np.float32))
    return c


# --- KVCacheConfig.bit_width_outlier: "Bit-width for outlier channels (None -> same as inlier)";
# --- KVCacheBuilder.with_bit_width: "outlier ... (defaults to inlier if None)".


@pytest.mark.parametrize("method", ["turboquant_mse", "turboquant_prod"])
def test_outlier_bit_width_none_means_the_inlier_width(method):
    def build(outlier):
        return (KVCacheBuilder().with_method(method).with_head_dim(64).with_bit_width(3, outlier)
                .with_n_outlier_channels(8).with_seed(3).build())

    implicit, explicit = build(None), build(3)
    assert implicit.bit_width_outlier == 3
    k = mx.array(np.random.default_rng(1).standard_normal((20, 64)).astype(np.float32))
    implicit.append_key(k)
    explicit.append_key(k)
    assert mx.array_equal(implicit.reconstruct_keys(), explicit.reconstruct_keys())
    assert implicit.memory_bytes() == explicit.memory_bytes()


# --- class veloxquant_mlx.cache.TurboQuantKVCache(config): "KV cache backed by TurboQuantProd (or TurboQuantMSE)".


def test_turboquant_kvcache_is_the_spec_class_of_both_turboquant_methods():
    prod = tq.TurboQuantKVCache(KVCacheConfig(method="turboquant_prod", head_dim=D))
    mse = tq.TurboQuantKVCache(KVCacheConfig(method="turboquant_mse", head_dim=D))
    assert type(prod) is tq.TurboQuantProdKVCache and type(mse) is tq.TurboQuantMSEKVCache
    for method in ("turboquant_prod", "turboquant_mse"):
        assert isinstance(_cache(method), tq.TurboQuantKVCache)
    k = mx.array(np.random.default_rng(2).standard_normal((5, D)).astype(np.float32))
    direct = tq.TurboQuantKVCache(KVCacheConfig(method="turboquant_mse", head_dim=D))
    built = _cache("turboquant_mse")
    direct.append_key(k)
    built.append_key(k)
    assert mx.array_equal(direct.reconstruct_keys(), built.reconstruct_keys())
    with pytest.raises(QuantizerConfigError) as e:
        tq.TurboQuantKVCache(KVCacheConfig(method="polar", head_dim=D))
    assert e.value.field == "method" and "turboquant_mse" in str(e.value)


def test_turboquant_kvcache_is_exported_where_the_spec_names_it():
    assert cache_pkg.TurboQuantKVCache is tq.TurboQuantKVCache


# --- key_scores / reconstruction on an empty cache: "(n,) for q (d,)", n = 0 (attend already answers zeros).


@pytest.mark.parametrize("method", STANDALONE)
def test_empty_cache_scores_and_reconstructs_to_empty_arrays(method):
    c = _cache(method)
    q = mx.ones((D,))
    for _ in range(2):  # fresh, then after a reset
        assert c.key_scores(q).shape == (0,) and c.key_scores(mx.ones((3, D))).shape == (3, 0)
        assert c.reconstruct_keys().shape == (0, D) and c.reconstruct_values().shape == (0, D)
        c.append_key(mx.ones((2, D)))  # keys without values: no values to rebuild yet
        assert c.reconstruct_values().shape == (0, D) and c.key_scores(q).shape == (2,)
        c.reset()


# --- inputs: "(d,) or (n, d) floating" -- any NumPy floating dtype, not an MLX C++ cast error.


@pytest.mark.parametrize("method", STANDALONE)
def test_numpy_longdouble_reads_like_float64(method):
    x = np.random.default_rng(5).standard_normal((4, D))
    a, b = _cache(method), _cache(method)
    a.append_key(x.astype(np.longdouble))
    a.append_value(x.astype(np.longdouble))
    b.append_key(x)
    b.append_value(x)
    q = x[0]
    out = a.attend(q.astype(np.longdouble))
    assert out.dtype == b.attend(q).dtype and mx.array_equal(out, b.attend(q))


# --- KVCacheConfig.observers: "List of QuantizationObserver instances".


def test_config_refuses_observers_that_are_not_observers():
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheConfig(method="polar", head_dim=D, observers=[object()])
    assert e.value.field == "observers" and "QuantizationObserver" in str(e.value)
    obs = QuantizationObserver()
    _cache("polar", observers=[obs])
    assert [ev.kind for ev in obs.events] == ["created"]


# --- SlidingWindowKVCache(inner, window_size): "Maintains ... the most recent window_size token slots".


def test_sliding_window_around_a_filled_cache_keeps_only_the_window():
    inner = _filled("turboquant_mse", n=20, seed=6)
    win = SlidingWindowKVCache(inner, 8)
    assert len(win) == 8
    ref = _cache("turboquant_mse")
    rng = np.random.default_rng(6)
    k, v = rng.standard_normal((20, D)).astype(np.float32), rng.standard_normal((20, D)).astype(np.float32)
    ref.append_key(k[-8:])
    ref.append_value(v[-8:])
    q = mx.ones((D,))
    assert mx.allclose(win.attend(q), ref.attend(q), atol=1e-5)
