"""What one GEAR layer-chunk's fit costs, piece by piece, on the default device: the blocks of a prefill chunk
(``[B, H, g, G, D]`` float32, llama-8b's shape by default) through the dense-and-sparse split, the per-channel
codes, the rank-r subspace iteration (as it runs, and inside ``mx.compile``), the energy-rank SVD on the CPU, and
a fresh cache's whole ``update_and_fetch`` of the chunk (``--methods``). Each piece evaluated alone, best of
``--repeats``, milliseconds.

    python scripts/gear_fit_cost.py --chunk 2048 --heads 8 --dim 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import veloxquant_mlx  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory  # noqa: E402
from veloxquant_mlx.cache.primitives import groupquant as gq  # noqa: E402
from veloxquant_mlx.cache.primitives import lowrank_fit as lr  # noqa: E402
from veloxquant_mlx.cache.primitives import nonuniform as nu  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default="gear,kvquant,kivi", help="caches whose whole chunk call is timed")
    args = ap.parse_args()
    G, D, H, r = args.group, args.dim, args.heads, args.rank
    g = args.chunk // G
    x = mx.random.normal((1, H, g, G, D), key=mx.random.key(0)) * 0.5
    mx.eval(x)
    ko = int(0.02 * G * D + 0.999)
    omega = mx.random.normal((D, r), key=mx.random.key(1))

    def fit(x, om):
        y = x @ om
        for _ in range(lr.POWER_ITERS):
            y = x @ (x.swapaxes(-1, -2) @ lr.orthonormal_columns(y))
        a = lr.orthonormal_columns(y)
        return a, a.swapaxes(-1, -2) @ x

    compiled = mx.compile(fit)
    pieces = {
        "split_outliers": lambda: nu.split_outliers(x.reshape(1, H, g, G * D), ko)[2],
        "argpartition alone": lambda: mx.argpartition(-mx.abs(x.reshape(1, H, g, G * D)), kth=ko - 1, axis=-1),
        "quantize_per_channel": lambda: gq.quantize_per_channel(x.reshape(1, H, g * G, D), 2, G)[0],
        "power_lowrank": lambda: lr.power_lowrank(x, r),
        "power_lowrank compiled": lambda: compiled(x, omega),
        "orthonormal_columns once": lambda: lr.orthonormal_columns(x @ omega),
        "svd (CPU stream)": lambda: mx.linalg.svd(x, compute_uv=False, stream=mx.cpu),
    }
    print(f"device {mx.default_device()}, blocks [1, {H}, {g}, {G}, {D}], rank {r}, {ko} outliers a block")
    for name, fn in pieces.items():
        print(f"{name:28s} {best_ms(fn, args.repeats):9.2f} ms", flush=True)

    keys = mx.random.normal((1, H, args.chunk, D), key=mx.random.key(2)).astype(mx.float16)
    vals = mx.random.normal((1, H, args.chunk, D), key=mx.random.key(3)).astype(mx.float16)

    for method in args.methods.split(","):
        def whole(cfg=KVCacheConfig(method=method)):
            cache = KVCacheFactory.create(cfg)
            cache.update_and_fetch(keys, vals)
            return cache.held_arrays()

        print(f"{method + ' update_and_fetch':28s} {best_ms(whole, args.repeats):9.2f} ms (a fresh cache, one chunk)",
              flush=True)


if __name__ == "__main__":
    main()
