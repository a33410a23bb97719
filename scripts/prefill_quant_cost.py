"""Cost of quantizing one prefill chunk vs the model's own work for it, per layer (CPU or GPU).

    python scripts/prefill_quant_cost.py [--rows 2048] [--shape smollm2]

Times (min over interleaved rounds, so a loaded machine affects every candidate alike):
* ``plain layer``: one transformer layer of the random-weight shape over ``rows`` new tokens with
  mlx_lm's plain cache holding ``rows`` earlier tokens (the model's own work per layer and chunk);
* ``turboquant_rvq encode (beam: smallest_k)`` and ``(beam: argpartition)``: keys + values of the chunk
  through the RVQ encoder with the current beam selection and with the former ``mx.argpartition``;
* ``waterfill append``, ``kivi append``: the storage step of those caches for the chunk.
"""

from __future__ import annotations

import argparse
import time

import veloxquant_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import bench
from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache.methods.quantization import turboquant_rvq as tq
from veloxquant_mlx.cache.primitives import rvq  # the RVQ encoder's beam search (smallest_k) lives here


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shape = dict(bench.SHAPES[args.shape], num_hidden_layers=1)
    bench.SHAPES["_one"] = shape
    model = bench.random_model("_one")
    H, D = shape["num_key_value_heads"], shape["head_dim"]
    n, dt = args.rows, bench.default_dtype()
    x = mx.random.normal((1, H, n, D)).astype(dt)
    ids = mx.random.randint(0, shape["vocab_size"], (1, 2 * n))
    mx.eval(x, ids)

    def plain():
        c = [KVCache()]
        mx.eval(model.model(ids[:, :n], cache=c))
        t0 = time.perf_counter()
        mx.eval(model.model(ids[:, n:], cache=c))
        return time.perf_counter() - t0

    kq = tq._quantizer(D, 4, 12, 0, None)
    vq = tq._quantizer(D, 8, 8, 0, None)
    argpartition = lambda d, k: mx.argpartition(d, kth=k - 1, axis=1)[:, :k]  # noqa: E731

    def tq_encode(beam_fn):
        def run():
            saved, rvq.smallest_k = rvq.smallest_k, beam_fn
            try:
                t0 = time.perf_counter()
                mx.eval(kq.encode(x), vq.encode(x))
                return time.perf_counter() - t0
            finally:
                rvq.smallest_k = saved
        return run

    def append(method, **kw):
        def run():
            c = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=D, **kw))
            c.update_and_fetch(x[:, :, :64], x[:, :, :64])
            if method == "waterfill":
                c._calibrate()
            mx.eval(c.state)
            t0 = time.perf_counter()
            c.update_and_fetch(x, x)
            mx.eval(c.state)
            return time.perf_counter() - t0
        return run

    cands = {"plain layer (model work)": plain,
             "turboquant_rvq encode (beam: smallest_k)": tq_encode(rvq.smallest_k),
             "turboquant_rvq encode (beam: argpartition)": tq_encode(argpartition),
             "waterfill append": append("waterfill", bit_width_inlier=4),
             "kivi append": append("kivi", bit_width_inlier=4)}
    best = {k: float("inf") for k in cands}
    for _ in range(args.rounds + 1):  # the first round warms up (codebooks, kernels)
        for k, f in cands.items():
            best[k] = min(best[k], f())
    base = best["plain layer (model work)"]
    print(f"{args.shape}, one layer, chunk of {n} rows after {n}, {mx.default_device()}, {dt}")
    for k, v in best.items():
        print(f"{k:46s} {v * 1e3:9.1f} ms  {v / base:6.2f}x the layer")


if __name__ == "__main__":
    main()
