"""The cost of an exponential on MLX's CPU backend, by array size: ``mx.exp`` (one libm call per element) against
``window.softmax_exp`` (two compiled kernels), each timed as the median of several evaluations; then the same in a
child process with glibc's allocator told to keep freed memory (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), to show how much of a large temporary's cost is the kernel handing pages back and
faulting them in again. Softmax exponentials are most of a CPU prefill's attention (mlx_lm's plain cache too).

    python scripts/cpu_exp_cost.py [--sizes 36864,262144,1048576,2097152,4194304] [--no-child]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache.window import softmax_exp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from waterfill_cpu_profile import timed  # noqa: E402  (median ms of mx.eval(fn()))

KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="36864,262144,1048576,2097152,4194304")
    ap.add_argument("--no-child", action="store_true", help="skip the run with glibc keeping freed memory")
    a = ap.parse_args(argv)
    label = "glibc keeps freed memory" if os.environ.get("MALLOC_TRIM_THRESHOLD_") else "default allocator"
    print(f"{label} ({mx.default_device()}, MLX {mx.__version__}):", flush=True)
    for n in map(int, a.sizes.split(",")):
        x = mx.random.normal((n,)) - 3
        mx.eval(x)
        e, s = timed(lambda: mx.exp(x), 7), timed(lambda: softmax_exp(x), 7)
        print(f"  {n:9d} elements: mx.exp {e:8.2f} ms ({e * 1e6 / n:5.1f} ns/element), softmax_exp {s:8.2f} ms "
              f"({s * 1e6 / n:5.1f} ns/element)", flush=True)
    if not a.no_child and label == "default allocator":
        subprocess.run([sys.executable, __file__, "--sizes", a.sizes, "--no-child"], env={**os.environ, **KEEP_FREED},
                       check=True)


if __name__ == "__main__":
    main()
