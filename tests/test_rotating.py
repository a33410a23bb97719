"""The compressed sliding-window ring (cache/rotating.py) against mlx_lm's RotatingKVCache, call by call.

The reference is mlx_lm's own ring fed the rows our codes decode to: at every call both must return the
same rows in the same slots (so the same positions are visible), build the same masks, and give the same
attention output; offset, size, trim and state behave as RotatingKVCache's."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, save_prompt_cache

import veloxquant_mlx  # noqa: F401  (OpenBLAS before mlx on Linux)
from veloxquant_mlx.cache import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.rotating import RING_CLASSES

B, H, D = 1, 2, 16
# prefill chunks and decode steps; crosses the window several times, a chunk longer than the window
CALLS = [5, 1, 1, 1, 1, 1, 3, 1, 1, 1, 11, 1, 1, 2, 1, 1, 1, 1, 1]


def ring(method, bits=4, max_size=8, keep=0):
    return RING_CLASSES[method](KVCacheConfig(method=method, bit_width_inlier=bits), max_size, keep)


def rows(n, seed):
    mx.random.seed(seed)
    return mx.random.normal((B, H, n, D)), mx.random.normal((B, H, n, D)) * 0.5


def positions_ring(max_size, keep, calls):
    """mlx_lm's ring fed each row's position (as its key): which positions sit in which slot."""
    ref, out, t = RotatingKVCache(max_size, keep), [], 0
    for n in calls:
        pos = mx.broadcast_to(mx.arange(t, t + n, dtype=mx.float32)[None, None, :, None], (B, H, n, D))
        out.append(ref.update_and_fetch(pos, pos)[0][0, 0, :, 0])
        t += n
    return out


def call_both(ours, ref, k, v, window=None):
    """One call as a model makes it: the masks first (mlx_lm builds them before ``update_and_fetch``),
    then the rows; the reference gets the rows our codes stand for. Checks both agree; returns the masks."""
    n = k.shape[2]
    mask, rmask = ours.make_mask(n, window_size=window), ref.make_mask(n, window_size=window)
    assert type(mask) is type(rmask) and (not isinstance(mask, mx.array) or mx.array_equal(mask, rmask))
    got = ours.update_and_fetch(k, v)
    rk, rv = ref.update_and_fetch(*ours._decode(ours._encode(k, v), mx.float32))
    assert got[0].shape == rk.shape and got[1].shape == rv.shape
    assert mx.array_equal(got[0], rk) and mx.array_equal(got[1], rv)  # same decoded rows, same slots
    q = mx.random.normal((B, 2 * H, n, D))
    out = ours.attend(q, *got, scale=D**-0.5, mask=mask)
    expect = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=D**-0.5, mask=rmask)
    # same inputs, same kernel: equal up to the float32 rounding of outputs of this magnitude
    assert mx.allclose(out, expect, rtol=0, atol=1e-6 * float(mx.abs(rv).max())).item()
    assert (ours.offset, ours.size(), ours.is_trimmable()) == (ref.offset, ref.size(), ref.is_trimmable())
    return got, mask


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
@pytest.mark.parametrize("keep", [0, 3])
def test_ring_matches_rotating_kv_cache_call_by_call(method, keep):
    ours, ref = ring(method, keep=keep), RotatingKVCache(8, keep)
    where = positions_ring(8, keep, CALLS)
    for step, n in enumerate(CALLS):
        past = min(7, ours.offset)  # past rows a multi-row call's mask covers (RotatingKVCache's rule)
        got, mask = call_both(ours, ref, *rows(n, step), window=8)  # as the sliding layers' models pass it
        assert got[0].shape[2] == where[step].size  # as many visible rows as the ring of positions holds
        if n > 1 and past + n > 8:  # the window cuts into this call: an explicit banded mask
            assert mx.array_equal(mask, create_causal_mask(n, past, window_size=8))
        else:
            assert mask in (None, "causal")


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_window_smaller_than_the_ring_gets_rotating_kv_caches_decode_mask(method):
    ours, ref = ring(method, max_size=8), RotatingKVCache(8)
    for step, n in enumerate([6, 1, 1, 1, 1, 1, 1]):
        call_both(ours, ref, *rows(n, 10 + step), window=5)
    m = ours.make_mask(1, window_size=5)
    assert isinstance(m, mx.array) and int(m.sum()) == 5  # only the last 5 positions, wherever their slots are


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_trim_follows_rotating_kv_cache(method):
    ours, ref = ring(method, max_size=16), RotatingKVCache(16)
    calls = [6, 1, 1, 1]
    for step, n in enumerate(calls):
        call_both(ours, ref, *rows(n, 20 + step))
    assert ours.is_trimmable() and ours.trim(3) == ref.trim(3) == 3  # offset < max_size: exact
    for step, n in enumerate([1, 4, 1, 1, 1, 9, 1]):  # continue past the window and compare every call
        call_both(ours, ref, *rows(n, 30 + step))
    assert not ours.is_trimmable() and not ref.is_trimmable()


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_state_round_trip_deepcopy_and_bytes(method, tmp_path):
    c = ring(method, max_size=8, keep=2)
    for step, n in enumerate([5, 1, 1, 1, 1]):
        c.update_and_fetch(*rows(n, 40 + step))
    path = str(tmp_path / "ring.safetensors")
    save_prompt_cache(path, [c])
    loaded = load_prompt_cache(path)[0]
    twin = copy.deepcopy(c)
    assert type(loaded) is type(c) and (loaded.offset, loaded._idx, loaded.keep, loaded.max_size) == (9, 3, 2, 8)
    k, v = rows(1, 50)
    for other in (loaded, twin):
        a, b = copy.deepcopy(c).update_and_fetch(k, v), other.update_and_fetch(k, v)
        assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
    # nbytes: the code arrays of 8 slots, nothing at full precision (b = 4, D = 16, one channel group)
    per_row = {"kivi": 2 * (8 + 4), "waterfill": (8 + 4) + (8 + 2)}[method]  # code words + fp16 scale(/bias)
    assert c.nbytes == sum(getattr(c, n).nbytes for n in c.array_fields) == B * H * 8 * per_row
    assert c.nbytes <= 0.4 * B * H * 8 * 2 * D * 2  # vs the same 8 slots of float16 keys and values


@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_codes_error_is_bounded_and_shrinks_with_bits(method):
    k, v = rows(64, 60)
    errs = {}
    for bits in (2, 4, 8):
        c = ring(method, bits=bits, max_size=64)
        dk, dv = c.update_and_fetch(k, v)
        rms = lambda a, b: float(mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2)))  # noqa: E731
        errs[bits] = (rms(dk, k), rms(dv, v))
        if bits == 4:
            # per-token affine keys: each element within half a step of its group ((max - min) / 15)
            span = k.max(axis=-1, keepdims=True) - k.min(axis=-1, keepdims=True)
            assert bool(mx.all(mx.abs(dk - k) <= span / 15 * 0.5 * 1.01 + 1e-3))
    assert errs[2] > errs[4] > errs[8]
    assert errs[4][0] < 0.1 and errs[4][1] < 0.15 and errs[8][0] < 0.01


def test_bad_bit_width_names_the_field():
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier"):
        RING_CLASSES["waterfill"](KVCacheConfig(method="waterfill", bit_width_inlier=[4]), 8)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("method", sorted(RING_CLASSES))
def test_active_memory_of_a_filled_ring_is_its_nbytes(method, dtype):
    """As tests/test_memory_honesty.py for the methods: after a 600-row prompt in chunks of 256 and 24
    decode steps, nothing but the ring's code arrays stays alive (no view into a prompt-sized buffer)."""
    import gc

    previous = mx.set_cache_limit(0)
    try:
        def fill(n_prompt, n_decode):
            c = ring(method, max_size=64, keep=4)
            for a in range(0, n_prompt, 256):
                k, v = rows(min(256, n_prompt - a), a)
                mx.eval(c.update_and_fetch(k.astype(getattr(mx, dtype)), v.astype(getattr(mx, dtype))))
            for i in range(n_decode):
                k, v = rows(1, 1000 + i)
                mx.eval(c.update_and_fetch(k.astype(getattr(mx, dtype)), v.astype(getattr(mx, dtype))))
            return c

        fill(100, 2)  # process-wide constants (codebooks) are built here
        gc.collect()
        base = mx.get_active_memory()
        c = fill(600, 24)
        gc.collect()
        grown = mx.get_active_memory() - base
        assert c.size() == 64 and grown <= c.nbytes, f"{grown} bytes alive for {c.nbytes} counted"
    finally:
        mx.set_cache_limit(previous)


@pytest.mark.parametrize("field,value", [("_idx", 99), ("keep", 8), ("max_size", 0), ("_idx", -1)])
def test_a_forged_ring_state_is_refused(field, value):
    import json

    c = ring("kivi", max_size=8)
    for step, n in enumerate([5, 1, 1, 1, 1]):
        c.update_and_fetch(*rows(n, 70 + step))
    state = dict(c.state)
    RING_CLASSES["kivi"].from_state(dict(state))  # the real one loads
    meta = json.loads(state["meta"])
    meta["scalars"][field] = value
    state["meta"] = json.dumps(meta)
    with pytest.raises(ValueError, match=field.lstrip("_")):
        RING_CLASSES["kivi"].from_state(state)
