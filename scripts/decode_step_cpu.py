"""Time single-query decode steps of waterfill, KIVI, TurboQuant-RVQ and SnapKV through mlx_lm's dispatch point (store +
attention, one layer, evaluated every step) at a SmolLM2-like shape, next to mlx_lm's plain KVCache
with MLX's fused attention. For before/after comparisons of the decode path where a full
``veloxquant bench`` is too slow (a shared CPU); only public API, so it runs on older versions too.

    python scripts/decode_step_cpu.py --context 4096 --steps 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()  # before mlx: the wheel's own BLAS makes the plain cache's matmuls several times slower

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, WaterfillOptions  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--rep", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--method", action="append", default=[],
                    help="another method at its defaults (repeatable); with any, only the plain cache and these")
    a = ap.parse_args(argv)
    H, R, D, T = a.heads, a.rep, a.dim, a.context
    dispatch.install()
    dt = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    key = mx.random.key(0)
    k = mx.random.normal((1, H, T + a.steps, D), key=key).astype(dt)
    v = mx.random.normal((1, H, T + a.steps, D), key=mx.random.key(1)).astype(dt)
    q = mx.random.normal((1, H * R, T + a.steps, D), key=mx.random.key(2)).astype(dt)
    mx.eval(k, v, q)
    caches = {"plain (mlx_lm KVCache)": KVCache()}
    wf = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=4, head_dim=D,
                                             options=WaterfillOptions(residual_length=16)))
    wf.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
    caches["waterfill-4"] = wf
    caches["kivi-4"] = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=4, head_dim=D,
                                                           options=KIVIOptions(group_size=32)))
    caches["turboquant_rvq"] = KVCacheFactory.create(KVCacheConfig(method="turboquant_rvq", head_dim=D))
    caches["snapkv"] = KVCacheFactory.create(KVCacheConfig(method="snapkv", head_dim=D))
    if a.method:
        caches = {"plain (mlx_lm KVCache)": KVCache()}
        caches.update({m: KVCacheFactory.create(KVCacheConfig(method=m, head_dim=D)) for m in a.method})
    print(f"device {mx.default_device()}, context {T}, H={H}, rep={R}, D={D}, {a.steps} steps", flush=True)
    for name, c in caches.items():
        for s in range(0, T, 512):  # prefill in chunks through the dispatch point
            e = min(T, s + 512)
            K, V = c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
            mx.eval(dispatch.dispatched_sdpa(q[:, :, s:e], K, V, cache=c, scale=D**-0.5, mask="causal"))
        del K, V
        times = []
        for i in range(T, T + a.steps):
            t0 = time.perf_counter()
            K, V = c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            out = dispatch.dispatched_sdpa(q[:, :, i : i + 1], K, V, cache=c, scale=D**-0.5, mask=None)
            del K, V  # as in the model: a reference held into the next step makes the plain cache copy its buffer
            mx.eval(out)
            times.append(time.perf_counter() - t0)
        print(f"{name:24s} decode step median {statistics.median(times) * 1e3:7.3f} ms "
              f"(min {min(times) * 1e3:.3f})", flush=True)


if __name__ == "__main__":
    main()
