"""``kernels.observed_decode``: an observing eviction cache's decode step (output and float32 probabilities) in one
CUDA launch over the held buffers; ``kernels.drop_row``: the one-row drop of TOVA / MorphKV in one launch. The op
path (``attention_with_weights`` over the held rows) is the reference:
same output and probabilities to float32-summation tolerance on GQA ratios, odd row counts, buffers with spare rows
and every float dtype; a decode of H2O and TOVA through the kernel keeps what the op path keeps. Runs where the
kernels do (MLX's CUDA backend); elsewhere the step takes the op path, which the eviction tests cover, but for the
one-row drop, which the CPU kernels do too (``native/drop_row_cpu.cpp``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from contract_table import layer_call
from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch, native
from veloxquant_mlx.cache.attention import attention_with_weights
from veloxquant_mlx.cache.kernels import _common, kernels_enabled
from veloxquant_mlx.cache.kernels import drop_row, observed_decode

GPU = pytest.mark.skipif(not kernels_enabled(), reason="the decode kernels need MLX's CUDA backend (none here)")
CPU_KERNELS = pytest.mark.skipif(not native.available(), reason="the CPU kernels (the cpu extra) are not built here")


def test_the_kernel_is_off_where_the_decode_kernels_are():
    """Off the CUDA backend ``supported`` is False, so the caches keep the op path; on it, one query row only."""
    q, k = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 40, 64))
    assert observed_decode.supported(q, k, k, 33) == kernels_enabled()
    assert not observed_decode.supported(mx.zeros((1, 4, 2, 64)), k, k, 33)
    assert not observed_decode.supported(q, k, k, 41)  # more rows than the buffer holds
    wide = mx.zeros((1, 64, 1, 64))  # 32 query heads x 64 channels a group: over MAX_GROUP_CHANNELS (1024)
    assert not observed_decode.supported(wide, k, k, 33)
    pos = mx.zeros((1, 2, 40), mx.int32)
    assert drop_row.supported(k, k, pos, 33) == (kernels_enabled() or native.available())  # CUDA's, or the CPU's
    assert not drop_row.supported(k, k, pos.astype(mx.float32), 33)


@GPU
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("B,H,rep,D,DV,rows,cap", [(1, 3, 3, 64, 64, 577, 640), (2, 8, 4, 128, 128, 1, 9),
                                                  (1, 2, 1, 32, 48, 33, 33), (1, 4, 5, 96, 64, 1000, 1100),
                                                  (1, 8, 4, 128, 128, 640, 704)])
def test_kernel_equals_the_op_path(dtype, B, H, rep, D, DV, rows, cap):
    key = mx.random.key(rows + D)
    q = mx.random.normal((B, H * rep, 1, D), key=key).astype(dtype)
    k = (2 * mx.random.normal((B, H, cap, D), key=mx.random.key(1))).astype(dtype)
    v = mx.random.normal((B, H, cap, DV), key=mx.random.key(2)).astype(dtype)
    assert observed_decode.supported(q, k, v, rows)
    out, w = observed_decode._launch(q, k, v, rows, D**-0.5)
    want_out, want_w = attention_with_weights(q, k[:, :, :rows], v[:, :, :rows], scale=D**-0.5, mask=None)
    assert out.shape == (B, H * rep, 1, DV) and out.dtype == dtype and w.shape == (B, H, rep, 1, rows)
    assert np.allclose(np.array(w), np.array(want_w), atol=1e-5, rtol=1e-4)
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}[dtype]  # the output's rounding
    assert np.allclose(np.array(out.astype(mx.float32)), np.array(want_out.astype(mx.float32)), atol=tol * 4)


@pytest.mark.parametrize("impl", [pytest.param("cuda", marks=GPU), pytest.param("cpu", marks=CPU_KERNELS)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_drop_row_kernel_equals_the_op_path(dtype, impl):
    """Each head drops its least unprotected row (ties to the lowest; protected: sinks and the recent window by
    position), the rest shift down in order, the spare rows repeat the last; as the op path's argmin and gathers --
    the CUDA launch and the CPU kernel (``native/drop_row_cpu.cpp``) alike."""
    B, H, cap, D, rows, spare, n_sink, start = 2, 3, 70, 64, 65, 4, 2, 60
    k = mx.random.normal((B, H, cap, D), key=mx.random.key(3)).astype(dtype)
    v = mx.random.normal((B, H, cap, 32), key=mx.random.key(4)).astype(dtype)
    pos = mx.broadcast_to(mx.arange(cap, dtype=mx.int32) * 2 % 71, (B, H, cap))  # out of order, some protected
    s = mx.round(mx.random.uniform(shape=(B, H, rows), key=mx.random.key(5)) * 8)  # ties
    s = mx.where(pos[:, :, :rows] < n_sink, -1.0, s)  # a protected row scores least: never the one dropped
    launch = drop_row._launch if impl == "cuda" else native.module().drop_row
    ok, ov, opos = launch(k, v, pos, s, rows, spare, n_sink, start)
    p = pos[:, :, :rows]
    guarded = mx.where((p < n_sink) | (p >= start), mx.inf, s)
    j = np.array(mx.argmin(guarded, axis=-1))
    for b in range(B):
        for h in range(H):
            src = [i + (i >= j[b, h]) for i in range(rows - 1)] + [rows - 1] * spare
            assert np.array_equal(np.array(opos[b, h]), np.array(pos[b, h])[src])
            assert np.array_equal(np.array(ok[b, h].astype(mx.float32)), np.array(k[b, h].astype(mx.float32))[src])
            assert np.array_equal(np.array(ov[b, h].astype(mx.float32)), np.array(v[b, h].astype(mx.float32))[src])


def prompt_then_steps(method: str, prompt: int, steps: int, D: int, seed: int):
    """A fresh ``method`` cache (float32, the dispatch point installed) after a ``prompt``-row call over its budget
    and ``steps`` decode steps of one layer (6 query heads, 2 KV heads); with each call's last output row, stacked."""
    dispatch.install()
    B, HQ, H = 1, 6, 2
    c = KVCacheFactory.create(KVCacheConfig(method=method, dtype=mx.float32))
    mx.random.seed(seed)
    outs = []
    for n in [prompt] + [1] * steps:
        q, k, v = (mx.random.normal((B, h, n, D)) for h in (HQ, H, H))
        outs.append(layer_call(c, q * 2, k, v)[:, :, -1])
        mx.eval(outs[-1], c.state)
    return c, mx.stack(outs)


@GPU
@pytest.mark.parametrize("method", ["h2o", "tova", "pyramidkv", "morphkv"])
def test_a_decode_through_the_kernel_keeps_what_the_op_path_keeps(method, monkeypatch):
    """40 decode steps of a cache over budget, with and without the kernels: the same rows kept, the same output."""
    D = 64
    real, real_drop = observed_decode.supported, drop_row.supported

    def run(kernel):
        monkeypatch.setattr(observed_decode, "supported", lambda *a: kernel and real(*a))
        monkeypatch.setattr(drop_row, "supported", lambda *a: kernel and real_drop(*a))
        return prompt_then_steps(method, 700, 40, D, seed=11)

    assert "observed_decode" not in _common._disabled
    op, out_op = run(False)
    ker, out_ker = run(True)
    assert "observed_decode" in _common._checked or method == "morphkv"
    assert "drop_row" in _common._checked or method not in ("tova", "morphkv")
    n = op.size()
    assert ker.size() == n
    assert np.array_equal(np.array(ker.positions[:, :, :n]), np.array(op.positions[:, :, :n]))
    assert np.allclose(np.array(out_ker), np.array(out_op), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["tova", "morphkv"])
def test_the_one_launch_drop_path_keeps_what_the_gathers_keep(method, monkeypatch):
    """Off CUDA too: ``_drop_one_row`` with ``drop_row`` answering by its reference (``op_fn``, what the kernel is
    checked against and falls back to) keeps each step the rows the regular one-row drop keeps, in order."""
    D = 32
    real, calls = drop_row.supported, []

    def run(one_launch):
        monkeypatch.setattr(drop_row, "supported", lambda *a: one_launch)
        monkeypatch.setattr(drop_row, "drop", lambda *a: calls.append(a[4]) or a[-1]())  # (a[4]: the rows held)
        return prompt_then_steps(method, 600, 12, D, seed=12)

    regular, out_regular = run(False)
    assert not calls
    one, out_one = run(True)
    assert calls == [one.budget + 1] * 12  # every decode step dropped its one row through drop_row
    monkeypatch.setattr(drop_row, "supported", real)
    n = regular.size()
    assert one.size() == n and n == regular.budget
    assert np.array_equal(np.array(one.positions[:, :, :n]), np.array(regular.positions[:, :, :n]))
    assert np.array_equal(np.array(one.keys[:, :, :n]), np.array(regular.keys[:, :, :n]))
    assert np.array_equal(np.array(out_one), np.array(out_regular))


@CPU_KERNELS
@pytest.mark.parametrize("method", ["tova", "morphkv"])
def test_a_decode_through_the_cpu_drop_keeps_what_the_op_path_keeps(method, monkeypatch):
    """40 decode steps of a cache over budget on the CPU, the one-row drop by the CPU kernel (checked once against
    the op path) and by the op path's gathers: the same rows kept, in order, and the same outputs."""
    real = drop_row.supported

    def run(kernel):
        monkeypatch.setattr(drop_row, "supported", lambda *a: kernel and real(*a))
        return prompt_then_steps(method, 700, 40, 64, seed=13)

    op, out_op = run(False)
    ker, out_ker = run(True)
    assert "drop_row_cpu" in _common._checked and "drop_row_cpu" not in _common._disabled
    n = op.size()
    assert ker.size() == n
    assert np.array_equal(np.array(ker.positions[:, :, :n]), np.array(op.positions[:, :, :n]))
    assert np.array_equal(np.array(ker.keys[:, :, :n]), np.array(op.keys[:, :, :n]))
    assert np.array_equal(np.array(out_ker), np.array(out_op))


@CPU_KERNELS
def test_the_cpu_drop_refuses_what_does_not_fit():
    """Buffers that disagree, integer rows, fewer than two rows or scores short of them are refused, naming
    ``drop_row``."""
    k, pos, s = mx.zeros((1, 2, 40, 64)), mx.zeros((1, 2, 40), mx.int32), mx.zeros((1, 2, 33))
    f = native.module().drop_row
    assert f(k, k, pos, s, 33, 3, 4, 30)[0].shape == (1, 2, 35, 64)
    for args in ((k, k[:, :, :39], pos, s, 33), (k, k, pos.astype(mx.float32), s, 33), (k.astype(mx.int32),) * 2
                 + (pos, s, 33), (k, k, pos, s, 1), (k, k, pos, s, 34), (k, k, pos, s[:, :, :20], 33)):
        with pytest.raises(ValueError, match="drop_row"):
            f(*args, 3, 4, 30)
