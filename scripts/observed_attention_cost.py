"""One call of ``attention.observed_attention`` (the attention-weight eviction methods' path: probabilities observed
into a running per-key sum, in tiles of query rows) against ``dense_attention`` on the same rows, with the tile
rows it takes (``attention.query_tile_rows``) and MLX's peak memory over the call's start. For the tiles' row
floor (docs/RESULTS.md, "Long contexts: a floor on the tiles' rows").

    python scripts/observed_attention_cost.py --queries 1024 --keys 16384 [--heads 3 --rep 3 --dim 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache import attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from waterfill_cpu_profile import timed  # noqa: E402  (median ms of mx.eval(fn()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--rep", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    H, N, M, D = a.heads, a.queries, a.keys, a.dim
    q = mx.random.normal((1, H * a.rep, N, D))
    k, v = (mx.random.normal((1, H, M, D)) for _ in range(2))
    mx.eval(q, k, v)

    def observed():
        acc = [mx.zeros((1, H, M))]

        def observe(w, first, total):
            acc[0] = acc[0] + w.sum(axis=(2, 3))

        out = attention.observed_attention(q, k, v, scale=D**-0.5, mask="causal", observe=observe,
                                           held=lambda: [acc[0]])
        return [out, acc[0]]

    dense = lambda: attention.dense_attention(q, k, v, scale=D**-0.5, mask="causal")  # noqa: E731
    print(f"{mx.default_device()}: {N} query rows ({H * a.rep} heads) over {M} keys, d {D}; tiles of "
          f"{attention.query_tile_rows(q, N, M)} rows", flush=True)
    for name, fn in (("observed_attention", observed), ("dense_attention", dense)):
        ms = timed(fn, a.repeats)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn())
        print(f"  {name:20s} {ms:9.1f} ms   peak {(mx.get_peak_memory() - base) / 1e6:7.1f} MB", flush=True)


if __name__ == "__main__":
    main()
