"""The kernels of one layer's prefill chunk and their GPU time, from Nsight Compute: a cache filled to ``--context``
rows takes one ``--chunk``-row chunk (update_and_fetch + attention through the dispatch point), after a first pass
that compiles everything, next to mlx_lm's plain ``KVCache``; marker launches delimit the chunks, and ``sum`` adds
the kernels between markers by name (launch counts matter on MLX's CUDA backend: each costs host time).

    ncu --csv --metrics gpu__time_duration.sum python scripts/prefill_chunk_kernels.py --method turboquant_rvq > k.csv
    python scripts/prefill_chunk_kernels.py sum k.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(path: str) -> None:
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    head = next(r for r in rows if "Kernel Name" in r)
    ki, vi, mi = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Name")
    part, sums, counts = None, {}, {}
    for r in rows[rows.index(head) + 1:]:
        if r[mi] != "gpu__time_duration.sum":
            continue
        name, ns = r[ki], float(r[vi].replace(",", ""))
        if "marker_" in name:
            part = name.split("marker_")[1].split("(")[0]
            sums[part], counts[part] = collections.Counter(), collections.Counter()
        elif part:
            sums[part][name[:70]] += ns
            counts[part][name[:70]] += 1
    for part, c in sums.items():
        if part.startswith("end"):
            continue
        print(f"== {part}: {sum(c.values()) / 1e3:.1f} us in {sum(counts[part].values())} launches")
        for name, ns in c.most_common(30):
            print(f"  {ns / 1e3:9.1f} us {counts[part][name]:4d}x  {name}")


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "sum":
        return summarize(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="turboquant_rvq")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args(argv)
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch

    def mark(tag):
        kern = mx.fast.cuda_kernel(name=f"marker_{tag}", input_names=["x"], output_names=["y"], source="y[0] = x[0];")
        mx.eval(kern(inputs=[mx.zeros((1,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
                     threadgroup=(1, 1, 1))[0])
        mx.synchronize()

    dispatch.install()
    H, R, D, T, C = 8, 4, 128, a.context, a.chunk
    k, v = (mx.random.normal((1, H, T + C, D)).astype(mx.bfloat16) for _ in range(2))
    q = mx.random.normal((1, H * R, T + C, D)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    caches = {a.method: lambda: KVCacheFactory.create(KVCacheConfig(method=a.method, head_dim=D)), "plain": KVCache}
    for name, make in caches.items():
        for rep in range(2):  # the first pass compiles and checks the kernels
            c = make()
            for s in range(0, T + C, C):
                if rep and s + C >= T + C:
                    mark(name)
                K, V = c.update_and_fetch(k[:, :, s:s + C], v[:, :, s:s + C])
                mx.eval(dispatch.dispatched_sdpa(q[:, :, s:s + C], K, V, cache=c, scale=D ** -0.5, mask="causal"))
                mx.synchronize()
        mark("end")


if __name__ == "__main__":
    main()
