"""Where a whole decode step's device time goes: one cache per process, filled directly (as
``decode_model_cpu.py`` fills them), a few warm steps, then ``--steps`` pipelined steps inside
``cudaProfilerStart`` / ``cudaProfilerStop``, so that Nsight Compute times only their kernels (each alone, at the
clocks the run has), and ``--ncu-csv`` sums those times by kernel name, per step:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        python scripts/decode_timeline.py --context 131072 --steps 2 --method kivi:bit_width_inlier=4 > kivi.csv
    python scripts/decode_timeline.py --ncu-csv kivi.csv --steps 2

It also prints the steps' wall time (tok/s; read it from a run without ncu, which serialises the kernels): the
device's busy time per step against it says how much of a step the device waits for the host. With no CUDA runtime
to call it only times the steps.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import glob
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_model_cpu import bench, cache_makers, filled, mx  # noqa: E402


def cuda_runtime():
    """The CUDA runtime library MLX loaded (or one beside it), or None."""
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for root in sys.path:
        names += sorted(glob.glob(f"{root}/nvidia/*/lib/libcudart.so*"))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def kernel_times(path: str, steps: int) -> dict:
    """Nsight Compute's kernel durations (a CSV of ``gpu__time_duration.sum``) summed by kernel name (its template and
    argument list cut): ``{name: (us per step, launches per step)}``, largest first."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    total, count = collections.Counter(), collections.Counter()
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0][:70]
        total[name] += float(row["Metric Value"].replace(",", "")) * _UNITS[row["Metric Unit"]] / steps
        count[name] += 1
    return {name: (us, count[name] / steps) for name, us in total.most_common()}


def print_kernel_times(times: dict) -> None:
    print(f"device time per step: {sum(us for us, _ in times.values()) / 1e3:.3f} ms in "
          f"{sum(n for _, n in times.values()):.0f} kernels")
    for name, (us, n) in times.items():
        print(f"  {us:9.1f} us  {n:5.0f} x  {name}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--method", default=None, help="method[:field=value,...]; none: mlx_lm's plain cache")
    ap.add_argument("--ncu-csv", default=None, help="summarize this Nsight Compute CSV instead of running")
    a = ap.parse_args(argv)
    if a.ncu_csv:
        return print_kernel_times(kernel_times(a.ncu_csv, a.steps))
    model = bench.random_model(a.shape)
    makers = cache_makers([a.method] if a.method else [], plain=not a.method)
    (name, make), = makers.items()
    caches = filled(model, make, a.context)

    def step(tok):
        return mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)

    tok = mx.zeros((1,), dtype=mx.int32)
    for _ in range(4):  # warm: kernels built, buffers grown
        tok = step(tok)
        mx.eval(tok)
    rt = cuda_runtime()
    if rt is None:
        print("no CUDA runtime found: timing only", file=sys.stderr)
    mx.synchronize()
    if rt is not None:
        rt.cudaProfilerStart()
    t0 = time.perf_counter()
    _, times = bench.pipelined_decode(step, tok, a.steps)
    mx.synchronize()
    wall = time.perf_counter() - t0
    if rt is not None:
        rt.cudaProfilerStop()
    print(f"{name} {a.shape} context {a.context}: {a.steps} steps in {wall * 1e3:.1f} ms "
          f"({a.steps / wall:.1f} tok/s; median step {sorted(times)[len(times) // 2] * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
