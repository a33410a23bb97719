"""Could ``mx.compile`` take a KIVI decode layer's host cost down to the plain cache's? One layer's call timed five ways
on MLX's CUDA backend (build: graph building per call; queue: ``mx.async_eval`` of a block of calls, per call):
mlx_lm's plain cache (``update_and_fetch`` + fused attention), KIVI as the cache makes the call, KIVI's kernel alone
with the arguments the cache passed (recorded), and the same step's work -- the new row written into the residual at
a position held in an array, then the fused decode kernel with the arguments the cache passed (recorded) -- as a
plain Python function and inside ``mx.compile``. The recorded call's counts are frozen, so the compiled outputs are
not a decode step's (host time only; a real compiled step would read its counts from an array).

    python scripts/compiled_step_host.py --context 8192 --calls 32 --blocks 60 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, dispatch, grouped  # noqa: E402
from veloxquant_mlx.cache.factory import KVCacheFactory  # noqa: E402
from veloxquant_mlx.cache.kernels import _common  # noqa: E402


def timed(fn, calls: int, blocks: int) -> tuple[float, float]:
    """Median over blocks of the microseconds per call to build ``calls`` calls of ``fn`` and to queue them."""
    build, queue = [], []
    for _ in range(blocks):
        gc.disable()
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        gc.enable()
        mx.eval(outs)
        build.append((t1 - t0) / calls * 1e6)
        queue.append((t2 - t1) / calls * 1e6)
    return statistics.median(build), statistics.median(queue)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    B, Hq, H, D, dt = 1, 32, 8, 128, mx.bfloat16
    mx.random.seed(0)
    q, k, v = (mx.random.normal((B, n, 1, D)).astype(dt) for n in (Hq, H, H))
    past = [mx.random.normal((B, H, a.context, D)).astype(dt) for _ in range(2)]
    dispatch.install()
    scale = D ** -0.5

    plain = KVCache()
    plain.update_and_fetch(*past)
    kivi = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=4))
    kivi.update_and_fetch(*past)
    mx.eval(plain.state, kivi.state)

    recorded = []
    real = grouped.kivi_kernel.kivi_partials

    def record(*args, **kw):
        recorded.append((args, kw))
        return real(*args, **kw)

    grouped.kivi_kernel.kivi_partials = record
    mx.eval(dispatch.dispatched_sdpa(q, *kivi.update_and_fetch(k, v), kivi, scale, None))
    mx.eval(dispatch.dispatched_sdpa(q, *kivi.update_and_fetch(k, v), kivi, scale, None))
    grouped.kivi_kernel.kivi_partials = real
    if not recorded:
        sys.exit("the KIVI cache did not call its decode kernel (not CUDA, or the kernels are off)")
    args, kw = recorded[-1]
    (_, _, kc, ks, kb, vc, vs, vb, n, bits, group, vgroup, exact) = args
    res_k, res_v, e0 = exact[0], exact[1], int(exact[2])
    merge = kw["merge"]
    pos = mx.array([e0], mx.int32)

    def step(q, nk, nv, rk, rv, pos, kc, ks, kb, vc, vs, vb, counters):
        rk2 = mx.slice_update(rk, nk, pos, axes=(2,))
        rv2 = mx.slice_update(rv, nv, pos, axes=(2,))
        owner = SimpleNamespace(_kernel_counters=counters)  # the launch's counters (its chained view is dropped)
        out = real(q, scale, kc, ks, kb, vc, vs, vb, n, bits, group, vgroup, (rk, rv, e0, rk, rv, 0, nk, nv),
                   merge=_common.Merge(merge.sinks, False, merge.out_dtype, owner))
        return out, rk2, rv2

    compiled = mx.compile(step)
    inputs = (q, k, v, res_k, res_v, pos, kc, ks, kb, vc, vs, vb, _common.step_counters(kivi, 1))
    want = step(*inputs)[0]
    got = compiled(*inputs)[0]
    err = (mx.linalg.norm((got - want).astype(mx.float32)) / mx.linalg.norm(want.astype(mx.float32))).item()
    print(f"{mx.default_device()} MLX {mx.__version__}, T={a.context}: compiled vs uncompiled step, relative L2 "
          f"{err:.2e}", flush=True)

    def plain_call():
        keys, values = plain.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)

    variants = {
        "plain cache (update + sdpa)": plain_call,
        "kivi cache (update + dispatched attention)":
            lambda: dispatch.dispatched_sdpa(q, *kivi.update_and_fetch(k, v), kivi, scale, None),
        "kivi kernel alone, recorded arguments": lambda: real(*args, **kw),
        "kivi step function (2 row writes + kernel)": lambda: step(*inputs),
        "kivi step function, mx.compile": lambda: compiled(*inputs),
    }
    for r in range(a.rounds):
        for name, fn in variants.items():
            b, qu = timed(fn, a.calls, a.blocks)
            print(f"round {r} {name:46s} build {b:6.1f} us  queue {qu:6.1f} us  per layer call", flush=True)


if __name__ == "__main__":
    main()
