"""Compare variants of TurboQuant-RVQ's encode kernel (``kernels/turboquant_rvq_rows.encode_words``) on MLX's CUDA
backend: each folder given holds a copy of ``veloxquant_mlx/cache/kernels/`` with a change; every variant encodes
the same rotated unit vectors (a prefill chunk's keys and values at the default options: ``--rows`` rows of d 128)
with the keys' and the values' codebooks, timed (ms per call, median of ``--repeats``) and checked against the first
variant (codes that differ, total distortion). ``NCU=1``: one call each, no timing, for ``ncu -k regex:encode``.

    python scripts/encode_kernel_variants.py kvar/A kvar/B
    NCU=1 ncu --section SpeedOfLight -k regex:encode python scripts/encode_kernel_variants.py kvar/A kvar/B
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from decode_kernel_variants import load  # noqa: E402
from veloxquant_mlx.cache.options import TurboQuantRVQOptions  # noqa: E402
from veloxquant_mlx.cache.primitives.bitpack import unpack_bits  # noqa: E402
from veloxquant_mlx.cache.primitives.rvq import rvq_codebook  # noqa: E402

D = 128


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384, help="vectors per call (a 2048-token chunk x 8 KV heads)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("folders", nargs="+")
    a = ap.parse_args(argv)
    ncu = os.environ.get("NCU") == "1"
    variants = {Path(f).name: load(f)["turboquant_rvq_rows"] for f in a.folders}
    o = TurboQuantRVQOptions()
    books = {"keys": rvq_codebook(D, o.key_sub_dim, o.key_codebook_bits, 0),
             "values": rvq_codebook(D, o.value_sub_dim, o.value_codebook_bits, 0)}
    x = mx.random.normal((a.rows, D), key=mx.random.key(1))
    y = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    mx.eval(y)
    for side, cb in books.items():
        first = None
        for name, mod in variants.items():
            out = mod.encode_words(cb, y)
            mx.eval(out)
            if ncu:
                continue
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                mx.eval(mod.encode_words(cb, y))
                times.append(time.perf_counter() - t0)
            i = unpack_bits(out[0], cb.bits1, cb.n_sub)
            j = unpack_bits(out[1], cb.bits2, cb.n_sub) if out[1] is not None else None
            err = float(mx.sum((cb.decode(i, j) - y) ** 2))
            diff = "" if first is None else f"  codes differing {float(mx.mean(i != first[0])):.2e}" + (
                f" / {float(mx.mean(j != first[1])):.2e}" if j is not None else "")
            first = first or (i, j)
            print(f"{side:6s} {name:10s} {statistics.median(times) * 1e3:7.3f} ms (min {min(times) * 1e3:.3f})  "
                  f"distortion {err:.6e}{diff}", flush=True)
            if hasattr(mod, "encode_rows"):  # rows scaled by their norm in the kernel (rows 4x the unit vectors)
                z = 4 * y
                mx.eval(mod.encode_rows(cb, z))
                t = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    mx.eval(mod.encode_rows(cb, z))
                    t.append(time.perf_counter() - t0)
                print(f"{side:6s} {name + ' rows':10s} {statistics.median(t) * 1e3:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
