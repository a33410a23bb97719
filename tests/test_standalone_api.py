"""The spec's standalone-method examples, run as written, and the sliding-window wrapper."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache import (KVCacheBuilder, KVCacheConfig, KVCacheFactory, QuantizerConfigError,
                                  SlidingWindowKVCache)


def test_spec_builder_example_runs_as_written():
    cache = (
        KVCacheBuilder()
        .with_method("turboquant_prod")
        .with_head_dim(128)
        .with_bit_width(inlier=2, outlier=3)
        .with_jl_dim(128)
        .with_seed(42)
        .build()
    )
    mx.random.seed(0)
    keys, values = mx.random.normal((10, 128)), mx.random.normal((10, 128))
    for k, v in zip(keys, values):
        cache.append_key(k)
        cache.append_value(v)
    out = cache.attend(mx.random.normal((128,)))
    assert out.shape == (128,) and len(cache) == 10 and cache.memory_bytes() > 0


def test_builder_rejects_bit_width_list_on_build():
    with pytest.raises(QuantizerConfigError, match="for_model"):
        KVCacheBuilder().with_method("turboquant_mse").with_head_dim(64).with_bit_width([2, 4]).build()


def test_sliding_window_keeps_exactly_the_last_window_compressed():
    cfg = KVCacheConfig(method="turboquant_mse", head_dim=64, bit_width_inlier=4, sliding_window=8)
    windowed = KVCacheFactory.create(cfg)
    assert isinstance(windowed, SlidingWindowKVCache)
    mx.random.seed(1)
    K, V = mx.random.normal((30, 64)), mx.random.normal((30, 64))
    for k, v in zip(K, V):
        windowed.append_key(k)
        windowed.append_value(v)
    assert len(windowed) == 8
    ref = KVCacheFactory.create(KVCacheConfig(method="turboquant_mse", head_dim=64, bit_width_inlier=4))
    ref.append_key(K[-8:])
    ref.append_value(V[-8:])
    q = mx.random.normal((64,))
    assert mx.allclose(windowed.attend(q), ref.attend(q), atol=1e-5)
    # memory is the compressed window, not a full-precision ring buffer
    assert windowed.memory_bytes() <= ref.memory_bytes() * 4


def test_sliding_window_is_refused_for_mlx_lm_methods():
    with pytest.raises(QuantizerConfigError, match="sliding_window"):
        KVCacheFactory.create(KVCacheConfig(method="snapkv", sliding_window=16))


@pytest.mark.parametrize("method", ["turboquant_prod", "turboquant_mse", "polar", "qjl", "spectral"])
def test_attend_answers_a_numpy_float16_query_in_float16_like_an_mlx_one(method):
    import numpy as np

    cache = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=16))
    rng = np.random.default_rng(0)
    cache.append_key(rng.standard_normal((4, 16)).astype(np.float16))
    cache.append_value(rng.standard_normal((4, 16)).astype(np.float16))
    q = rng.standard_normal(16).astype(np.float16)
    out = cache.attend(q)
    assert out.dtype == mx.float16 and out.shape == (16,)
    assert mx.array_equal(out, cache.attend(mx.array(q)))
    assert cache.attend(q.astype(np.float64)).dtype == mx.float32  # MLX reads float64 NumPy as float32


def test_sliding_window_holds_the_window_whichever_of_key_and_value_comes_first():
    cfg = KVCacheConfig(method="turboquant_mse", head_dim=64, bit_width_inlier=4, sliding_window=3)
    windowed = KVCacheFactory.create(cfg)
    mx.random.seed(2)
    K, V = mx.random.normal((10, 64)), mx.random.normal((10, 64))
    for k, v in zip(K, V):
        windowed.append_value(v)
        windowed.append_key(k)
        assert len(windowed) <= 3
    ref = KVCacheFactory.create(KVCacheConfig(method="turboquant_mse", head_dim=64, bit_width_inlier=4))
    ref.append_key(K[-3:])
    ref.append_value(V[-3:])
    q = mx.random.normal((64,))
    assert len(windowed) == 3
    assert mx.allclose(windowed.attend(q), ref.attend(q), atol=1e-5)
