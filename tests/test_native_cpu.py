"""The CPU kernels (``veloxquant_mlx/cache/native``): waterfill's, KIVI's and TurboQuant-RVQ's decode steps over
their codes in one C++ pass, against float64 attention over the rows the cache stores, against the op path, and the
partials' own arithmetic;
the build's cache and failure handling; the joint softmax's partials form."""

from __future__ import annotations

import copy
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch, native
from veloxquant_mlx.cache.lowrank import LowRankKVCache
from veloxquant_mlx.cache.methods.crosslayer.minicache import BLOCK as MC_BLOCK, MiniCacheKVCache
from veloxquant_mlx.cache.methods.crosslayer.xkv import XKVKVCache
from veloxquant_mlx.cache.methods.crosslayer.xquant import XQuantKVCache
from veloxquant_mlx.cache.methods.quantization.adakv import AdaKVKVCache
from veloxquant_mlx.cache.methods.quantization.amc import AMCKVCache
from veloxquant_mlx.cache.methods.quantization.anchorkv import AnchorKVCache
from veloxquant_mlx.cache.options import (AdaKVOptions, AgeTieredOptions, AMCOptions, AnchorKVOptions, CacheGenOptions,
                                          GEAROptions, KittyOptions, KVQuantOptions, KVTCOptions, MiniCacheOptions,
                                          NSNQuantOptions, PaluOptions,
                                          SKVQOptions, SVDqOptions,
                                          TurboQuantRVQOptions, XKVOptions, XQuantOptions, ZipCacheOptions)
from veloxquant_mlx.cache.primitives import bitpack
from veloxquant_mlx.cache.primitives import lowrank_fit as lr
from veloxquant_mlx.cache.primitives.bitpack import unpack_bits
from veloxquant_mlx.cache.grouped import GroupedQuantCache
from veloxquant_mlx.cache.kernels import _common
from veloxquant_mlx.cache.kernels.waterfill import rope_tables
from veloxquant_mlx.cache.methods.quantization import turboquant_rvq as tq
from veloxquant_mlx.cache.methods.quantization import vecinfer as vi
from veloxquant_mlx.cache.methods.quantization.age_tiered import AgeTieredKVCache
from veloxquant_mlx.cache.methods.quantization.gear import GEARKVCache
from veloxquant_mlx.cache.methods.crosslayer.palu import PALUKVCache
from veloxquant_mlx.cache.methods.quantization.cachegen import CacheGenKVCache
from veloxquant_mlx.cache.methods.quantization.kitty import KittyKVCache
from veloxquant_mlx.cache.methods.quantization.kvquant import KVQuantKVCache
from veloxquant_mlx.cache.methods.quantization.nsnquant import NSNQuantKVCache
from veloxquant_mlx.cache.methods.quantization.skvq import SKVQKVCache
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import TurboQuantRVQKVCache
from veloxquant_mlx.cache.methods.quantization.vecinfer import VecInferKVCache
from veloxquant_mlx.cache.methods.quantization.waterfill import WaterfillKVCache
from veloxquant_mlx.cache.methods.quantization.zipcache import ZipCacheKVCache
from veloxquant_mlx.cache.native import build
from veloxquant_mlx.cache.settings import build_config
from veloxquant_mlx.cache.window import Partials, joint_attention

from test_decode_kernels import _kivi, _kivi_sink, _rel, _rows, _softmax_attention64
from test_waterfill import make as make_waterfill

ON_CPU = mx.default_device() == mx.cpu
HAS_NANOBIND = importlib.util.find_spec("nanobind") is not None
# Where nanobind (the ``cpu`` extra) is installed the kernels must build: a failed build fails these tests
KERNELS = pytest.mark.skipif(not (ON_CPU and HAS_NANOBIND),
                             reason="the CPU kernels need the CPU device and nanobind (the 'cpu' extra)")


def _spy_kernel(monkeypatch, cls) -> list:
    """Built kernels (a failed build fails the test), and the decode steps of ``cls`` caches that took them."""
    assert native.module() is not None, "the CPU kernels did not build (see the warning)"
    calls = []
    real = cls._cpu_part
    monkeypatch.setattr(cls, "_cpu_part", lambda c, q, n: calls.append(n) or real(c, q, n))
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """Waterfill's decode steps that took the CPU kernel."""
    return _spy_kernel(monkeypatch, WaterfillKVCache)


def _rope(kind, D):
    if kind is None:
        return None
    if kind == "partial":  # RoPE on the first half of the channels only
        return nn.RoPE(D // 2, base=10000.0)
    return nn.RoPE(D, traditional=kind == "traditional", base=10000.0)


def _feed(c, H, R, D, n, rng):
    k, v, q = _rows(rng, H, n, D), _rows(rng, H, n, D), _rows(rng, H * R, n, D)
    K, V = c.update_and_fetch(k, v)
    return dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")


def _steps_equal_float64(c, H, R, D, steps, rng):
    """``steps`` decode steps of cache ``c`` (sink logits every other step), each equal to float64 attention over the
    rows ``update_and_fetch`` returned (the rows the cache stores)."""
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32))
    for i in range(steps):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        sk = sinks if i % 2 else None
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sk)
        want = _softmax_attention64(q, K, V, D**-0.5, None if sk is None else np.array(sk))
        assert _rel(out, want) < 1e-4, (i, c.offset)


@KERNELS
@pytest.mark.parametrize("H,R,D,bits,prompt,steps,rope", [
    (1, 1, 64, 4, 37, 20, None),
    (2, 3, 64, 4, 101, 19, "rope"),
    (3, 4, 32, 4, 64, 33, "traditional"),
    (2, 2, 64, 4, 161, 18, "partial"),
    (2, 8, 128, 4, 300, 6, "rope"),
    (1, 2, 64, 2, 90, 8, "rope"),
    (2, 1, 64, 3, 90, 8, "traditional"),
    (1, 3, 64, 8, 90, 8, None)])
def test_waterfill_cpu_kernel_equals_float64_attention_over_the_stored_rows(H, R, D, bits, prompt, steps, rope,
                                                                             kernel_calls):
    """Decode steps taken by the CPU kernel (window compactions crossed, sink logits every other step) attend over
    exactly the rows the cache stores: float64 attention over ``update_and_fetch``'s rows. RoPE split in halves,
    interleaved, on part of the channels, or none; GQA 1-8; value widths 2, 3, 4 (nibble-major) and 8."""
    c = make_waterfill(bits=bits, rope=_rope(rope, D), D=D)
    rng = np.random.default_rng(H * 100 + prompt + bits)
    _feed(c, H, R, D, prompt, rng)
    assert c.calibrated
    _steps_equal_float64(c, H, R, D, steps, rng)
    assert len(kernel_calls) == steps and "waterfill_cpu" in _common._checked


@KERNELS
def test_cpu_kernel_takes_a_batch_of_two_sequences_in_one_cache(kernel_calls):
    """A single cache holding two sequences (B = 2, same length): each attends over its own stored rows."""
    B, H, R, D = 2, 2, 3, 64
    c = make_waterfill(rope=_rope("rope", D), D=D)
    rng = np.random.default_rng(11)
    rows = lambda n, h: mx.array(rng.normal(size=(B, h, n, D)).astype(np.float32))  # noqa: E731
    K, V = c.update_and_fetch(rows(300, H), rows(300, H))
    dispatch.dispatched_sdpa(rows(300, H * R), K, V, cache=c, scale=D**-0.5, mask="causal")
    for i in range(12):
        K, V = c.update_and_fetch(rows(1, H), rows(1, H))
        q = rows(1, H * R)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < 1e-4, i
    assert len(kernel_calls) == 12


def _partials64(c, q, n):
    """float64 (m, l, acc) of the first ``n`` quantized rows from the op path's own decoding (keys with RoPE,
    rotated-domain values times their scales)."""
    keys = np.asarray(c._keys(0, n), np.float64)  # [B, H, n, D]
    vals = np.asarray(c._value_codes(0, n), np.float64) * np.asarray(c.v_scales[:, :, :n], np.float64)[..., None]
    q = np.asarray(q, np.float64)
    s = np.einsum("bhrd,bhnd->bhrn", q, keys)
    m = s.max(axis=-1)
    p = np.exp(s - m[..., None])
    spread = np.einsum("bhrd,bhnd->bhrn", np.abs(q), np.abs(keys)).max()  # the scores' float32 rounding scales so
    return m, p.sum(axis=-1), np.einsum("bhrn,bhnd->bhrd", p, vals), spread


@KERNELS
@pytest.mark.parametrize("n_rows", [4097, 1000, 63])
def test_cpu_kernel_partials_over_blocks_and_threads_equal_float64(n_rows, kernel_calls):
    """The kernel's partials (m, l, acc) of the first ``n`` rows -- blocks of 64 with a partial last one, parts
    split over the threads and joined -- equal float64 sums over the op path's decoding of the same codes; n = 0
    gives the empty partials (m = -inf, l = 0, acc = 0)."""
    H, R, D = 1, 3, 64  # one KV head: long steps are split over the threads in row ranges
    c = make_waterfill(rope=_rope("rope", D), D=D)
    rng = np.random.default_rng(n_rows)
    _feed(c, H, R, D, n_rows + 40, rng)
    n = c.n_quant
    q = _rows(rng, H, R, D) * 0.3
    tab, lo, step, w, partner, sign, poly = c._cpu_constants()
    args = (q, c.k_words, tab, lo, step, w, partner, sign, c.v_words, c.v_scales, poly)
    m, l, acc = native.module().waterfill_decode(*args, n, c.n_sink, c.bit_width, D, True)  # noqa: E741
    wm, wl, wacc, spread = _partials64(c, q, n)
    # a score's float32 error: ~D roundings of terms up to spread (the keys' decoding and RoPE add a few more)
    tol = 4 * D * float(np.finfo(np.float32).eps) * spread + 1e-6
    np.testing.assert_allclose(np.array(m), wm, rtol=0, atol=tol)
    assert _rel(l, wl) < tol and _rel(acc, wacc) < tol, tol
    m0, l0, a0 = native.module().waterfill_decode(*args, 0, c.n_sink, c.bit_width, D, True)
    assert np.isneginf(np.array(m0)).all() and not np.array(l0).any() and not np.array(a0).any()


@KERNELS
def test_cpu_kernel_rejects_inconsistent_inputs(kernel_calls):
    """Shapes that do not fit each other are refused when the call is made (not read out of bounds)."""
    H, R, D = 2, 2, 64
    c = make_waterfill(rope=_rope("rope", D), D=D)
    _feed(c, H, R, D, 120, np.random.default_rng(0))
    tab, lo, step, w, partner, sign, poly = c._cpu_constants()
    q = mx.zeros((1, H, R, D))
    kw, vw, vs = c.k_words, c.v_words, c.v_scales
    f = native.module().waterfill_decode
    with pytest.raises(ValueError, match="rows beyond the buffers"):
        f(q, kw, tab, lo, step, w, partner, sign, vw, vs, poly, kw.shape[2] + 1, 4, 4, D, True)
    with pytest.raises(ValueError, match="batch or heads differ"):
        f(mx.zeros((1, H + 1, R, D)), kw, tab, lo, step, w, partner, sign, vw, vs, poly, 8, 4, 4, D, True)
    with pytest.raises(ValueError, match="value width or dim"):
        f(q, kw, tab, lo, step, w, partner, sign, vw, vs, poly, 8, 4, 4, 4 * D, True)
    with pytest.raises(ValueError, match="table shapes"):
        f(q, kw, tab, lo, step, w[:-1], partner, sign, vw, vs, poly, 8, 4, 4, D, True)
    # RoPE tables that are not rotary pairs (seen only when evaluated): NaN, which the first-use check refuses
    bad = mx.array(np.roll(np.array(partner), 1))
    out = f(q, kw, tab, lo, step, w, bad, sign, vw, vs, poly, 8, 4, 4, D, True)
    assert all(np.isnan(np.array(a)).all() for a in out)


@KERNELS
@pytest.mark.parametrize("dtypes,sinks,out", [(("float16", "float16", "float32"), False, "float32"),
                                              (("bfloat16", "float32", "float16"), True, "float16"),
                                              (("float32", None, "bfloat16"), True, "bfloat16")])
def test_joint_finish_equals_float64_attention(dtypes, sinks, out):
    """A CPU decode step's end (``joint_finish``): the kernel's partials (m, l, acc) over quantized rows joined with
    up to three groups of exact rows in their own dtypes -- slices of larger buffers read in place -- and the sinks'
    logits, normalized, in the output dtype: equals one float64 softmax over all the rows, to the rounding of the
    inputs' and the output's dtypes (bounds from the magnitudes)."""
    assert native.module() is not None
    rng = np.random.default_rng(3)
    B, H, R, D, DV, nq = 2, 3, 3, 64, 48, 40
    q = rng.standard_normal((B, H, R, D)) / 8
    kq, vq = rng.standard_normal((B, H, nq, D)), rng.standard_normal((B, H, nq, DV))
    sq = np.einsum("bhrd,bhtd->bhrt", q, kq)  # the quantized rows' partials, in float64 then float32
    m = sq.max(-1)
    p = np.exp(sq - m[..., None])
    l, acc = p.sum(-1), np.einsum("bhrt,bhtv->bhrv", p, vq)
    groups, keys, values = [], [kq], [vq]
    for i, dt in enumerate(dtypes):
        if dt is None:
            continue
        cap, n = 6 + 3 * i, 2 + 2 * i  # the first n rows of a buffer of cap rows: a strided view
        kb, vb = rng.standard_normal((B, H, cap, D)), rng.standard_normal((B, H, cap, DV))
        kx, vx = mx.array(kb).astype(getattr(mx, dt)), mx.array(vb).astype(getattr(mx, dt))
        groups.append((kx[:, :, :n], vx[:, :, :n]))
        keys.append(np.array(kx[:, :, :n].astype(mx.float32)))  # the reference reads the rounded rows
        values.append(np.array(vx[:, :, :n].astype(mx.float32)))
    K, V = np.concatenate(keys, axis=2), np.concatenate(values, axis=2)
    logits = rng.standard_normal(H * R) if sinks else None
    s = np.einsum("bhrd,bhtd->bhrt", q, K)
    if sinks:
        s = np.concatenate([s, np.broadcast_to(logits.reshape(1, H, R, 1), (B, H, R, 1))], axis=-1)
        V = np.concatenate([V, np.zeros((B, H, 1, DV))], axis=2)
    w = np.exp(s - s.max(-1, keepdims=True))
    ref = (np.einsum("bhrt,bhtv->bhrv", w, V) / w.sum(-1, keepdims=True)).reshape(B, H * R, 1, DV)
    like = mx.zeros((1,), getattr(mx, out))
    f32 = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    got = native.module().joint_finish(f32(q), f32(m), f32(l), f32(acc), [k for k, _ in groups],
                                       [v for _, v in groups], [k.shape[2] for k, _ in groups],
                                       None if logits is None else mx.array(logits.astype(np.float32)), like)
    assert got.dtype == like.dtype and got.shape == (B, H * R, 1, DV)
    eps = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[out]
    err = np.abs(np.array(got.astype(mx.float32)) - ref)
    assert err.max() <= (eps + 1e-5) * np.abs(ref).max(), err.max()
    with pytest.raises(ValueError, match="joint_finish: more rows than a group holds"):
        native.module().joint_finish(f32(q), f32(m), f32(l), f32(acc), [groups[0][0]], [groups[0][1]], [99], None, like)
    with pytest.raises(ValueError, match="joint_finish: partials' shapes differ"):
        native.module().joint_finish(f32(q), f32(m[:1]), f32(l), f32(acc), [groups[0][0]], [groups[0][1]], [1], None,
                                     like)
    with pytest.raises(ValueError, match="joint_finish: one sink logit per query head"):
        native.module().joint_finish(f32(q), f32(m), f32(l), f32(acc), [groups[0][0]], [groups[0][1]], [1],
                                     mx.zeros((H,)), like)


def _same_steps(caches, prompt, seed, monkeypatch, H=3, R=3, D=64, steps=40):
    """Two identical caches fed the same prompt, then ``steps`` decode steps: the first with the CPU kernels on, the
    second off (its op path); their outputs agree to float32 rounding at every step."""
    rng = np.random.default_rng(seed)
    k, v, q = _rows(rng, H, prompt, D), _rows(rng, H, prompt, D), _rows(rng, H * R, prompt, D)
    for c in caches:
        K, V = c.update_and_fetch(k, v)
        dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")
    for i in range(steps):
        k1, v1, q1 = _rows(rng, H, 1, D), _rows(rng, H, 1, D), _rows(rng, H * R, 1, D)
        outs = []
        for c, on in zip(caches, (True, False)):
            monkeypatch.setattr(native, "_ENV_ON", on)
            K, V = c.update_and_fetch(k1, v1)
            outs.append(dispatch.dispatched_sdpa(q1, K, V, cache=c, scale=D**-0.5, mask=None))
        assert _rel(outs[0], outs[1]) < 1e-5, i


@KERNELS
@pytest.mark.parametrize("method", ["waterfill", "kivi", "kivi_sink", "age_tiered", "kitty", "skvq", "zipcache",
                                    "gear", "turboquant_rvq", "nsnquant", "svdq", "kvtc", "xkv", "amc", "adakv",
                                    "anchorkv", "kvquant", "palu", "cachegen"])
def test_cpu_kernels_and_op_paths_give_the_same_steps(method, monkeypatch):
    """Two identical caches, one decoding through its CPU kernel and one through its op path
    (``VELOXQUANT_CPU_KERNELS`` off), give the same outputs step after step, across compactions / completed groups."""
    cls, make, prompt = {"waterfill": (WaterfillKVCache, lambda: make_waterfill(rope=_rope("rope", 64), D=64), 700),
                         "kivi": (GroupedQuantCache, lambda: _kivi(64), 1500),
                         "kivi_sink": (GroupedQuantCache, lambda: _kivi_sink(64), 1500),
                         "age_tiered": (AgeTieredKVCache, lambda: _age_tiered(64), 1500),
                         "kitty": (KittyKVCache, lambda: _kitty(64), 1500),
                         "skvq": (SKVQKVCache, lambda: _skvq(64, window=16), 1500),
                         "gear": (GEARKVCache, lambda: _variant("gear", GEARKVCache, 64, GEAROptions()), 1500),
                         "zipcache": (ZipCacheKVCache, lambda: _variant("zipcache", ZipCacheKVCache, 64,
                                                                        ZipCacheOptions()), 1500),
                         "turboquant_rvq": (TurboQuantRVQKVCache, lambda: _rvq(64), 1500),
                         "nsnquant": (NSNQuantKVCache, lambda: _nsn(64), 1500),
                         "svdq": (LowRankKVCache, lambda: _variant("svdq", LowRankKVCache, 64, SVDqOptions()), 1500),
                         "kvtc": (LowRankKVCache, lambda: _variant("kvtc", LowRankKVCache, 64, KVTCOptions()), 1500),
                         "xkv": (XKVKVCache, lambda: _variant("xkv", XKVKVCache, 64, XKVOptions()), 1500),
                         "amc": (AMCKVCache, lambda: _variant("amc", AMCKVCache, 64, AMCOptions()), 1500),
                         "adakv": (AdaKVKVCache, lambda: _variant("adakv", AdaKVKVCache, 64, AdaKVOptions()), 1500),
                         "anchorkv": (AnchorKVCache, lambda: _variant("anchorkv", AnchorKVCache, 64, AnchorKVOptions()),
                                      1500),
                         "kvquant": (KVQuantKVCache, lambda: _kvquant(64, "rope"), 1500),
                         "palu": (PALUKVCache, lambda: _palu(3, 64, 4, "rope"), 1500),
                         "cachegen": (CacheGenKVCache, lambda: _variant("cachegen", CacheGenKVCache, 64,
                                                                        CacheGenOptions(bits=5)), 1500)}[method]
    calls = _spy_kernel(monkeypatch, cls)
    _same_steps([make(), make()], prompt, len(method), monkeypatch)
    assert len(calls) == 40


def _batch_of(method):
    """A ragged batch layer (sequences holding different sink / code / window counts, one with no codes: an
    uncalibrated waterfill sequence, a short KIVI or turboquant_rvq one), its dims (H, Hq, D)."""
    from test_turboquant_rvq_batch import _random_singles
    from test_waterfill_batch import _singles

    mx.random.seed(5)
    H, Hq, D = 2, 6, 64
    if method == "waterfill":
        singles = _singles(H, D, (300, 40, 3, 170), Hq)
    elif method == "kivi":
        singles = [KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=4, head_dim=D))
                   for _ in range(4)]
        for c, n in zip(singles, (300, 70, 5, 130)):
            c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    else:
        singles = _random_singles(H, D, (70, 130, 3, 300))
    return type(singles[0]).merge(singles), (H, Hq, D)


@KERNELS
@pytest.mark.parametrize("method", ["waterfill", "kivi", "turboquant_rvq"])
def test_batch_cpu_steps_equal_the_op_path(method, monkeypatch):
    """A batch form's decode step on the CPU kernels (each sequence's own code slots: ``counts``; its sink rows,
    window columns and new row: ``joint_finish``'s ``spans``) equals its op path (the batch mask over the dense
    rows) step after step, ragged counts, window flushes and a sequence without codes included; a mask that is not
    the batch's own goes to the op path."""
    assert native.module() is not None
    on, (H, Hq, D) = _batch_of(method)
    off = copy.deepcopy(on)
    taken = []
    real = type(on)._cpu_step
    monkeypatch.setattr(type(on), "_cpu_step", lambda c, *a, **k: taken.append(tuple(c.nq)) or real(c, *a, **k))
    rng = np.random.default_rng(7)
    for i in range(40):
        k, v, q = (mx.array(rng.standard_normal((4, h, 1, D)).astype(np.float32)) for h in (H, H, Hq))
        outs = []
        for c, kernels_on in ((on, True), (off, False)):
            monkeypatch.setattr(native, "_ENV_ON", kernels_on)
            mask = c.make_mask(1)
            K, V = c.update_and_fetch(k, v)
            outs.append(dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=mask))
        assert _rel(outs[0], outs[1]) < 1e-5, i
        assert on.nq == off.nq and on.lens == off.lens
    assert len(taken) == 40 and 0 in taken[0] and len(set(taken)) > 1  # one sequence without codes; flushes
    assert len(set(on.nw if method != "kivi" else on.nr)) > 1  # ragged windows (right-aligned: spans from each
    # one's own first column)
    monkeypatch.setattr(native, "_ENV_ON", True)
    own = on.make_mask(1)
    K, V = on.update_and_fetch(k, v)
    extra = mx.array(rng.standard_normal(own.shape) > -1.0) & own  # a caller's mask: not the batch's own
    dispatch.dispatched_sdpa(q, K, V, cache=on, scale=D**-0.5, mask=extra)
    assert len(taken) == 40


@KERNELS
def test_kernels_refuse_counts_and_spans_that_do_not_fit():
    """The batch arguments are checked at the call: a count per batch row within the rows attended (KIVI's a
    multiple of its group), a span per group and batch row within the group's rows."""
    mod = native.module()
    B, H, R, D = 2, 1, 1, 32
    q = mx.zeros((B, H, R, D))
    m, l, acc = mx.zeros((B, H, R)), mx.ones((B, H, R)), mx.zeros((B, H, R, D))
    rows = mx.zeros((B, H, 4, D), dtype=mx.float16)
    with pytest.raises(ValueError, match="joint_finish: spans: "):
        mod.joint_finish(q, m, l, acc, [rows], [rows], [4], None, q, spans=[0, 4])
    with pytest.raises(ValueError, match="joint_finish: a span beyond its group's rows"):
        mod.joint_finish(q, m, l, acc, [rows], [rows], [4], None, q, spans=[0, 4, 1, 4])
    got = mod.joint_finish(q + 1, m, l, acc, [rows + 1], [mx.broadcast_to(mx.arange(4.0)[:, None], rows.shape)],
                           [4], None, q, spans=[0, 4, 3, 1])
    # batch row 0: the partials (l = 1, acc = 0, m = 0) and 4 rows valued 0..3, all logits 32; row 1: row 3 alone
    e = np.exp(32.0)
    want = np.stack([np.full(D, 6 * e / (1 + 4 * e)), np.full(D, 3 * e / (1 + e))])
    assert np.allclose(np.array(got).reshape(B, D), want, rtol=1e-5)
    with pytest.raises(ValueError, match="kivi_decode: counts: "):
        mod.kivi_decode(q, mx.zeros((B, H, D, 4), mx.uint32), mx.zeros((B, H, D, 1), mx.float16),
                        mx.zeros((B, H, D, 1), mx.float16), mx.zeros((B, H, 32, 4), mx.uint32),
                        mx.zeros((B, H, 32, 1), mx.float16), mx.zeros((B, H, 32, 1), mx.float16), 32, 4, 32, 32, D,
                        counts=[32, 16])


@KERNELS
def test_cpu_kernel_tables_are_counted_in_nbytes(kernel_calls):
    """Once a step has built the kernel's tables, the cache's ``nbytes`` counts them (they are held)."""
    H, R, D = 2, 2, 64
    c = make_waterfill(rope=_rope("rope", D), D=D)
    rng = np.random.default_rng(1)
    _feed(c, H, R, D, 200, rng)
    before = c.nbytes
    K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 1, D), K, V, cache=c, scale=D**-0.5, mask=None)
    assert kernel_calls
    tables = c._cpu_constants()
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert all(any(a is t for a in c.held_arrays()) for t in tables)
    assert c.nbytes - before >= sum(t.nbytes for t in tables[:3])  # the layout and range tables at least


# ------------------------------------------------------------------------------------------- KIVI
@pytest.fixture
def kivi_calls(monkeypatch):
    """KIVI-layout caches' decode steps that took the CPU kernel."""
    return _spy_kernel(monkeypatch, GroupedQuantCache)


@KERNELS
@pytest.mark.parametrize("H,R,D,bits,group,prompt,steps", [
    (1, 1, 64, 4, 32, 33, 40), (2, 3, 64, 2, 32, 95, 36), (2, 4, 128, 8, 64, 64, 70), (3, 3, 64, 4, 32, 2100, 8),
    (2, 2, 64, 4, 128, 700, 20)])
def test_kivi_cpu_kernel_equals_float64_attention_over_the_stored_rows(H, R, D, bits, group, prompt, steps,
                                                                        kivi_calls):
    """KIVI's decode steps through the CPU kernel (groups completed during the steps, half blocks of 32 tokens, a
    long past split over the threads) attend over exactly the rows the cache stores, in float64."""
    c = _kivi(D, bits, group)
    rng = np.random.default_rng(bits * 10 + prompt)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    _steps_equal_float64(c, H, R, D, steps, rng)
    assert len(kivi_calls) == steps and "kivi_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("sinks,bits,prompt,steps", [(4, 4, 2, 40), (5, 2, 100, 36), (4, 8, 1000, 8), (0, 4, 70, 8)])
def test_kivi_sink_decodes_on_kivis_cpu_kernel_with_its_sinks_as_exact_rows(sinks, bits, prompt, steps, kivi_calls):
    """KIVI-sink's decode steps read its codes in KIVI's CPU kernel (once codes exist: not while the sinks fill) and
    join the float16 sinks as exact rows: each step equals float64 attention over the rows the cache stores, the
    sinks included; the kernel reads the codes alone (the count past the sinks)."""
    H, R, D = 2, 3, 64
    c = _kivi_sink(D, bits, sinks=sinks)
    rng = np.random.default_rng(sinks * 100 + prompt)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    _steps_equal_float64(c, H, R, D, steps, rng)
    assert kivi_calls and all(n % 32 == 0 and 0 < n <= c.n_quant for n in kivi_calls)
    # a step takes the kernel once a group of 32 rows follows the sinks
    assert len(kivi_calls) == steps - max(0, sinks + 32 - prompt) and c.n_sink == sinks
    assert "kivi_sink_cpu" in _common._checked


def _variant(method, cls, D, options):
    """A ``method`` cache of head dim ``D`` with ``options``, checked to be a ``cls``."""
    c = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=D, options=options))
    assert isinstance(c, cls)
    return c


def _age_tiered(D, **opts):
    return _variant("age_tiered", AgeTieredKVCache, D, AgeTieredOptions(**opts))


@KERNELS
@pytest.mark.parametrize("bits", [(2, 4, 8), (4, 4, 8), (2, 8, 8)])
def test_age_tiered_decodes_on_kivis_cpu_kernel_a_call_per_tier(bits, monkeypatch):
    """age_tiered's decode steps, while groups age from tier to tier (re-quantized), read each tier's codes in KIVI's
    CPU kernel (at its width) and join the partials: each step equals float64 attention over the rows the cache
    stores."""
    assert native.module() is not None
    H, R, D = 2, 3, 64
    c = _age_tiered(D, recent_boundary=64, mid_boundary=160, bits_old=bits[0], bits_mid=bits[1], bits_recent=bits[2])
    store_calls, steps = [], []
    real_store, real_part = GroupedQuantCache._cpu_store_part, AgeTieredKVCache._cpu_part
    monkeypatch.setattr(GroupedQuantCache, "_cpu_store_part", lambda c, q, tag, b, n, counts=():
                        store_calls.append((tag, b, n)) or real_store(c, q, tag, b, n))
    monkeypatch.setattr(AgeTieredKVCache, "_cpu_part", lambda c, q, n: steps.append(n) or real_part(c, q, n))
    rng = np.random.default_rng(sum(bits))
    K, V = c.update_and_fetch(_rows(rng, H, 150, D), _rows(rng, H, 150, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 150, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    _steps_equal_float64(c, H, R, D, 60, rng)
    assert len(steps) == 60 and c.n_old and c.n_mid and c.n_recent  # all three tiers in use by the end
    assert {t for t, _, _ in store_calls} == {"0", "1", "2"}
    assert all(b == bits[int(t)] for t, b, _ in store_calls)
    assert "age_tiered_cpu" in _common._checked


def _kitty(D, **opts):
    return _variant("kitty", KittyKVCache, D, KittyOptions(**opts))


@KERNELS
@pytest.mark.parametrize("hi_bit,lo_bit,frac,R", [(4, 2, 0.25, 3), (8, 2, 0.5, 1), (8, 4, 0.1, 4), (2, 2, 0.3, 2),
                                                  (4, 2, 0.0, 3)])
def test_kitty_decodes_on_kivis_cpu_kernel_with_its_hi_channels_as_a_second_key_store(hi_bit, lo_bit, frac, R,
                                                                                       monkeypatch):
    """Kitty's decode steps read its codes in KIVI's CPU kernel: the low-width key channels as the kernel's keys, the
    hi channels (another width, re-slotted to the low width's token order) as its second key store, the queries
    permuted to the same hi-then-lo channel order; each step equals float64 attention over the stored rows, groups
    completing between steps. Without hi channels (fraction 0) no second store is passed."""
    assert native.module() is not None
    H, D = 2, 64
    c = _kitty(D, hi_bit=hi_bit, lo_bit=lo_bit, hi_fraction=frac)
    calls = _spy_kernel(monkeypatch, KittyKVCache)
    rng = np.random.default_rng(hi_bit * 10 + lo_bit)
    K, V = c.update_and_fetch(_rows(rng, H, 100, D), _rows(rng, H, 100, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 100, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    _steps_equal_float64(c, H, R, D, 40, rng)
    assert len(calls) == 40 and "kitty_cpu" in _common._checked
    assert (c.kh_codes is None) == (frac == 0) and (c.kl_codes is not None)


def _skvq(D, **opts):
    return _variant("skvq", SKVQKVCache, D, SKVQOptions(**opts))


@KERNELS
@pytest.mark.parametrize("bits,group,sinks,window,R,prompt", [(2, 32, 5, 16, 3, 100), (4, 32, 0, 1, 1, 40),
                                                              (8, 16, 4, 24, 4, 300), (2, 32, 5, 128, 2, 2100),
                                                              (4, 64, 0, 1, 2, 130)])
def test_skvq_decodes_on_kivis_cpu_kernel_with_its_keys_as_rows(bits, group, sinks, window, R, prompt, monkeypatch):
    """SKVQ's decode steps read its codes in KIVI's CPU kernel, the keys as rows (per token, in channel groups, as the
    values): the queries permuted to the calibrated key order, the weighted value sum put back in the model's; the
    sinks and the float16 window join as exact rows. Each step equals float64 attention over the rows the cache
    stores, while the window flushes rows into the codes (any count of them: not whole groups)."""
    H, D = 2, 64
    c = _skvq(D, bits_key=bits, bits_value=bits, group_size=group, n_sink=sinks, window=window)
    calls = _spy_kernel(monkeypatch, SKVQKVCache)
    rng = np.random.default_rng(bits * 100 + group)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    n0 = c.n_quant
    _steps_equal_float64(c, H, R, D, 40, rng)
    assert len(calls) == 40 and "skvq_cpu" in _common._checked
    assert all(0 < n <= c.n_quant for n in calls) and calls[0] == n0
    assert (c.n_quant > n0) == (c.value_group(D) <= 40)  # the window flushed during the steps where it could fill
    assert c.n_sink == sinks and not (c.k_perm == mx.arange(D)).all().item()  # calibrated order, not the identity


@KERNELS
@pytest.mark.parametrize("hi_bits,lo_bits,frac,R,prompt", [(4, 2, 0.2, 3, 100), (8, 4, 0.5, 1, 64), (2, 2, 0.0, 4, 40),
                                                          (8, 2, 1.0, 2, 300)])
def test_zipcache_decodes_on_kivis_cpu_kernel_a_call_per_store(hi_bits, lo_bits, frac, R, prompt, monkeypatch):
    """ZipCache's decode steps read its hi and lo stores in KIVI's CPU kernel (keys as rows, one group a token, the
    channel factors folded into the queries), one call per store that holds rows: each step equals float64 attention
    over the rows the cache stores, groups compressed between steps by the saliency the steps accumulate."""
    H, D = 2, 64
    c = _variant("zipcache", ZipCacheKVCache, D, ZipCacheOptions(hi_bits=hi_bits, lo_bits=lo_bits, hi_fraction=frac))
    calls, stores = _spy_kernel(monkeypatch, ZipCacheKVCache), []
    real = native.module().kivi_decode
    monkeypatch.setattr(native, "module", lambda: type("M", (), {"kivi_decode": staticmethod(
        lambda *a, **k: stores.append(a[8]) or real(*a, **k))})())
    rng = np.random.default_rng(hi_bits * 10 + lo_bits)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    n0 = c.n_quant
    _steps_equal_float64(c, H, R, D, 40, rng)
    assert len(calls) == 40 and "zipcache_cpu" in _common._checked and c.n_quant > n0
    assert abs(c.n_hi - frac * c.n_quant) <= 1 and c.saliency_source == "attention"  # rounded per block
    assert sorted(set(stores)) == sorted({b for b, m in ((hi_bits, c.n_hi), (lo_bits, c.n_lo)) if m})


@KERNELS
@pytest.mark.parametrize("bits,rank,frac,group,R", [(2, None, 0.01, 32, 3), (4, 2, 0.05, 32, 1), (2, None, 0.02, 64, 2),
                                                    (8, 3, 0.0, 32, 4), (2, 1, 0.0, 32, 2), ("none", 0, 0.0, 32, 2)])
def test_gear_decodes_on_kivis_cpu_kernel_with_its_corrections_beside_it(bits, rank, frac, group, R, monkeypatch):
    """GEAR's decode steps read its codes in KIVI's CPU kernel, which applies the outlier and low-rank corrections to
    each decoded block (none passed when GEAR keeps neither: the last case, its factors and outliers turned off after
    the prompt): each step equals float64 attention over the rows the cache stores (codes, outliers written back, low
    rank added), groups completing between steps."""
    H, D = 2, 64
    plain = bits == "none"
    c = _variant("gear", GEARKVCache, D, GEAROptions(bits=2 if plain else bits, rank=rank or None,
                                                     sparse_fraction=frac, group_size=group))
    calls, fixed = _spy_kernel(monkeypatch, GEARKVCache), []
    real = native.module()
    spy = type("Spy", (), {"__getattr__": lambda self, name: getattr(real, name), "kivi_decode": staticmethod(
        lambda *a, **k: fixed.append(bool(k.get("fixes"))) or real.kivi_decode(*a, **k))})()
    monkeypatch.setattr(native, "module", lambda: spy)
    rng = np.random.default_rng(group + R)
    K, V = c.update_and_fetch(_rows(rng, H, 150, D), _rows(rng, H, 150, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 150, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    if plain:  # neither part: the rows the cache stores are its codes alone
        c.rank, c.frac = 0, 0.0
    _steps_equal_float64(c, H, R, D, 40, rng)
    assert len(calls) == 40 and "gear_cpu" in _common._checked and c.n_quant >= 150 - group
    assert fixed and all(f == (not plain) for f in fixed) and (c.rank > 0) == (not plain)


@KERNELS
def test_skvq_with_two_widths_decodes_on_its_op_path(monkeypatch):
    """KIVI's kernel reads one width for keys and values: SKVQ at 2-bit keys and 4-bit values keeps its op path."""
    c = _skvq(64, bits_key=2, bits_value=4, window=16)
    calls = _spy_kernel(monkeypatch, SKVQKVCache)
    rng = np.random.default_rng(3)
    c.update_and_fetch(_rows(rng, 2, 200, 64), _rows(rng, 2, 200, 64))
    _steps_equal_float64(c, 2, 2, 64, 4, rng)
    assert calls == [] and c.n_quant > 0


@KERNELS
def test_kivi_cpu_kernel_reads_key_rows_only_as_they_fit():
    """``kivi_decode(key_rows=True)`` refuses, naming ``key_rows``, key rows that are not D codes with a scale per
    group, and a second key store beside them."""
    c = _skvq(64, window=16)
    rng = np.random.default_rng(4)
    c.update_and_fetch(_rows(rng, 2, 200, 64), _rows(rng, 2, 200, 64))
    q = mx.zeros((1, 2, 1, 64))
    args = (c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales, c.v_biases, c.n_quant, 2, 32, 32, 64)
    m, _, acc = native.module().kivi_decode(q, *args, key_rows=True)
    assert m.shape == (1, 2, 1) and acc.shape == (1, 2, 1, 64)
    for bad in (dict(key_rows=True, hi=[c.k_codes, c.k_scales, c.k_biases], hi_bits=2),):
        with pytest.raises(ValueError, match="kivi_decode: key_rows: "):
            native.module().kivi_decode(q, *args, **bad)
    with pytest.raises(ValueError, match="kivi_decode: key_rows: "):  # 16-channel groups: 4 scales a row, not 2
        native.module().kivi_decode(q, *args[:7], 2, 16, 32, 64, key_rows=True)


@KERNELS
def test_kivi_cpu_kernel_takes_gears_corrections_only_as_they_fit():
    """``kivi_decode(fixes=, fix_sizes=)`` refuses, naming ``fixes``, corrections that do not cover the rows asked
    for, a list that is not keys' and values' four arrays, and a second key store beside them."""
    c = _variant("gear", GEARKVCache, 64, GEAROptions(rank=2, sparse_fraction=0.02))
    rng = np.random.default_rng(6)
    c.update_and_fetch(_rows(rng, 2, 200, 64), _rows(rng, 2, 200, 64))
    q = mx.zeros((1, 2, 3, 64))
    args = (c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales, c.v_biases, c.n_quant, 2, 32, 32, 64)
    fixes = [getattr(c, f"{s}_{a}") for s in "kv" for a in ("a", "bt", "oidx", "oval")]
    sizes = [2, c._n_out(64), c._n_out(64)]
    m, _, acc = native.module().kivi_decode(q, *args, fixes=fixes, fix_sizes=sizes)
    assert m.shape == (1, 2, 3) and acc.shape == (1, 2, 3, 64)
    bad = [(fixes, [3, *sizes[1:]]), (fixes[:4], sizes), ([c.k_a[:, :, :32], *fixes[1:]], sizes),
           ([*fixes[:2], None, None, *fixes[4:]], sizes)]
    for fx, sz in bad:
        with pytest.raises(ValueError, match="kivi_decode: fixes: "):
            native.module().kivi_decode(q, *args, fixes=fx, fix_sizes=sz)
    with pytest.raises(ValueError, match="kivi_decode: fixes: "):
        native.module().kivi_decode(q, *args, fixes=fixes, fix_sizes=sizes, hi=[c.k_codes, c.k_scales, c.k_biases],
                                    hi_bits=2)
    with pytest.raises(ValueError, match="kivi_decode: fixes: "):  # KIVI's key layout: its own group spans the fixes
        native.module().kivi_decode(q, *args, fixes=fixes, fix_sizes=sizes, fix_group=32)


@KERNELS
def test_kivi_cpu_kernel_takes_fixes_over_key_rows_only_with_their_token_group():
    """With keys as rows (whose group is channels) the corrections need ``fix_group``, tokens the rows fill; AnchorKV's
    references (``fix_refs``) must name one of the anchors and cover the groups asked for."""
    c = _variant("anchorkv", AnchorKVCache, 64, AnchorKVOptions())
    rng = np.random.default_rng(7)
    c.update_and_fetch(_rows(rng, 2, 200, 64), _rows(rng, 2, 200, 64))
    q, n, g = mx.zeros((1, 2, 3, 64)), c.n_quant, c.n_quant // 32
    args = (c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales, c.v_biases, n, 2, 32, 32, 64)
    fixes = [x for p in "kv" for x in (None, getattr(c, f"{p}_anc").reshape(1, 2, -1), None, None)]
    refs = dict(fix_sizes=[1, 0, 0], fix_refs=[getattr(c, f"{p}_{a}") for p in "kv" for a in ("ref", "apos")])
    m, _, _ = native.module().kivi_decode(q, *args, key_rows=True, fixes=fixes, fix_group=32, fix_ref_bits=1, **refs)
    assert m.shape == (1, 2, 3)
    for fg in (0, 40):  # none, or one the rows do not fill
        with pytest.raises(ValueError, match="kivi_decode: fixes: .*fix_group"):
            native.module().kivi_decode(q, *args, key_rows=True, fixes=fixes, fix_group=fg, fix_ref_bits=1, **refs)
    for bits in (0, 9):  # references must name the anchors
        with pytest.raises(ValueError, match="kivi_decode: fixes: fix_refs"):
            native.module().kivi_decode(q, *args, key_rows=True, fixes=fixes, fix_group=32, fix_ref_bits=bits, **refs)
    with pytest.raises(ValueError, match="kivi_decode: fixes: references"):  # fewer groups than the rows asked for
        native.module().kivi_decode(q, *args, key_rows=True, fixes=fixes, fix_group=32, fix_ref_bits=1,
                                    fix_sizes=[1, 0, 0], fix_refs=[c.k_ref[:, :, :2], c.k_apos, c.v_ref, c.v_apos])


@KERNELS
def test_kivi_cpu_kernel_reads_a_second_key_store_only_as_it_fits():
    """``kivi_decode``'s second key store is refused, naming ``hi``, unless it is (codes, scales, biases) of 2, 4 or 8
    bits with the queries' batch and heads and the rows asked for; its channels and the main store's make D."""
    c = _kitty(64)
    rng = np.random.default_rng(2)
    c.update_and_fetch(_rows(rng, 2, 128, 64), _rows(rng, 2, 128, 64))
    q = mx.zeros((1, 2, 1, 64))
    base = (q, c.kl_codes, c.kl_scales, c.kl_biases, c.v_codes, c.v_scales, c.v_biases, 96, 2, 32, 32, 64)
    hi = [c.kh_codes, c.kh_scales, c.kh_biases]
    m, _, _ = native.module().kivi_decode(*base, hi=hi, hi_bits=4)
    assert m.shape == (1, 2, 1)
    for bad, bits in (([c.kh_codes, c.kh_scales], 4), (hi, 3), ([c.kh_codes[:, :1], c.kh_scales, c.kh_biases], 4)):
        with pytest.raises(ValueError, match="kivi_decode: hi: "):
            native.module().kivi_decode(*base, hi=bad, hi_bits=bits)
    with pytest.raises(ValueError, match="kivi_decode: batch, heads or tables differ"):
        native.module().kivi_decode(*base)  # the main store alone holds only the low-width channels


@KERNELS
def test_kivi_cpu_kernel_leaves_the_variants_and_odd_widths_to_the_op_path(kivi_calls):
    """A variant with its own codes (GEAR) and KIVI at 3 bits decode on the op path; the kernel refuses what it
    does not read (3-bit codes, a past that is not whole groups)."""
    H, R, D = 2, 2, 64
    rng = np.random.default_rng(4)
    for c in (KVCacheFactory.create(KVCacheConfig(method="gear", head_dim=D)), _kivi(D, bits=3)):
        K, V = c.update_and_fetch(_rows(rng, H, 200, D), _rows(rng, H, 200, D))
        dispatch.dispatched_sdpa(_rows(rng, H * R, 200, D), K, V, cache=c, scale=D**-0.5, mask="causal")
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < 1e-4
    assert kivi_calls == []
    c = _kivi(D)
    K, V = c.update_and_fetch(_rows(rng, H, 96, D), _rows(rng, H, 96, D))
    args = (mx.zeros((1, H, R, D)), c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales, c.v_biases)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        native.module().kivi_decode(*args, 64, 3, 32, 32, D)
    with pytest.raises(ValueError, match="rows beyond the buffers"):
        native.module().kivi_decode(*args, 48, 4, 32, 32, D)


# ------------------------------------------------------------------------------------------- the build
def test_a_failed_build_is_recorded_and_the_op_path_runs(tmp_path, monkeypatch):
    """A build that fails leaves ``failed.txt`` (no retry in later processes), ``native.module()`` answers None
    with one warning line, and a decode step runs the op path."""
    if not HAS_NANOBIND:
        pytest.skip("the build is only tried where nanobind is installed")
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path))

    def broken(out_dir):
        raise build.BuildError("cmake --build failed: no compiler (simulated)")

    monkeypatch.setattr(build, "_build", broken)
    with pytest.raises(build.BuildError, match="simulated"):
        build.built_module_path()
    failed = list(tmp_path.glob("native/*/failed.txt"))
    assert len(failed) == 1 and "simulated" in failed[0].read_text()
    with pytest.raises(build.BuildError, match="an earlier build here failed"):
        build.built_module_path()
    native.module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU kernels unavailable"):
            assert native.module() is None
        assert not native.available()
        c = make_waterfill(D=64)
        rng = np.random.default_rng(2)
        _feed(c, 1, 2, 64, 100, rng)
        K, V = c.update_and_fetch(_rows(rng, 1, 1, 64), _rows(rng, 1, 1, 64))
        q = _rows(rng, 2, 1, 64)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=0.125, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, 0.125)) < 1e-4
    finally:
        native.module.cache_clear()  # the next test loads the real build again


def test_without_nanobind_the_kernels_are_silently_off(monkeypatch):
    """Without the ``cpu`` extra there is no warning: the op path is simply the path."""
    def missing():
        raise build.BuildError("nanobind is not installed (the 'cpu' extra: pip install 'veloxquant-mlx[cpu]')")

    monkeypatch.setattr(native, "load", missing)
    native.module.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.module() is None
    finally:
        native.module.cache_clear()


def test_the_build_key_follows_the_sources(tmp_path, monkeypatch):
    """A changed source gives another build directory (a stale binary is never loaded for new sources)."""
    if not HAS_NANOBIND:
        pytest.skip("the key includes nanobind's version")
    key = build.build_key()
    for name in build.SOURCES:
        shutil.copy(build._HERE / name, tmp_path / name)
    monkeypatch.setattr(build, "_HERE", tmp_path)
    assert build.build_key() == key
    (tmp_path / "waterfill_cpu.cpp").write_text((tmp_path / "waterfill_cpu.cpp").read_text() + "\n// changed\n")
    assert build.build_key() != key


def test_build_directories_unused_for_30_days_are_pruned(tmp_path):
    """After a new build, the build directories of other versions / CPUs / targets that no process has loaded for
    ``STALE_DAYS`` go (with their lock files); recently loaded ones, the new one and a build in progress stay."""
    import time

    old = time.time() - (build.STALE_DAYS + 1) * 86400
    dirs = {}
    for name in ("stale", "recent", "new", "build-inprogress", "empty_stale"):
        d = tmp_path / name
        d.mkdir()
        if name != "empty_stale":
            (d / f"{build.MODULE}.so").write_bytes(b"x")
        (tmp_path / f"{name}.lock").write_text("")
        dirs[name] = d
    for name in ("stale", "build-inprogress"):
        os.utime(dirs[name] / f"{build.MODULE}.so", (old, old))
    os.utime(dirs["empty_stale"], (old, old))
    removed = build.prune_stale(tmp_path, dirs["new"])
    assert sorted(p.name for p in removed) == ["empty_stale", "stale"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["build-inprogress", "new", "recent"]
    assert not (tmp_path / "stale.lock").exists() and (tmp_path / "recent.lock").exists()


@KERNELS
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the targets named are x86-64's")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])
def test_kernels_built_for_avx2_and_for_128_bit_vectors_pass_their_tests(arch, tmp_path):
    """The kernels' 16-lane vector code built for AVX2 (``x86-64-v3``) and for baseline x86-64 (SSE2: 128-bit vectors,
    the width of arm64's NEON) -- not only for this machine's own -- passes the kernel-vs-op-path, partials and encoder
    tests (``VELOXQUANT_CPU_ARCH``, a fresh build cache, a pytest of its own)."""
    env = dict(os.environ, VELOXQUANT_CACHE=str(tmp_path), VELOXQUANT_CPU_ARCH=arch)
    tests = ("same_steps or partials_equal or partials_over or kivi_cpu_kernel_equals or encoder_gives or "
             "kivi_sink_decodes or age_tiered_decodes or kitty_decodes or skvq_decodes or zipcache_decodes or "
             "gear_decodes or nsnquant_decodes or latents or xkv_decodes or amc_decodes or adakv_decodes or "
             "anchorkv_decodes or kvquant_decodes or palu_decodes or cachegen_decodes")
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests]
    where = dict(env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    listed = re.search(r"(\d+)/\d+ tests collected", subprocess.run(pytest + ["--collect-only"], **where).stdout)
    run = subprocess.run(pytest, timeout=900, **where)
    assert listed and int(listed[1]) >= 50, "the selection lost tests"
    assert run.returncode == 0 and f"\n{listed[1]} passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    built = list(tmp_path.glob("native/*/_veloxquant_cpu*"))
    assert len(built) == 1 and built[0].parent.name != build.build_key()  # its own key: another binary


ARM64_COMPILERS = [c for c in (["clang++", "--target=aarch64-linux-gnu", "-mcpu=apple-m1"],
                                ["aarch64-linux-gnu-g++", "-mcpu=cortex-a76"]) if shutil.which(c[0])]


@pytest.mark.skipif(not (HAS_NANOBIND and shutil.which("aarch64-linux-gnu-g++")),
                    reason="no arm64 cross toolchain here (Debian: apt-get install g++-aarch64-linux-gnu [clang])")
@pytest.mark.parametrize("compiler", ARM64_COMPILERS, ids=lambda c: c[0])
@pytest.mark.parametrize("source", [s for s in build.SOURCES if s.endswith(".cpp")])
def test_kernel_sources_compile_for_arm64_without_warnings(compiler, source, tmp_path):
    """Most users' CPUs are arm64 (Apple silicon, Graviton): every source of the extension compiles for it (NEON's
    128-bit vectors; clang as on a Mac, targeting the M1; GCC for Linux) with -Wall and no warning -- compiled only,
    not run here (the baseline x86-64 build above runs the same vector code at the same width)."""
    import nanobind
    import sysconfig

    native_dir = Path(build.__file__).resolve().parent
    mlx_include = Path(mx.__file__).resolve().parent / "include"
    nb_include = Path(nanobind.include_dir())
    includes = [mlx_include, nb_include, nb_include.parent / "ext/robin_map/include",
                Path(sysconfig.get_paths()["include"])]
    cmd = [*compiler, "-std=c++20", "-O3", "-fopenmp-simd", "-Wall", "-c", str(native_dir / source), "-o",
           str(tmp_path / "x.o"), *(f"-I{p}" for p in includes)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "warning" not in run.stderr, run.stderr[-3000:]
    assert (tmp_path / "x.o").stat().st_size > 0


def test_a_bad_target_name_is_refused_naming_the_variable(monkeypatch):
    """``VELOXQUANT_CPU_ARCH`` that is not a compiler target name is refused before any build."""
    monkeypatch.setenv("VELOXQUANT_CPU_ARCH", "native -fplugin=x")
    with pytest.raises(build.BuildError, match="VELOXQUANT_CPU_ARCH='native -fplugin=x' is not a compiler target"):
        build.target_arch()
    monkeypatch.setenv("VELOXQUANT_CPU_ARCH", "x86-64-v3")
    assert build.target_arch() == "x86-64-v3"


# ------------------------------------------------------------------------------------------- the partials form
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_partials_part_joins_the_softmax_as_its_scores_would(with_sinks):
    """``joint_attention`` with one group of keys given as its partials (m, l, acc) equals the same group given as
    scores and values (float64 reference), beside an exact group; with ``weights`` the exact group's masses are those
    of the scores form's (ZipCache's saliency); an array mask is refused."""
    rng = np.random.default_rng(3)
    B, H, rep, N, D, M1, M2 = 1, 2, 3, 1, 16, 50, 7
    q = mx.array(rng.normal(size=(B, H, rep, N, D)).astype(np.float32))
    k1, v1 = (mx.array(rng.normal(size=(B, H, M1, D)).astype(np.float32)) for _ in range(2))
    k2, v2 = (mx.array(rng.normal(size=(B, H, M2, D)).astype(np.float32)) for _ in range(2))
    qf = q.reshape(B, H, rep * N, D)
    s1 = qf @ k1.swapaxes(-1, -2)
    m = s1.max(axis=-1)
    p = mx.exp(s1 - m[..., None])
    part = Partials(m, p.sum(axis=-1), p @ v1)
    exact = (qf @ k2.swapaxes(-1, -2), lambda w: w @ v2, ((M1, M1 + M2),))
    sinks = mx.array(rng.normal(size=(H * rep,)).astype(np.float32)) if with_sinks else None
    got = joint_attention(q, [(part, None, ((0, M1),)), exact], None, sinks, M1 + M2, mx.float32)
    want = joint_attention(q, [(s1, lambda w: w @ v1, ((0, M1),)), exact], None, sinks, M1 + M2, mx.float32)
    k = mx.concatenate([k1, k2], axis=2)
    v = mx.concatenate([v1, v2], axis=2)
    ref = _softmax_attention64(q.reshape(B, H * rep, N, D), k, v, 1.0, None if sinks is None else np.array(sinks))
    assert _rel(got, ref) < 1e-5 and _rel(got, want) < 1e-5
    out, (mass,) = joint_attention(q, [(part, None, ((0, M1),)), exact], None, sinks, M1 + M2, mx.float32, weights=True)
    _, (_, want_mass) = joint_attention(q, [(s1, lambda w: w @ v1, ((0, M1),)), exact], None, sinks, M1 + M2,
                                        mx.float32, weights=True)
    assert _rel(out, ref) < 1e-5 and mass.shape == (B, H, M2) and _rel(mass, want_mass) < 1e-5
    with pytest.raises(ValueError, match="no array mask"):
        joint_attention(q, [(part, None, ((0, M1),)), exact], mx.ones((N, M1 + M2), dtype=mx.bool_), sinks,
                        M1 + M2, mx.float32)


# ------------------------------------------------------------------------------------------- TurboQuant-RVQ
def _rvq(D, **opts):
    options = TurboQuantRVQOptions(**opts)
    return KVCacheFactory.create(KVCacheConfig(method="turboquant_rvq", head_dim=D, options=options))


@pytest.fixture
def rvq_calls(monkeypatch):
    """TurboQuant-RVQ's decode steps that took the CPU kernel."""
    return _spy_kernel(monkeypatch, TurboQuantRVQKVCache)


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: keys 8 + 4 bits a 4-dim piece, values 8 bits an 8-dim piece
    (1, 1, 64, {"residual_length": 16}, 90, 30),
    (2, 5, 32, {"key_sub_dim": 2, "key_codebook_bits": 6, "value_sub_dim": 4, "value_codebook_bits": 10,
                "residual_length": 8}, 150, 24),  # 6-bit codes straddle words; values in two stages; R in two groups
    (2, 8, 128, {"key_codebook_bits": 8, "residual_length": 32}, 200, 12),  # keys in one stage
    (3, 3, 64, {"residual_length": 32}, 2100, 6)])  # a past split over the threads
def test_rvq_cpu_kernel_equals_float64_attention_over_the_stored_rows(H, R, D, opts, prompt, steps, rvq_calls):
    """TurboQuant-RVQ's decode steps through the CPU kernel (window compactions crossed, sink logits every other
    step) attend over exactly the rows the cache stores, in float64: one- and two-stage codebooks on either side,
    codes of 4, 6, 8 bits (straddling words), pieces of 2-8 coordinates, GQA 1-8, head dims 32-128."""
    c = _rvq(D, **opts)
    rng = np.random.default_rng(prompt + R)
    _feed(c, H, R, D, prompt, rng)
    _steps_equal_float64(c, H, R, D, steps, rng)
    assert len(rvq_calls) == steps and "turboquant_rvq_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("n_rows", [4097, 1000, 63])
def test_rvq_cpu_kernel_partials_equal_float64_sums_over_the_codes(n_rows, rvq_calls):
    """The kernel's partials (m, l, acc) of the first ``n`` rows (rotated queries and values) equal float64 sums over
    the codebooks' decoding of the same codes; n = 0 gives the empty partials."""
    H, R, D = 1, 3, 64
    c = _rvq(D, residual_length=16)
    rng = np.random.default_rng(n_rows)
    _feed(c, H, R, D, n_rows + 40, rng)
    n, (kq, vq) = c.n_quant, c._qs()
    qr = (_rows(rng, H, R, D) * 0.3) @ kq.rot_t
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    keys = f64(kq.decode_rotated(*c._planes("k_", n))) * f64(c.k_norms[:, :, :n])[..., None]
    vals = f64(vq.decode_rotated(*c._planes("v_", n))) * f64(c.v_norms[:, :, :n])[..., None]
    s = np.einsum("bhrd,bhnd->bhrn", f64(qr), keys)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    args = (qr, c.k_codes1, c.k_codes2, c.k_norms, kq.cb.c1, kq.cb.sigma, kq.cb.c2, c.v_codes1, None, c.v_norms,
            vq.cb.c1, vq.cb.sigma, None)
    m, l, acc = native.module().turboquant_rvq_decode(*args, n, D)  # noqa: E741
    # a score is a sum of 2 * 16 table entries, each a 4-term dot product: its float32 error scales with
    spread = np.einsum("bhrd,bhnd->bhrn", np.abs(f64(qr)), np.abs(keys)).max()
    tol = 8 * D * float(np.finfo(np.float32).eps) * spread + 1e-6
    np.testing.assert_allclose(np.array(m), s.max(axis=-1), rtol=0, atol=tol)
    assert _rel(l, p.sum(axis=-1)) < tol and _rel(acc, np.einsum("bhrn,bhnd->bhrd", p, vals)) < tol, tol
    m0, l0, a0 = native.module().turboquant_rvq_decode(*args, 0, D)
    assert np.isneginf(np.array(m0)).all() and not np.array(l0).any() and not np.array(a0).any()


@KERNELS
def test_rvq_cpu_kernel_rejects_inconsistent_inputs(rvq_calls):
    """Codes, codebooks and shapes that do not fit each other are refused when the call is made."""
    H, R, D = 2, 2, 64
    c = _rvq(D, residual_length=16)
    _feed(c, H, R, D, 120, np.random.default_rng(0))
    kq, vq = c._qs()
    q = mx.zeros((1, H, R, D))
    k = [c.k_codes1, c.k_codes2, c.k_norms, kq.cb.c1, kq.cb.sigma, kq.cb.c2]
    v = [c.v_codes1, None, c.v_norms, vq.cb.c1, vq.cb.sigma, None]
    f = native.module().turboquant_rvq_decode
    with pytest.raises(ValueError, match="keys: stage-1 words or rows"):
        f(q, *k, *v, c.k_codes1.shape[2] + 1, D)
    with pytest.raises(ValueError, match="batch or heads differ"):
        f(mx.zeros((1, H + 1, R, D)), *k, *v, 8, D)
    with pytest.raises(ValueError, match="stage-2 codes and codebook go together"):
        f(q, *k[:5], None, *v, 8, D)
    with pytest.raises(ValueError, match="values: piece size must divide the head dim"):
        f(q, *k, *v, 8, 60)
    with pytest.raises(ValueError, match="keys: stage-1 codebook size"):
        f(q, k[0], k[1], k[2], k[3][:200], k[4][:200], k[5], *v, 8, D)


def _kernel_steps(c, cls, H, R, D, prompt, steps, seed, monkeypatch) -> list:
    """A prompt of ``prompt`` rows through cache ``c``, then ``steps`` decode steps, each equal to float64 attention
    over the rows it stores (``_steps_equal_float64``); returns the steps of ``cls`` caches that took their kernel."""
    calls = _spy_kernel(monkeypatch, cls)
    rng = np.random.default_rng(seed)
    _feed(c, H, R, D, prompt, rng)
    _steps_equal_float64(c, H, R, D, steps, rng)
    return calls


def _nsn(D, **opts):
    return _variant("nsnquant", NSNQuantKVCache, D, NSNQuantOptions(**opts))


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 2 bits a coordinate as two stages of 8-bit codes on 8-dim pieces
    (2, 4, 128, {"residual_length": 32}, 100, 40),  # groups completed during the steps
    (1, 5, 64, {"bits": 1, "residual_length": 16}, 90, 30),  # one stage; R in two groups of query lanes
    (2, 2, 64, {"bits": 1, "codebook_size": 16, "residual_length": 16}, 70, 30),  # two stages of 4-bit codes
    (3, 3, 64, {"residual_length": 32}, 2100, 6)])  # a past split over the threads
def test_nsnquant_decodes_on_the_rvq_cpu_kernel(H, R, D, opts, prompt, steps, monkeypatch):
    """NSNQuant's decode steps read its codes in TurboQuant-RVQ's CPU kernel (norm pairs, the keys' mean as q . mu,
    both stages in one row, the values' mean weight in acc's last column): each step equals float64 attention over
    the rows the cache stores, across completed groups, with sink logits every other step."""
    c = _nsn(D, **opts)
    calls = _kernel_steps(c, NSNQuantKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "nsnquant_cpu" in _common._checked and c.stages <= 2


@KERNELS
def test_nsnquant_with_more_than_two_stages_decodes_on_its_op_path(monkeypatch):
    """Four residual stages (2 bits a coordinate from 16-codeword books) are past the kernel's two: the op path."""
    H, R, D = 2, 2, 64
    c = _nsn(D, codebook_size=16, residual_length=16)
    calls = _kernel_steps(c, NSNQuantKVCache, H, R, D, 70, 4, 4, monkeypatch)
    assert c.stages == 4 and not calls


@KERNELS
def test_rvq_cpu_kernel_takes_norm_pairs_only_with_the_keys_mean(rvq_calls):
    """NSNQuant's arguments that do not fit each other are refused: key norm pairs without q . mu (or q . mu of the
    wrong shape), a stage-2 word offset without stage-2 codes or past the row."""
    H, R, D = 2, 2, 64
    c = _nsn(D, residual_length=16)
    _feed(c, H, R, D, 70, np.random.default_rng(0))
    rot, books = c._tools(D)
    ones, q = mx.ones((c.C,)), mx.zeros((1, H, R, D))
    side = [c.k_codes, c.k_codes, c.k_norms, books[0], ones, books[1]]
    f, n = native.module().turboquant_rvq_decode, c.n_quant
    bias = mx.zeros((1, H, R))
    with pytest.raises(ValueError, match="k_bias"):
        f(q, *side, *side, n, D, k_word2=2, v_word2=2)
    with pytest.raises(ValueError, match="k_bias"):
        f(q, *side, *side, n, D, k_bias=mx.zeros((1, H, R + 1)), k_word2=2, v_word2=2)
    with pytest.raises(ValueError, match="word2"):
        f(q, c.k_codes, None, c.k_norms, books[0], ones, None, *side, n, D, k_bias=bias, k_word2=2, v_word2=2)
    with pytest.raises(ValueError, match="stage-2 codes"):
        f(q, *side, *side, n, D, k_bias=bias, k_word2=3, v_word2=2)
    m, l, acc = f(q, *side, *side, n, D, k_bias=bias, k_word2=2, v_word2=2)  # noqa: E741
    assert acc.shape == (1, H, R, D + 1) and m.shape == l.shape == (1, H, R)


# ------------------------------------------------------------------------------------------- VecInfer
def _vecinfer(D, **sets):
    """A VecInfer cache of head dim ``D``; ``sets`` by setting name (its sub-vector dims and codebook bits are shared
    flat fields: ``build_config`` passes them without the flat-field warning)."""
    c = KVCacheFactory.create(build_config("vecinfer", {"head_dim": D, **sets}))
    assert isinstance(c, VecInferKVCache)
    return c


@KERNELS
@pytest.mark.parametrize("H,R,D,sets,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 12-bit keys (planes of 8 + 4 bits) on 4-dim pieces, 8-bit values on 8
    (2, 4, 128, {}, 100, 40),  # blocks completed during the steps
    (1, 5, 64, {"key_codebook_bits": 10}, 200, 30),  # planes of 8 + 2 bits; R in two groups of query lanes
    (2, 2, 64, {"key_codebook_bits": 8, "key_sub_dim": 2, "value_sub_dim": 16}, 200, 30),  # no high plane
    (2, 1, 32, {"key_codebook_bits": 6, "value_codebook_bits": 10, "value_sub_dim": 4}, 200, 30),  # values' planes
    (3, 3, 64, {}, 2100, 6),  # a past split over the threads: key scores from the codewords
    (1, 2, 64, {"key_codebook_bits": 9, "key_sub_dim": 16}, 2100, 6),  # ... from a table of them
    (2, 3, 64, {"key_codebook_bits": 10, "key_codebook": np.random.default_rng(3).normal(size=(600, 4))}, 200, 12)])
def test_vecinfer_decodes_on_the_rvq_cpu_kernel(H, R, D, sets, prompt, steps, monkeypatch):
    """VecInfer's decode steps read its codes in TurboQuant-RVQ's CPU kernel (joint sides: a code's low and high
    planes one index into the layer's codebook, unit norms, the keys' query smoothed and rotated): each step equals
    float64 attention over the rows the cache stores, across completed blocks, with sink logits every other step;
    a given codebook short of 2^bits rows (padded for the kernel)."""
    c = _vecinfer(D, **sets)
    calls = _kernel_steps(c, VecInferKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "vecinfer_cpu" in _common._checked and c.key_cb.shape[0] == 1


@KERNELS
@pytest.mark.parametrize("n_rows,sets", [(4097, {"key_codebook_bits": 9, "key_sub_dim": 16}), (1000, {}),
                                         (63, {"value_codebook_bits": 10})])
def test_vecinfer_cpu_partials_equal_float64_sums_over_the_codes(n_rows, sets, monkeypatch):
    """``_cpu_part``'s partials (m, l, acc) of the first ``n`` coded rows equal float64 sums over the codebooks'
    decoding of the same codes: key scores read from a table (long ranges of small codebooks) or from the codewords,
    values' bins over 8- and 10-bit codebooks."""
    H, R, D = 2, 3, 64
    c = _vecinfer(D, **sets)
    rng = np.random.default_rng(n_rows)
    _feed(c, H, R, D, n_rows + 100, rng)
    assert c.n_quant >= n_rows
    qf = _rows(rng, H, R, D) * 0.3
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    qt = f64((qf * c.smooth[None, :, None, :]) @ c._rot(D))
    keys = f64(vi._lookup(c._codes("k", n_rows), c.key_cb))  # the transformed keys' codewords
    s = np.einsum("bhrd,bhnd->bhrn", qt, keys)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    part = c._cpu_part(qf, n_rows)
    spread = np.einsum("bhrd,bhnd->bhrn", np.abs(qt), np.abs(keys)).max()
    tol = 8 * D * float(np.finfo(np.float32).eps) * spread + 1e-6
    np.testing.assert_allclose(np.array(part.m), s.max(axis=-1), rtol=0, atol=tol)
    assert _rel(part.l, p.sum(axis=-1)) < tol
    assert _rel(part.acc, np.einsum("bhrn,bhnd->bhrd", p, f64(c._values(n_rows)))) < tol, tol


@KERNELS
def test_vecinfer_with_per_head_codebooks_decodes_on_its_op_path(monkeypatch):
    """A key codebook per head (given as [H, K, d]) is past the kernel's one codebook a side: the op path, still
    equal to float64 attention over the stored rows."""
    H, R, D = 2, 2, 64
    cb = mx.array(np.random.default_rng(1).normal(size=(H, 64, 4)).astype(np.float32))
    c = _vecinfer(D, key_codebook_bits=6, key_codebook=cb)
    calls = _kernel_steps(c, VecInferKVCache, H, R, D, 120, 6, 5, monkeypatch)
    assert c.key_cb.shape[0] == H and c.n_quant and not calls


@KERNELS
def test_rvq_cpu_kernel_takes_joint_sides_only_as_they_fit():
    """VecInfer's joint arguments that do not fit are refused naming what is wrong: a stage-2 codebook beside a
    joint side, a codebook whose size does not match the planes (a high plane needs 2^9 .. 2^16 rows, none at most
    2^8), a high plane with too few rows, values' bins past 2^16; unit norms (shape [B, H, 0]) take any row count."""
    H, R, D = 2, 2, 64
    c = _vecinfer(D)
    _feed(c, H, R, D, 120, np.random.default_rng(0))
    n, q = c.n_quant, mx.zeros((1, H, R, D))
    unit, none = mx.zeros((1, H, 0), mx.float16), mx.zeros((0,))
    k = [c.k_lo, c.k_hi, unit, c.key_cb[0], none, None]
    v = [c.v_lo, None, unit, c.val_cb[0], none, None]
    f = native.module().turboquant_rvq_decode
    with pytest.raises(ValueError, match="keys: joint: no stage-2 codebook"):
        f(q, *k[:5], c.key_cb[0], *v, n, D, k_joint=True, v_joint=True)
    with pytest.raises(ValueError, match="keys: joint codebook size"):  # a high plane with 2^8 rows
        f(q, *k[:3], c.val_cb[0, :, :4], *k[4:], *v, n, D, k_joint=True, v_joint=True)
    with pytest.raises(ValueError, match="values: joint codebook size"):  # 2^12 rows without a high plane
        f(q, *k, c.v_lo, None, unit, mx.zeros((4096, 8)), none, None, n, D, k_joint=True, v_joint=True)
    with pytest.raises(ValueError, match="keys: stage-2 codes"):
        f(q, k[0], k[1][:, :, :4], *k[2:], *v, n, D, k_joint=True, v_joint=True)
    with pytest.raises(ValueError, match="stage-2 codes and codebook go together"):  # joint off: as before
        f(q, *k, *v, n, D, v_joint=True)
    hi8 = mx.zeros((1, H, n, 2), mx.uint32)  # 16-bit values: 8 pieces x 2^16 bins
    with pytest.raises(ValueError, match=r"values: joint bins \(pieces x codewords\) up to 2\^16"):
        f(q, *k, c.v_lo, hi8, unit, mx.zeros((1 << 16, 8)), none, None, n, D, k_joint=True, v_joint=True)
    m, l, acc = f(q, *k, *v, n, D, k_joint=True, v_joint=True)  # noqa: E741
    assert acc.shape == (1, H, R, D) and m.shape == l.shape == (1, H, R)


@KERNELS
@pytest.mark.parametrize("method,H,R,D,opts,prompt,steps", [
    ("svdq", 3, 3, 64, {}, 300, 40),  # the defaults: latents of 8/4/2/1 bits, KIVI's 2-bit value rows
    ("svdq", 2, 4, 128, {"rank": 40, "bit_schedule": (8, 3, 2)}, 100, 40),  # 3-bit codes straddle words
    ("svdq", 1, 2, 64, {"group_size": 16}, 2100, 6),  # 16-token groups; a past split over the threads
    ("kvtc", 3, 3, 64, {}, 300, 40),  # one head group: 9 query rows over ~160 latents a side, 2-3 bits
    ("kvtc", 2, 2, 32, {"bit_budget": 256, "bit_choices": (0, 5, 6, 7)}, 200, 24)])  # 5-7-bit codes
def test_low_rank_caches_decode_on_their_latents_in_the_cpu_kernel(method, H, R, D, opts, prompt, steps,
                                                                    monkeypatch):
    """SVDq's and KVTC's decode steps read their latents in one pass (``native/latent_cpu.cpp``): each block's
    latents decoded and scored against the projected queries (plus q . mu), values as latents turned back once or
    KIVI's rows; each step equals float64 attention over the rows the cache stores, with groups completed and sink
    logits every other step."""
    options = (SVDqOptions if method == "svdq" else KVTCOptions)(**opts)
    c = _variant(method, LowRankKVCache, D, options)
    calls = _kernel_steps(c, LowRankKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and f"{method}_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 4-bit latents of the rank holding 0.95 of the energy
    (2, 4, 128, {"rank": 24, "latent_bits": 3, "group_quant_size": 16}, 100, 40),  # 3-bit codes straddle words
    (1, 2, 64, {"latent_bits": 8}, 2100, 6)])  # a past split over the threads
def test_xkv_decodes_on_its_latents_in_the_cpu_kernel(H, R, D, opts, prompt, steps, monkeypatch):
    """xKV's decode steps read the group's latents (KIVI's key layout: ``channel_major``) in the latent kernel, the
    queries through the layer's block of the projection, the values' latent sum turned back once; each step equals
    float64 attention over the rows the cache stores, with groups completed and sink logits every other step."""
    c = _variant("xkv", XKVKVCache, D, XKVOptions(**opts))
    calls = _kernel_steps(c, XKVKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "xkv_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 6 / 10 / 16 rows of a 32-token group at 8 / 4 / 2 bits
    (2, 4, 128, {"k_high": 0.1, "k_mid": 0.4, "group_size": 64}, 200, 70),  # 6 / 26 / 32 rows of 64; a group completed
    (1, 2, 64, {"k_high": 0.0, "k_mid": 0.0}, 100, 8),  # one tier
    (3, 3, 64, {}, 2100, 6)])  # a past split over the threads
def test_amc_decodes_on_the_latent_kernel_a_call_per_tier(H, R, D, opts, prompt, steps, monkeypatch):
    """AMC's decode steps read each tier's rows in the latent kernel (keys per token on their group's shared channel
    ranges: ``k_rows_per_group``; values KIVI's rows) and join the tiers' partials; each step equals float64 attention
    over the rows the cache stores, with sink logits every other step."""
    c = _variant("amc", AMCKVCache, D, AMCOptions(**opts))
    calls = _kernel_steps(c, AMCKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "amc_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 2 / 3 / 4-bit tiers at 2.5 bits (3-bit codes straddle words)
    (2, 4, 128, {"importance": "attention", "group_size": 64, "target_avg_bits": 4.0, "lo_bit": 2, "mid_bit": 5,
                 "hi_bit": 8}, 200, 70),  # ranked by the real queries; 5-bit codes; a group completed in the steps
    (1, 2, 64, {"target_avg_bits": 2.0}, 100, 8),  # every row in the lowest tier
    (3, 3, 64, {}, 2100, 6)])  # a past split over the threads
def test_adakv_decodes_on_the_latent_kernel_a_call_per_tier(H, R, D, opts, prompt, steps, monkeypatch):
    """AdaKV's decode steps read each tier's rows in the latent kernel as AMC's do (keys on their group's channel
    ranges; values per token on their groups' ranges: ``v_row_ranges``, codes of any width): each step equals float64
    attention over the rows the cache stores, with sink logits every other step."""
    c = _variant("adakv", AdaKVKVCache, D, AdaKVOptions(**opts))
    dispatch.install()
    calls = _kernel_steps(c, AdaKVKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "adakv_cpu" in _common._checked


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: one anchor a 32-token group, 2-bit residuals
    (2, 4, 128, {"anchor_frac": 0.125, "residual_bits": 4, "window": 64}, 200, 70),  # 8 anchors; a group completed
    (1, 2, 64, {"theta": 0.0, "anchor_frac": 0.1}, 100, 8),  # 3 anchors, 2-bit references
    (3, 3, 64, {"window": 16}, 2100, 6)])  # a past split over the threads, groups of 16 inside a block
def test_anchorkv_decodes_on_kivis_cpu_kernel_its_anchors_as_corrections(H, R, D, opts, prompt, steps,
                                                                           monkeypatch):
    """AnchorKV's decode steps read its residual codes as key and value rows in KIVI's CPU kernel, each row's anchor
    added in the block's products and the anchor rows put back exactly (``fixes``, ``fix_group``): each step equals
    float64 attention over the rows the cache stores, with sink logits every other step."""
    c = _variant("anchorkv", AnchorKVCache, D, AnchorKVOptions(**opts))
    calls = _kernel_steps(c, AnchorKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "anchorkv_cpu" in _common._checked


def _kvquant(D, rope=None, **opts):
    """A KVQuant cache of head dim ``D``, bound to a RoPE of ``_rope(rope, D)`` (None: keys quantized post-RoPE)."""
    c = _variant("kvquant", KVQuantKVCache, D, KVQuantOptions(**opts))
    if rope is not None:
        c.bind_attention(nn.Module())  # no rope attribute: unbound, as a model without one ...
        attn = nn.Module()
        attn.rope = _rope(rope, D)
        c.bind_attention(attn)  # ... then the layer's RoPE
        assert c.rope is not None
    return c


def _turned_rows64(c, K, n, exact: int = 0):
    """The keys a cache with pre-RoPE codes (KVQuant, Palu) attends with, in float64: its first ``n`` coded rows (the
    call's: a call completing a group attends that group's exact rows) decoded pre-RoPE by the op path (``c.rope``
    unset meanwhile) and turned to their positions in float64 but the first ``exact`` (KVQuant's float16 sinks, stored
    post-RoPE), then the exact rows of ``K`` after them."""
    rope = c.rope
    c.rope = None
    try:
        k = np.asarray(c._keys_t(n).swapaxes(-1, -2), np.float64)  # [B, H, n, D]
    finally:
        c.rope = rope
    if rope is not None:
        w, partner, sign = (np.asarray(a) for a in rope_tables(rope, k.shape[-1]))
        t = np.arange(n, dtype=np.float64)[:, None] * w.astype(np.float64)
        turned = k * np.cos(t) - sign * k[..., partner] * np.sin(t)
        k = np.concatenate([k[:, :, :exact], turned[:, :, exact:]], axis=2)
    return np.concatenate([k, np.asarray(K[:, :, n:], np.float64)], axis=2)


def _turned_steps(c, cls, H, R, D, prompt, steps, monkeypatch, exact: int = 0) -> list:
    """A prompt of ``prompt`` rows through ``c``, then ``steps`` decode steps, each equal to float64 attention over the
    rows it stores with its coded keys turned in float64 (``_turned_rows64``), sink logits every other step; returns
    the steps of ``cls`` caches that took their CPU kernel."""
    calls = _spy_kernel(monkeypatch, cls)
    rng = np.random.default_rng(prompt)
    _feed(c, H, R, D, prompt, rng)
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32))
    for i in range(steps):
        n = c.n_quant
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, scale=2.0), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        sk = sinks if i % 2 else None
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sk)
        want = _softmax_attention64(q, _turned_rows64(c, K, n, exact), V, D**-0.5, None if sk is None else np.array(sk))
        assert _rel(out, want) < 1e-5, (i, c.offset)
    return calls


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,rope,prompt,steps", [
    (3, 3, 64, {}, "rope", 300, 40),  # the defaults (3 bits, 1% outliers, one sink); groups completed
    (2, 4, 128, {"bits": 4}, "traditional", 100, 8),
    (1, 2, 64, {"bits": 2, "outlier_fraction": 0.0, "n_sink": 0}, None, 90, 8),  # keys post-RoPE, nothing exact
    (2, 2, 64, {"refit_interval": 2}, "rope", 200, 8),  # levels refitted every two groups: several fits
    (3, 3, 64, {"n_sink": 5, "group_size": 64}, "partial", 2100, 6)])  # a past split over the threads
def test_kvquant_decodes_on_its_cpu_kernel_keys_turned_per_block(H, R, D, opts, rope, prompt, steps, monkeypatch):
    """KVQuant's decode steps read its codes once in ``kvquant_decode`` (non-uniform key levels, outliers put back,
    pre-RoPE keys turned per block of rows, float16 sinks): each step equals float64 attention over the rows the
    cache stores, the quantized keys turned in float64, with sink logits every other step."""
    c = _kvquant(D, rope, **opts)
    calls = _turned_steps(c, KVQuantKVCache, H, R, D, prompt, steps, monkeypatch, exact=c.n_sink)
    assert len(calls) == steps and "kvquant_cpu" in _common._checked


def _palu(H, D, groups, rope=None, bias=False, seed=0, **opts):
    """A Palu cache of ``H`` KV heads of dim ``D`` in up to ``groups`` head groups, bound to a layer of random
    ``k_proj`` / ``v_proj`` (``seed``'s; with a ``k_proj`` bias: the latents' offset) and a RoPE of ``_rope(rope,
    D)``."""
    c = _variant("palu", PALUKVCache, D, PaluOptions(n_head_groups=groups, **opts))
    attn = nn.Module()
    mx.random.seed(seed)
    attn.k_proj, attn.v_proj = nn.Linear(96, H * D, bias=bias), nn.Linear(96, H * D, bias=False)
    attn.n_kv_heads = H
    if rope is not None:
        attn.rope = _rope(rope, D)
    c.bind_attention(attn)
    return c


@KERNELS
@pytest.mark.parametrize("H,R,D,groups,rope,bias,prompt,steps", [
    (3, 3, 64, 4, "rope", False, 300, 40),  # SmolLM2's shape: a head a group; groups completed
    (3, 3, 64, 4, "rope", True, 120, 8),  # a k_proj bias: each head's offset added before the turn
    (4, 2, 64, 2, "traditional", False, 200, 8),  # two heads a group
    (2, 4, 128, 1, None, False, 100, 8),  # no RoPE
    (2, 2, 64, 2, "partial", False, 2100, 6)])  # a past split over the threads; half the channels rotated
def test_palu_decodes_on_the_latent_kernel_its_keys_rebuilt_per_block(H, R, D, groups, rope, bias, prompt, steps,
                                                                     monkeypatch):
    """Palu's decode steps rebuild each block's pre-RoPE keys from the latents in the latent kernel (``k_rebuild``:
    ``U_r z + b`` per head of the group, turned per block) and sum the values as latents: each step equals float64
    attention over the rows the cache stores, the rebuilt keys turned in float64, with sink logits every other
    step."""
    c = _palu(H, D, groups, rope, bias, seed=prompt)
    calls = _turned_steps(c, PALUKVCache, H, R, D, prompt, steps, monkeypatch)
    assert len(calls) == steps and "palu_cpu" in _common._checked
    assert c.hg == max(g for g in range(1, min(groups, H) + 1) if H % g == 0)  # heads a group: H / hg



@KERNELS
@pytest.mark.parametrize("R,with_sinks", [(3, False), (3, True), (1, False)])
def test_minicache_decodes_raw_blocks_in_place_and_merged_ones_on_partials(R, with_sinks, monkeypatch):
    """MiniCache's CPU decode step: blocks kept raw (dissimilar pairs) read in place by ``joint_finish``, merged
    blocks as softmax partials on the shared direction (their retained rows' scores and values corrected); every
    step of both layers equals float64 attention over the rows each stores, across raw / merged runs, a block
    merged during the steps, and a trim that cuts into a merged run."""
    B, H, D = 1, 2, 64
    cfg = KVCacheConfig(method="minicache", head_dim=D, options=MiniCacheOptions(start_frac=0.0,
                                                                                 retention_threshold=0.5))
    prim, mer = MiniCacheKVCache.build_layers([cfg] * 2)
    calls = []
    real = MiniCacheKVCache._attend_cpu
    monkeypatch.setattr(MiniCacheKVCache, "_attend_cpu",
                        lambda c, *a, **k: calls.append((c.mc_role, c.n_raw, c.n_quant)) or real(c, *a, **k))
    rng = np.random.default_rng(R)
    T = 5 * MC_BLOCK + 7
    t = np.arange(T)
    alike = ((t // MC_BLOCK) % 2 == 1) & (t % 8 != 0)  # blocks 1 and 3 alike but every 8th row: merged, retained
    rows = lambda n: rng.normal(size=(B, H, n, D)).astype(np.float32)  # noqa: E731
    kp, vp = rows(T), rows(T)
    km = np.where(alike[:, None], 1.5 * kp + 0.1 * rows(T), rows(T))
    vm = np.where(alike[:, None], 0.7 * vp + 0.1 * rows(T), rows(T))
    prim.update_and_fetch(mx.array(kp), mx.array(vp))
    mer.update_and_fetch(mx.array(km), mx.array(vm))
    form = [[1, MC_BLOCK], [0, MC_BLOCK]] * 2 + [[1, MC_BLOCK]]
    assert prim.runs == mer.runs == form and mer.n_raw == 3 * MC_BLOCK
    assert mer.n_retained_k == mer.n_retained_v == 2 * B * H * MC_BLOCK // 8
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None

    def steps(n):
        for _ in range(n):
            q = mx.array(rows(R).reshape(B, H * R, 1, D))
            k, v = rows(1), rows(1)
            for c, (kk, vv) in ((prim, (k, v)), (mer, (1.5 * k, v))):
                K, V = c.update_and_fetch(mx.array(kk), mx.array(vv))
                out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sinks)
                want = _softmax_attention64(q, K, V, D**-0.5, None if sinks is None else np.array(sinks))
                assert _rel(out, want) < 1e-5, (c.mc_role, c.offset)

    steps(30)  # the window's 7 + 25 rows complete a sixth block (alike: merged)
    assert mer.runs == form + [[0, MC_BLOCK]] and mer.n_quant == 6 * MC_BLOCK and mer.n_res == 5
    for c in (mer, prim):
        assert c.trim(5 + 2 * MC_BLOCK + 10) > 0  # the window, the last two blocks, 10 rows of the next merged one
    assert mer.runs == prim.runs == form[:3] + [[0, MC_BLOCK - 10]] and mer.n_quant == 4 * MC_BLOCK - 10
    assert mer.n_retained_k == B * H * MC_BLOCK // 8 + B * H * 3  # rows 96, 104, 112 of the second merged run kept
    steps(12)
    assert len(calls) == 2 * 42 and "minicache_cpu" in _common._checked and "minicache_cpu" not in _common._disabled



@KERNELS
@pytest.mark.parametrize("B,H,R,m,bits,K,n,cap", [
    (1, 3, 3, 8, 8, 256, 700, 720),  # A2ATS's defaults at a head dim of 64: 8 sub-vectors of 8-bit codes
    (2, 2, 4, 5, 6, 64, 301, 301),  # 6-bit codes straddle words; two batch rows
    (1, 1, 1, 16, 4, 11, 90, 130),  # a codebook short of 2^bits codewords; one query row
    (1, 2, 2, 11, 3, 8, 50, 64)])  # 3-bit codes, a row of 33 bits over two words
def test_vq_vote_equals_a_float64_softmax_of_the_table_scores(B, H, R, m, bits, K, n, cap):
    """A2ATS's vote (``vq_vote``): per query row, scores of the first n rows from the lookup table at each row's
    m codes (one little-endian stream a row, as ``bitpack.pack_bits`` writes it), softmaxed over the rows and summed
    over the query rows -- against float64."""
    rng = np.random.default_rng(bits)
    lut = rng.normal(size=(B, H, R, m, K)).astype(np.float32) * 3
    codes = rng.integers(0, K, size=(B, H, cap, m))
    got = native.module().vq_vote(mx.array(lut), bitpack.pack_bits(mx.array(codes.astype(np.uint32)), bits), n, bits)
    s = np.take_along_axis(lut.astype(np.float64)[:, :, :, None],  # [B, H, R, 1, m, K]
                           codes[:, :, None, :n, :, None], axis=-1)[..., 0].sum(-1)  # [B, H, R, n]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)).sum(2)
    assert got.shape == (B, H, n) and _rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="n in 1"):
        native.module().vq_vote(mx.array(lut), bitpack.pack_bits(mx.array(codes.astype(np.uint32)), bits), cap + 1,
                                bits)
    with pytest.raises(ValueError, match="fewer than m codes"):
        native.module().vq_vote(mx.array(lut), mx.zeros((B, H, cap, 1), mx.uint32), n, 16 if m * bits <= 32 else bits)



@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 2-bit codes, pairs of layers, groups completed during the steps
    (2, 4, 128, {"base_bits": 4, "group_size": 3}, 100, 30),  # three layers on one base's 4-bit codes
    (1, 2, 64, {"base_bits": 8, "group_quant_size": 64}, 2100, 6)])  # 64-token groups; a past split over threads
def test_xquant_decodes_on_kivis_cpu_kernel_the_base_codes_with_each_layers_scales(H, R, D, opts, prompt, steps,
                                                                                     monkeypatch):
    """XQuant's decode steps read the group's one set of codes (the base's) in KIVI's CPU kernel with each layer's
    own scales and zero points: every step of every layer (base first, as a model feeds them) equals float64
    attention over the rows it returned, with sink logits every other step."""
    cfg = KVCacheConfig(method="xquant", head_dim=D, options=XQuantOptions(**opts))
    layers = XQuantKVCache.build_layers([cfg] * opts.get("group_size", 2))
    calls = _spy_kernel(monkeypatch, XQuantKVCache)
    rng = np.random.default_rng(prompt)
    base = _rows(rng, H, prompt, D)
    for i, c in enumerate(layers):  # the other layers alike to the base (scaled, noisy): their fits mean something
        c.update_and_fetch(base * (1 + 0.5 * i) + 0.3 * i * _rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32))
    for i in range(steps):
        q = _rows(rng, H * R, 1, D)
        sk = sinks if i % 2 else None
        for c in layers:
            K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
            out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sk)
            want = _softmax_attention64(q, K, V, D**-0.5, None if sk is None else np.array(sk))
            assert _rel(out, want) < 1e-4, (c.xq_role, c.offset)
    assert len(calls) == steps * len(layers) and "xquant_cpu" in _common._checked
    assert [c.xq_role for c in layers][1:] == ["shared"] * (len(layers) - 1) and layers[1].k_codes is None


@KERNELS
def test_latent_kernel_rebuilds_keys_only_as_they_fit():
    """``latent_decode``'s ``k_rebuild`` names what does not fit: a basis of other heads or latents, channels not a
    multiple of 4, a bias beside it, rope tables of another width."""
    c = _palu(3, 64, 4, "rope")
    _feed(c, 3, 3, 64, 100, np.random.default_rng(0))
    q = mx.zeros((1, 3, 3, 64))
    k = [c.k_codes, c.k_scales, c.k_biases, c.k_raw]
    v = [c.v_codes, c.v_scales, c.v_biases]
    rope = list(rope_tables(c.rope, 64))
    call = lambda q, **kw: native.module().latent_decode(  # noqa: E731
        q, kw.pop("bias", None), 96, 32, *k, list(c.k_bits), *v, v_raw=c.v_raw, v_bits=list(c.v_bits),
        **{**dict(k_rebuild=c.k_basis, rope=rope, rotate=True), **kw})
    assert call(q)[0].shape == (1, 3, 3)
    for q_, kw in ((q, dict(k_rebuild=c.k_basis[..., :-1])), (q[..., :62], dict(rope=[a[:62] for a in rope])),
                   (q, dict(bias=mx.zeros((1, 3, 3)))), (q, dict(rope=[a[:32] for a in rope]))):
        with pytest.raises(ValueError, match="latent_decode: k_rebuild"):
            call(q_, **kw)


@KERNELS
@pytest.mark.parametrize("H,R,D,opts,prompt,steps", [
    (3, 3, 64, {}, 300, 40),  # the defaults: 4-bit deltas against 8-bit anchors; groups completed
    (2, 4, 128, {"bits": 5}, 100, 8),  # codes straddling words
    (1, 2, 64, {"bits": 6, "group_size": 64}, 200, 8),  # a block one group
    (2, 2, 64, {"bits": 8, "use_delta": False}, 90, 8),  # no anchors: KIVI's codes at 8 bits
    (3, 3, 64, {"bits": 3}, 2100, 6)])  # a past split over the threads
def test_cachegen_decodes_on_kvquants_cpu_kernel_its_anchors_in_place(H, R, D, opts, prompt, steps, monkeypatch):
    """CacheGen's decode steps read its codes once in KVQuant's CPU kernel (uniform levels at the layer's width, each
    group's 8-bit anchor in its first row and added to the deltas of the others): each step equals float64 attention
    over the rows the cache stores, with sink logits every other step."""
    c = _variant("cachegen", CacheGenKVCache, D, CacheGenOptions(**opts))
    calls = _kernel_steps(c, CacheGenKVCache, H, R, D, prompt, steps, prompt + R, monkeypatch)
    assert len(calls) == steps and "cachegen_cpu" in _common._checked


@KERNELS
def test_kvquant_cpu_kernel_refuses_codes_that_do_not_fit():
    """``kvquant_decode`` names what does not fit: widths outside 2-4 bits, groups that are not whole words, outlier
    buffers short of the groups attended; a cache whose codes the kernel cannot read keeps its op path."""
    c = _kvquant(64, "rope")
    _feed(c, 2, 2, 64, 200, np.random.default_rng(0))
    q = mx.zeros((1, 2, 2, 64))
    keys = [c.k_codes, c.k_scales, c.k_biases, c.k_levels, c.k_fit, c.k_oidx, c.k_oval]
    values = [c.v_codes, c.v_scales, c.v_biases, c.v_oidx, c.v_oval]
    rope = list(rope_tables(c.rope, 64))
    ok = dict(n=192, bits=3, group=32, value_group=32, key_outliers=c._n_out(64), value_outliers=c._n_out(64),
              rotate=True)
    m, _, _ = native.module().kvquant_decode(q, keys, values, c.sink_k, c.sink_v, rope, **ok)
    assert m.shape == (1, 2, 2)
    for bad, what in (({"bits": 5}, "2-4-bit codes"), ({"group": 16}, "groups of 32k"),
                      ({"key_outliers": 100}, "outliers"), ({"value_group": 8}, "value rows")):
        with pytest.raises(ValueError, match=f"kvquant_decode: .*{what}"):
            native.module().kvquant_decode(q, keys, values, c.sink_k, c.sink_v, rope, **{**ok, **bad})
    c = _variant("cachegen", CacheGenKVCache, 64, CacheGenOptions())
    _feed(c, 2, 2, 64, 200, np.random.default_rng(0))
    none = [mx.zeros((1, 2, 0), mx.uint16), mx.zeros((1, 2, 0), mx.float16)]
    uniform = [c.k_codes, c.k_scales, c.k_biases, mx.zeros((1, 2, 64, 0), mx.float16), mx.zeros((0,), mx.int32), *none]
    anchors = [getattr(c, f"{s}a_{a}") for s in "kv" for a in ("codes", "scales", "biases")]
    args = (q, uniform, [c.v_codes, c.v_scales, c.v_biases, *none], mx.zeros((1, 2, 0, 64), mx.float16),
            mx.zeros((1, 2, 0, 64), mx.float16), rope)
    cg = dict(n=192, bits=4, group=32, value_group=32, key_outliers=0, value_outliers=0, rotate=False)
    assert native.module().kvquant_decode(*args, **cg, anchors=anchors)[0].shape == (1, 2, 2)
    for bad, what in (({"bits": 7}, "2-6- or 8-bit uniform"), ({"rotate": True}, "no RoPE"),
                      ({"anchors": anchors[:3] + [anchors[3][..., :8]] + anchors[4:]}, "anchors"),
                      ({"anchors": [a[:, :, :2] for a in anchors]}, "anchors")):
        with pytest.raises(ValueError, match=f"kvquant_decode: .*{what}"):
            native.module().kvquant_decode(*args, **{**cg, "anchors": anchors, **bad})
    assert not _kvquant(64, bits=5)._cpu_codes_fit(64, 64, 2)  # 5 bits: the op path
    assert not _kvquant(64, group_size=16)._cpu_codes_fit(64, 64, 2)


@KERNELS
@pytest.mark.parametrize("bits,G,n", [((16, 8, 4, 3, 3, 1, 1), 32, 4096), ((16, 16, 6, 5, 2), 16, 1008),
                                      ((7, 7, 7), 8, 64), ((4, 2), 64, 0)])
def test_cpu_kernel_partials_over_latents_equal_float64_sums(bits, G, n):
    """``latent_decode``'s partials (m, l, acc) over latents coded by ``lowrank_fit.encode_latents`` -- float16
    channels, runs of 1-8-bit codes, groups of 8-64 tokens -- equal float64 sums over ``decode_latents_t``'s decoding
    of the same codes, with a score bias per query row; n = 0 gives the empty partials."""
    rng = np.random.default_rng(len(bits) * 7 + G)
    B, Hg, R, cap = 1, 2, 5, max(n, G)
    lay = lr.LatentLayout(bits, G)
    z = mx.array(rng.normal(size=(B, Hg, cap, len(bits))).astype(np.float32))
    z = z * mx.array([4.0] + [1.0] * (len(bits) - 1))
    codes, scales, biases, raw = lr.encode_latents(z, lay)
    q = _rows(rng, Hg, R, len(bits)).reshape(B, Hg, R, -1) * 0.5
    bias = mx.array(rng.normal(size=(B, Hg, R)), mx.float32)
    m, l, acc = native.module().latent_decode(q, bias, n, G, codes, scales, biases, raw, list(bits), codes, scales,
                                              biases, raw, v_bits=list(bits))  # noqa: E741
    if n == 0:
        assert np.isneginf(np.array(m)).all() and not np.array(l).any() and not np.array(acc).any()
        return
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    zt = f64(lr.decode_latents_t(codes, scales, biases, raw, n, lay))  # [B, Hg, r, n]
    s = np.einsum("bhrc,bhcn->bhrn", f64(q), zt) + f64(bias)[..., None]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    tol = 8 * len(bits) * float(np.finfo(np.float32).eps) * np.einsum("bhrc,bhcn->bhrn", np.abs(f64(q)),
                                                                       np.abs(zt)).max() + 1e-6
    np.testing.assert_allclose(np.array(m), s.max(axis=-1), rtol=0, atol=tol)
    assert _rel(l, p.sum(axis=-1)) < tol and _rel(acc, np.einsum("bhrn,bhcn->bhrc", p, zt)) < tol, tol


@KERNELS
def test_latent_kernel_refuses_latents_that_do_not_fit():
    """Widths, groups, shapes and value rows that do not fit each other are refused when the call is made, naming
    what."""
    lay = lr.LatentLayout((8, 4, 2), 32)
    codes, scales, biases, _ = lr.encode_latents(mx.ones((1, 2, 64, 3)), lay)
    q, f = mx.zeros((1, 2, 3, 3)), native.module().latent_decode
    k = (codes, scales, biases, None)
    with pytest.raises(ValueError, match="bits: 1..256 non-increasing"):
        f(q, None, 64, 32, *k, [2, 4, 8], *k, v_bits=[8, 4, 2])
    with pytest.raises(ValueError, match="group: a divisor of 64"):
        f(q, None, 48, 48, *k, [8, 4, 2], *k, v_bits=[8, 4, 2])
    with pytest.raises(ValueError, match="keys: codes"):
        f(q, None, 96, 32, *k, [8, 4, 2], *k, v_bits=[8, 4, 2])  # more rows than the buffers hold
    c2, s2, b2, raw = lr.encode_latents(mx.ones((1, 2, 64, 3)), lr.LatentLayout((16, 4, 2), 32))
    with pytest.raises(ValueError, match="raw"):  # a float16 width without its rows
        f(q, None, 64, 32, c2, s2, b2, None, [16, 4, 2], *k, v_bits=[8, 4, 2])
    f(q, None, 64, 32, c2, s2, b2, raw, [16, 4, 2], *k, v_bits=[8, 4, 2])
    with pytest.raises(ValueError, match="bias"):
        f(q, mx.zeros((1, 2, 4)), 64, 32, *k, [8, 4, 2], *k, v_bits=[8, 4, 2])
    with pytest.raises(ValueError, match="value rows"):
        f(q, None, 64, 32, *k, [8, 4, 2], codes, scales, biases, None, v_row_bits=3, v_row_group=32, dv=64)
    with pytest.raises(ValueError, match="rows: one width"):  # keys as rows take one width
        f(q, None, 64, 1, *k, [8, 4, 2], *k, v_bits=[8, 4, 2], k_rows_per_group=4)
    with pytest.raises(ValueError, match="group-major ranges are for keys as rows"):
        f(q, None, 64, 32, *k, [8, 4, 2], *k, v_bits=[8, 4, 2], k_group_major=True)
    with pytest.raises(ValueError, match="v_scale_rows: for value rows"):
        f(q, None, 64, 32, *k, [8, 4, 2], *k, v_bits=[8, 4, 2], v_scale_rows=[1, 2, 0])
    vc, vs = mx.zeros((1, 2, 64, 6), mx.uint32), mx.zeros((1, 2, 64, 2), mx.float16)  # 3-bit rows, dv 64
    rows = dict(v_row_bits=3, v_row_group=32, dv=64)
    f(q, None, 64, 32, *k, [8, 4, 2], vc, vs, vs, None, **rows)
    with pytest.raises(ValueError, match=r"v_scale_rows: \(per, stride, first\)"):
        f(q, None, 64, 32, *k, [8, 4, 2], vc, vs, vs, None, **rows, v_scale_rows=[4, 8, 5])
    with pytest.raises(ValueError, match="value rows: scales for every row"):  # row 63 reads scale row 127
        f(q, None, 64, 32, *k, [8, 4, 2], vc, vs, vs, None, **rows, v_scale_rows=[4, 8, 0])
    m, l, acc = f(q, None, 64, 32, *k, [8, 4, 2], *k, v_bits=[8, 4, 2])  # noqa: E741
    assert acc.shape == (1, 2, 3, 3)


def _codes_of(words, bits, n_sub):
    return np.array(unpack_bits(words, bits, n_sub))


@KERNELS
@pytest.mark.parametrize("D,sub,bits", [(64, 4, 12), (64, 8, 8), (32, 2, 6), (32, 4, 14), (16, 4, 4)])
def test_rvq_cpu_encoder_gives_the_op_paths_codes(D, sub, bits):
    """The CPU encoder's words and norms equal the op path's (``RVQCodebook.encode``, the norms, ``pack_bits``) for
    one- and two-stage codebooks, codes of 4-8 bits (6-bit codes straddling words), pieces of 2-8 coordinates: the
    same beam search, so a code may differ only at a rounding tie, where both choices are equally near."""
    qz = tq._quantizer(D, sub, bits, 0, None)
    x = mx.array(np.random.default_rng(bits).normal(size=(2, 3, 301, D)).astype(np.float32) * 3)
    got, want = tq._cpu_encode(qz.cb, x @ qz.rot_t), qz._encoded(x)
    assert (got[1] is None) == (want[1] is None) and got[0].shape == want[0].shape
    for g, w, b in zip(got[:2], want[:2], (qz.cb.bits1, qz.cb.bits2)):
        if w is not None:
            assert g.dtype == mx.uint32 and (_codes_of(g, b, qz.cb.n_sub) != _codes_of(w, b, qz.cb.n_sub)).mean() < 1e-3
    assert got[2].dtype == mx.float16
    np.testing.assert_allclose(np.array(got[2], np.float32), np.array(want[2], np.float32), rtol=1e-3)


@KERNELS
def test_rvq_cache_encodes_through_the_cpu_kernel_and_stores_the_op_paths_codes(monkeypatch):
    """A prompt and the decode steps' compactions go through the CPU encoder (checked once against the op path) and
    the cache stores what the op path would: the same codes and norms as a cache with the kernels off."""
    calls, real = [], tq._cpu_encode
    monkeypatch.setattr(tq, "_cpu_encode", lambda cb, z: calls.append(z.shape[2]) or real(cb, z))
    caches = [_rvq(64, residual_length=16), _rvq(64, residual_length=16)]
    rng = np.random.default_rng(7)
    rows = [(_rows(rng, 2, n, 64), _rows(rng, 2, n, 64)) for n in (500, *[1] * 40)]
    for c, on in zip(caches, (True, False)):
        monkeypatch.setattr(native, "_ENV_ON", on)
        for k, v in rows:
            c.update_and_fetch(k, v)
    assert calls and calls[0] >= 400 and 32 in calls and "turboquant_rvq_encode_cpu" in _common._checked
    a, b = caches
    assert a.n_quant == b.n_quant > 500
    for name in ("k_codes1", "k_codes2", "v_codes1"):
        same = np.array(getattr(a, name)[:, :, : a.n_quant]) == np.array(getattr(b, name)[:, :, : b.n_quant])
        assert same.mean() > 0.999, name
    np.testing.assert_allclose(np.array(a.k_norms[:, :, : a.n_quant], np.float32),
                               np.array(b.k_norms[:, :, : b.n_quant], np.float32), rtol=1e-3)


@KERNELS
def test_rvq_cpu_encoder_rejects_codebooks_that_do_not_fit():
    """A piece size that does not divide the row's dim, a codebook that is not a power of two or a stage-2 codebook
    of another piece size are refused when the call is made."""
    qz = tq._quantizer(64, 4, 12, 0, None)
    f, cb = native.module().turboquant_rvq_encode, qz.cb
    with pytest.raises(ValueError, match="piece size must divide"):
        f(mx.zeros((3, 62)), cb.c1, cb.sigma, cb.c2, 4)
    with pytest.raises(ValueError, match="stage-1 codebook size"):
        f(mx.zeros((3, 64)), cb.c1[:200], cb.sigma[:200], cb.c2, 4)
    with pytest.raises(ValueError, match="stage-2 codebook"):
        f(mx.zeros((3, 64)), cb.c1, cb.sigma, mx.zeros((16, 2)), 4)


@KERNELS
def test_rvq_cpu_encoder_waits_for_a_prompts_codes_not_a_compactions(monkeypatch):
    """The mechanism behind the peak test below, without its allocator timing: the CPU encoder's codes for a prompt
    (more than a block of rows) are waited for inside ``encode``, those of a decode step's 32-row compaction are not."""
    from veloxquant_mlx.cache.primitives import blocks

    D = 64
    c = _rvq(D)
    waited = []
    monkeypatch.setattr(blocks, "wait_for", lambda arrays: waited.append([a.shape for a in arrays]))
    rng = np.random.default_rng(2)
    kq = c._quantizers(D, D)[0]
    rows_of = lambda: [w[0][:3] for w in waited if w and len(w[0]) == 4]  # noqa: E731 (codes: [B, H, n, words])
    kq.encode(_rows(rng, 3, 200, D), owner=c)  # (the first use also runs its check: the op path's own waits)
    assert rows_of() == [(1, 3, 200)], waited
    kq.encode(_rows(rng, 3, 32, D), owner=c)
    assert rows_of() == [(1, 3, 200)], waited


@KERNELS
def test_rvq_cpu_encoder_leaves_no_layer_rows_to_the_chunks_end(monkeypatch):
    """A prompt chunk through 8 layers, evaluated at the chunk's end as mlx_lm does: with the CPU encoder the peak
    memory is no higher than the op path's (each layer's rows are coded before its attention is queued, not held
    in float32 to the chunk's end)."""
    H, R, D, n, layers = 3, 3, 64, 1024, 8
    rng = np.random.default_rng(5)
    data = [(_rows(rng, H, n, D), _rows(rng, H, n, D), _rows(rng, H * R, n, D)) for _ in range(layers)]
    mx.eval(data)

    def peak(on: bool) -> int:
        monkeypatch.setattr(native, "_ENV_ON", on)
        caches = [_rvq(D) for _ in range(layers)]
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        outs = []
        for c, (k, v, q) in zip(caches, data):
            K, V = c.update_and_fetch(k, v)
            outs.append(dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal"))
        mx.eval(outs, [c.state for c in caches])
        return mx.get_peak_memory() - base

    peak(True), peak(False)  # codebooks, checks and the kernels' build out of the way
    # the lowest of five each, alternated: MLX's CPU stream releases a task's inputs when the task ends, so a loaded
    # machine (other test workers) can lift one chunk's peak by when, not what, it frees (session 47: this failed
    # once more beside a second worker); the slack is one layer's float32 rows in flight, the mechanism itself is
    # tested by test_rvq_cpu_encoder_waits_for_a_prompts_codes_not_a_compactions
    runs = [(peak(True), peak(False)) for _ in range(5)]
    on, off = min(r[0] for r in runs), min(r[1] for r in runs)
    assert on <= 1.05 * off + 2 * H * n * D * 4, runs


# ------------------------------------------------------------------------------ prefill softmax
def _masked_attention64(q, k, v, scale, mask, sinks=None):
    """float64 attention, q [B, Hq, N, D], k/v [B, H, M, D] (GQA), ``mask`` None / "causal" / a boolean array /
    an additive one (MLX's sdpa's meanings), ``sinks`` [Hq] logits or None."""
    q, k, v = (np.asarray(x.astype(mx.float32), np.float64) for x in (q, k, v))
    B, Hq, N, D = q.shape
    H, M = k.shape[1], k.shape[2]
    s = np.einsum("bhrnd,bhmd->bhrnm", q.reshape(B, H, Hq // H, N, D), k).reshape(B, Hq, N, M) * scale
    if isinstance(mask, str):
        s = np.where(np.arange(M)[None] <= np.arange(M - N, M)[:, None], s, -np.inf)
    elif mask is not None:
        m = np.asarray(mask)
        s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m.astype(np.float64)
    peak = s.max(axis=-1, keepdims=True)
    sk = None if sinks is None else np.asarray(sinks, np.float64).reshape(1, Hq, 1, 1)
    if sk is not None:
        peak = np.maximum(peak, sk)
    p = np.exp(s - peak)
    den = p.sum(axis=-1, keepdims=True) + (np.exp(sk - peak) if sk is not None else 0.0)
    out = np.einsum("bhrnm,bhmd->bhrnd", p.reshape(B, H, Hq // H, N, M), v).reshape(B, Hq, N, -1)
    return out / den


@KERNELS
@pytest.mark.parametrize("H,R,N,M,mask,with_sinks,dtype", [
    (3, 3, 200, 700, "causal", False, mx.float32), (3, 3, 200, 700, "causal", True, mx.float32),
    (2, 1, 37, 37, "causal", False, mx.float16), (1, 4, 129, 300, None, True, mx.float32),
    (2, 2, 64, 181, "bool", False, mx.float32), (2, 3, 50, 90, "additive", True, mx.bfloat16)])
def test_cpu_attention_equals_float64_attention(H, R, N, M, mask, with_sinks, dtype):
    """``attention.cpu_attention`` (the products by BLAS, the softmax by ``softmax_rows``) is MLX's sdpa's function:
    float64 attention under each mask mlx_lm passes (a causal string, a boolean array, an additive one with finite
    biases and -inf), sink logits, GQA, 16-bit inputs (the output in their dtype)."""
    from veloxquant_mlx.cache.attention import cpu_attention

    rng = np.random.default_rng(N + M)
    D, B = 64, 1
    q, k, v = (mx.array(rng.normal(size=(B, h, n, D)).astype(np.float32)).astype(dtype)
               for h, n in ((H * R, N), (H, M), (H, M)))
    if mask == "bool":
        mask = mx.array(rng.random((N, M)) > 0.4) | (mx.arange(M)[None] == 0)  # every row sees a key
    elif mask == "additive":
        bias = rng.normal(size=(B, H * R, N, M)).astype(np.float32)
        mask = mx.array(np.where(rng.random((B, H * R, N, M)) > 0.3, bias, -np.inf).astype(np.float32))
        mask[..., 0] = 0.0
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    out = cpu_attention(q, k, v, scale=D**-0.5, mask=mask, sinks=sinks)
    assert out.shape == (B, H * R, N, D) and out.dtype == dtype
    want = _masked_attention64(q, k, v, D**-0.5, mask, sinks)
    tol = TOL_SOFTMAX if dtype == mx.float32 else 1e-2  # 16-bit: the output's own rounding
    assert _rel(out.astype(mx.float32), want) < tol


TOL_SOFTMAX = 1e-5  # float32 sums of a few hundred terms and the exponential's ~1e-7 relative error


@KERNELS
def test_softmax_rows_masks_sinks_and_leaves_held_scores_unchanged():
    """``softmax_rows``: row i of N sees columns up to ``offset + i`` (later ones and -inf scores exactly 0), a
    row that sees nothing is all zeros, sinks join the normalizer (rows then sum to less than 1); scores that
    Python still holds are not written over (the primitive writes in place only into a buffer MLX can donate);
    bad inputs are refused with the field named."""
    f = native.module().softmax_rows
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 3, 4, 40)).astype(np.float32) * 4
    x[0, 0, 1, 5] = -np.inf
    x[1, 2, 3] = -np.inf  # a row that sees nothing
    s = mx.array(x)
    y = np.asarray(f(s, 36, None, 3))
    assert np.array_equal(np.asarray(s), x)  # held by Python: not donated
    for i in range(4):
        valid = 36 + i + 1
        with np.errstate(invalid="ignore"):  # the row that sees nothing: nan here, zeros from the kernel
            want = np.exp(x[..., i, :valid].astype(np.float64) - x[..., i, :valid].max(-1, keepdims=True))
            want /= want.sum(-1, keepdims=True)
        seen = np.isfinite(want)
        assert np.allclose(y[..., i, :valid][seen], want[seen], rtol=TOL_SOFTMAX, atol=1e-7)
        assert np.all(y[..., i, valid:] == 0)
    assert y[0, 0, 1, 5] == 0 and np.all(y[1, 2, 3] == 0)
    sk = rng.normal(size=3).astype(np.float32)
    ys = np.asarray(f(s, -1, mx.array(sk), 3)).astype(np.float64)
    xs = x.astype(np.float64)
    peak = np.maximum(xs.max(-1, keepdims=True), sk[None, :, None, None])
    e = np.exp(xs - peak)
    want = e / (e.sum(-1, keepdims=True) + np.exp(sk[None, :, None, None] - peak))
    assert np.allclose(ys, want, rtol=TOL_SOFTMAX, atol=1e-7) and np.all(ys.sum(-1) < 1)
    with pytest.raises(ValueError, match="float32"):
        f(s.astype(mx.float16), -1, None, 3)
    with pytest.raises(ValueError, match="sinks"):
        f(s, -1, mx.zeros((4,)), 3)
    with pytest.raises(ValueError, match="heads"):
        f(s, -1, None, 4)


@KERNELS
def test_dense_attention_tiles_take_the_native_softmax_on_the_cpu(monkeypatch):
    """A long call's CPU tiles go through ``cpu_attention`` and give float64 attention over the call's rows."""
    from veloxquant_mlx.cache import attention

    calls = []
    real = attention.cpu_attention
    monkeypatch.setattr(attention, "cpu_attention", lambda *a, **k: calls.append(a[0].shape[2]) or real(*a, **k))
    rng = np.random.default_rng(9)
    N, M, D = 300, 1000, 64
    q, k, v = (mx.array(rng.normal(size=(1, h, n, D)).astype(np.float32)) for h, n in ((6, N), (2, M), (2, M)))
    out = attention.dense_attention(q, k, v, scale=D**-0.5, mask="causal")
    assert sum(calls) == N and len(calls) >= 2
    assert _rel(out, _masked_attention64(q, k, v, D**-0.5, "causal")) < TOL_SOFTMAX


@KERNELS
def test_cpu_attention_refuses_a_causal_mask_with_fewer_keys_than_queries():
    """The kernel reads a negative causal offset as no mask: such a call is refused, naming the mask and sizes."""
    from veloxquant_mlx.cache.attention import cpu_attention

    q, k = mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 5, 16))
    with pytest.raises(ValueError, match="'causal' over 8 query rows and 5 keys"):
        cpu_attention(q, k, k, scale=0.25, mask="causal")
    with pytest.raises(ValueError, match="'sliding'"):
        cpu_attention(q, q, q, scale=0.25, mask="sliding")
