"""One layer's CPU decode step with the long-step stream split on and off, interleaved in one process: each method's
cache is filled once (through the dispatch point, in chunks of 512), then each round decodes a burst of steps with
``attention.CPU_STREAMS = 1`` and with 2 (the op path: ``cache.native``'s kernels off), and, where a method has a CPU
kernel and it is built, with the kernel, trimming back after each burst (SmolLM2's attention shape, float32).

    python scripts/cpu_streams_ab.py --context 4096 --rounds 4 --method waterfill --method gear

Medians of each burst's median step, ms; the plain cache (mlx_lm's ``KVCache``, MLX's fused attention) beside them.
``--min-rows`` sets both split thresholds (``CPU_SPLIT_MIN_ROWS``, ``CPU_SPLIT_DECODE_MIN_ROWS``) for the split runs.
Run it with ``OPENBLAS_THREAD_TIMEOUT=4``: OpenBLAS's worker otherwise spins ~0.1 s after each call on the core the
second stream wants, and a layer's step moves between two levels from burst to burst (docs/RESULTS.md, session 42).
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

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, attention, dispatch, native  # noqa: E402
from veloxquant_mlx.cache.options import WaterfillOptions  # noqa: E402


def make(method: str, D: int):
    if method == "plain":
        return KVCache()
    if method == "waterfill":  # 4-bit, a 16-row window, RoPE known (keys quantized before it)
        c = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=4, head_dim=D,
                                                options=WaterfillOptions(residual_length=16)))
        c.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
        return c
    return KVCacheFactory.create(KVCacheConfig(method=method, head_dim=D))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--method", action="append", default=None, help="a method at its defaults (waterfill: 4-bit)")
    ap.add_argument("--min-rows", type=int, default=None)
    a = ap.parse_args(argv)
    H, R, D, T, S = 3, 3, 64, a.context, a.steps
    dispatch.install()
    k, v, q = (mx.random.normal((1, h, T + S, D), key=mx.random.key(i)) for i, h in enumerate((H, H, H * R)))
    mx.eval(k, v, q)
    caches = {m: make(m, D) for m in ["plain"] + (a.method or ["waterfill"])}
    for c in caches.values():
        for s in range(0, T, 512):
            K, V = c.update_and_fetch(k[:, :, s : s + 512], v[:, :, s : s + 512])
            mx.eval(dispatch.dispatched_sdpa(q[:, :, s : s + 512], K, V, cache=c, scale=D**-0.5, mask="causal"))
    defaults = attention.CPU_SPLIT_MIN_ROWS, attention.CPU_SPLIT_DECODE_MIN_ROWS
    res: dict = {}
    kernel = native.available()
    for _ in range(a.rounds):
        for name, c in caches.items():
            for streams in (1,) if name == "plain" else (1, 2, "kernel") if kernel else (1, 2):
                native._ENV_ON = streams == "kernel"
                attention.CPU_STREAMS = 2 if streams == "kernel" else streams
                if a.min_rows is not None and streams == 2:
                    attention.CPU_SPLIT_MIN_ROWS = attention.CPU_SPLIT_DECODE_MIN_ROWS = a.min_rows
                times = []
                for i in range(T, T + S):
                    t0 = time.perf_counter()
                    K, V = c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
                    out = dispatch.dispatched_sdpa(q[:, :, i : i + 1], K, V, cache=c, scale=D**-0.5, mask=None)
                    del K, V  # as in the model: a reference held into the next step makes the plain cache copy
                    mx.eval(out)
                    times.append(time.perf_counter() - t0)
                attention.CPU_SPLIT_MIN_ROWS, attention.CPU_SPLIT_DECODE_MIN_ROWS = defaults
                c.trim(S)
                res.setdefault((name, streams), []).append(statistics.median(times) * 1e3)
    print(f"context {T}, H={H}, rep={R}, D={D}, {S} steps x {a.rounds} rounds, {mx.default_device()}")
    for (name, streams), xs in res.items():
        how = "cpu kernel" if streams == "kernel" else f"streams {streams}"
        print(f"{name:16s} {how:10s}: {statistics.median(xs):7.3f} ms a step (rounds: "
              + " ".join(f"{x:.2f}" for x in xs) + ")")


if __name__ == "__main__":
    main()
