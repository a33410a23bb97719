"""What a CPU decode step of KIVI-4 can cost at best with MLX's ops, next to the plain cache's attention: one layer at
SmolLM2's shape (3 KV heads x 3 query rows, d 64, float32), each piece evaluated alone (median and min over
``--calls``): the plain cache's fused attention and its matmuls, KIVI's two ``quantized_matmul`` contractions on one
stream, on half the contraction, and split on two CPU streams as the cache does (``attention.split_on_cpu_streams``),
and the joint softmax's exponentials (``window.softmax_exp``).

    python scripts/cpu_kivi_floor.py --context 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()  # before mlx

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache.attention import cpu_parts, split_on_cpu_streams  # noqa: E402
from veloxquant_mlx.cache.window import softmax_exp  # noqa: E402


def timed(fn, calls: int) -> tuple[float, float]:
    for _ in range(10):
        mx.eval(fn())
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args(argv)
    B, H, R, D, T, G, b = 1, 3, 3, 64, a.context, 32, 4
    key = mx.random.key(0)
    k, v = mx.random.normal((B, H, T, D), key=key), mx.random.normal((B, H, T, D), key=mx.random.key(1))
    q = mx.random.normal((B, H, R, D), key=mx.random.key(2))
    kc, ks, kb = mx.quantize(mx.contiguous(k.swapaxes(-1, -2)), group_size=G, bits=b)  # keys per channel
    vc, vs, vb = mx.quantize(v, group_size=G, bits=b)  # values per token
    ks, kb, vs, vb = (x.astype(mx.float16) for x in (ks, kb, vs, vb))  # as the cache stores them
    s = (q @ k.swapaxes(-1, -2)) * D**-0.5
    p = mx.softmax(s, axis=-1)
    mx.eval(k, v, q, kc, ks, kb, vc, vs, vb, s, p)
    qmm = lambda x, c, sc, z: mx.quantized_matmul(x, c, sc, z, transpose=False, group_size=G, bits=b)  # noqa: E731
    half = D // 2
    kh = [mx.contiguous(x[:, :, :half]) for x in (kc, ks, kb)]
    mx.eval(kh)

    def joint():
        sc = split_on_cpu_streams(cpu_parts(T, D, qmm, (q, -1), (kc, 2), (ks, 2), (kb, 2)))
        e = softmax_exp(sc - sc.max(axis=-1, keepdims=True))
        out = split_on_cpu_streams(cpu_parts(T, T, qmm, (e, -1), (vc, 2), (vs, 2), (vb, 2)))
        return out / e.sum(axis=-1, keepdims=True)

    rows = [
        ("plain: fused sdpa over float32 rows", lambda: mx.fast.scaled_dot_product_attention(
            q.reshape(B, H * R, 1, D), k, v, scale=D**-0.5)),
        ("plain: q @ K^T", lambda: q @ k.swapaxes(-1, -2)),
        ("plain: p @ V", lambda: p @ v),
        ("plain: softmax (mx.exp)", lambda: mx.softmax(s, axis=-1)),
        ("kivi: keys qmm, one stream", lambda: qmm(q, kc, ks, kb)),
        ("kivi: keys qmm, half the channels", lambda: qmm(q[..., :half], *kh)),
        ("kivi: keys qmm, split on two streams", lambda: split_on_cpu_streams(
            cpu_parts(T, D, qmm, (q, -1), (kc, 2), (ks, 2), (kb, 2)))),
        ("kivi: values qmm, one stream", lambda: qmm(p, vc, vs, vb)),
        ("kivi: values qmm, split on two streams", lambda: split_on_cpu_streams(
            cpu_parts(T, T, qmm, (p, -1), (vc, 2), (vs, 2), (vb, 2)))),
        ("kivi: softmax (softmax_exp)", lambda: softmax_exp(s - s.max(axis=-1, keepdims=True))),
        ("kivi: keys + softmax + values, split", joint),
    ]
    print(f"one layer, context {T}, H={H} x {R}, d={D}, float32, {mx.default_device()}; ms median (min)")
    for name, fn in rows:
        med, low = timed(fn, a.calls)
        print(f"{name:42s} {med:7.3f} ({low:.3f})", flush=True)


if __name__ == "__main__":
    main()
