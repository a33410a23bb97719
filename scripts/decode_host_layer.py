"""Host time of one layer's decode call, in isolation: ``update_and_fetch`` + attention for mlx_lm's plain
cache against a compressed cache whose decode kernel call is a stand-in (``decode_host_device.stub_kernels``:
runs on any machine; no evaluation is timed). The Python and MLX graph-building cost a cache adds per layer.

    python scripts/decode_host_layer.py --method kivi --context 1024 --calls 2000 [--split] [--profile] [--gpu-rules]
"""

from __future__ import annotations

import argparse
import gc
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from decode_host_device import stub_kernels  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig, dispatch  # noqa: E402
from veloxquant_mlx.cache.factory import KVCacheFactory  # noqa: E402


def time_calls(cache, attend, q, k, v, calls: int, prof=None, every: int = 16) -> float:
    """Median over blocks of ``every`` calls of the microseconds per ``update_and_fetch`` + ``attend`` (each
    block's graphs evaluated untimed after it; the garbage collector off while timing)."""
    times = []
    for _ in range(max(1, calls // every)):
        out = []
        gc.disable()
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(every):
            keys, values = cache.update_and_fetch(k, v)
            out.append(attend(q, keys, values, cache))
        times.append((time.perf_counter() - t0) / every)
        if prof:
            prof.disable()
        gc.enable()
        mx.eval(out, cache.state)
    return statistics.median(times) * 1e6


def split_calls(cache, attend, q, k, v, calls: int, every: int = 16) -> str:
    """Each call's ``update_and_fetch`` and attention timed apart: medians, means and the mean of the slowest 1/32
    (a window cache's compaction every 32 rows shows there)."""
    upd, att = [], []
    for _ in range(max(1, calls // every)):
        out = []
        gc.disable()
        for _ in range(every):
            t0 = time.perf_counter()
            keys, values = cache.update_and_fetch(k, v)
            t1 = time.perf_counter()
            out.append(attend(q, keys, values, cache))
            upd.append(t1 - t0)
            att.append(time.perf_counter() - t1)
        gc.enable()
        mx.eval(out, cache.state)
    us = lambda x: f"median {statistics.median(x) * 1e6:6.1f} mean {statistics.mean(x) * 1e6:6.1f} slowest " \
        f"{statistics.mean(sorted(x)[-max(1, len(x) // 32):]) * 1e6:7.1f} us"  # noqa: E731
    return f"update_and_fetch {us(upd)}; attention {us(att)}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="kivi")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field (int)")
    ap.add_argument("--real", action="store_true", help="the real kernels (CUDA), not the stand-in")
    ap.add_argument("--profile", action="store_true", help="cProfile of the compressed cache's last round")
    ap.add_argument("--split", action="store_true", help="also time update_and_fetch and the attention apart")
    ap.add_argument("--gpu-rules", action="store_true",
                    help="take the paths a GPU takes (``blocks.on_cpu`` patched to False): their host time, here")
    a = ap.parse_args(argv)
    if a.gpu_rules:
        from veloxquant_mlx.cache.primitives import blocks

        blocks.on_cpu = lambda: False
    if not a.real:
        stub_kernels("tiny")
    B, Hq, H, D, dt = 1, 32, 8, 128, mx.bfloat16
    fields = {kk: int(vv) for kk, vv in (kv.split("=", 1) for kv in a.set)}
    mx.random.seed(0)
    q, k, v = (mx.random.normal((B, n, 1, D)).astype(dt) for n in (Hq, H, H))
    past = [mx.random.normal((B, H, a.context, D)).astype(dt) for _ in range(2)]
    def sdpa(q, keys, values, cache):
        return dispatch.dispatched_sdpa(q, keys, values, cache, D**-0.5, None)

    dispatch.install()
    for r in range(a.rounds):
        for name in ("plain", a.method):
            cache = KVCache() if name == "plain" else KVCacheFactory.create(
                KVCacheConfig(method=name, bit_width_inlier=4, **fields))
            cache.update_and_fetch(*past)
            mx.eval(cache.state)
            prof = cProfile.Profile() if a.profile and name != "plain" and r == a.rounds - 1 else None
            us = time_calls(cache, sdpa, q, k, v, a.calls, prof)
            print(f"round {r} {name:10s} T={a.context}: {us:6.1f} us per layer call (median of {a.calls // 16} "
                  "blocks of 16)", flush=True)
            if a.split:
                print(f"round {r} {name:10s} {split_calls(cache, sdpa, q, k, v, a.calls)}", flush=True)
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
