"""Host and device cost of one layer's decode step: the time to build the step's lazy graph (Python +
MLX graph construction, no evaluation) and the time per step when many steps are evaluated together,
for a compressed cache through the dispatch point against mlx_lm's plain ``KVCache`` + fused attention.

    python scripts/decode_step_cost.py --method kivi --context 8192 --heads 8 --rep 4 --dim 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="kivi")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rep", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--reuse-meta", action="store_true",
                    help="diagnostic: the kernels' per-step count arrays made once (wrong counts, same work)")
    a = ap.parse_args(argv)
    if a.reuse_meta:
        from veloxquant_mlx.cache.kernels import kivi as kivi_k, waterfill as wf_k

        memo = {}

        class _Proxy:
            def __getattr__(self, name):
                return getattr(mx, name)

            def array(self, x, dtype=None):
                key = (len(x), dtype)
                if key not in memo:
                    memo[key] = mx.array(x, dtype=dtype)
                return memo[key]

        kivi_k.mx = wf_k.mx = _Proxy()
    H, R, D, T = a.heads, a.rep, a.dim, a.context
    dt = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    k, v = (mx.random.normal((1, H, T, D)).astype(dt) for _ in range(2))
    q = mx.random.normal((1, H * R, 1, D)).astype(dt)
    new = [(mx.random.normal((1, H, 1, D)).astype(dt), mx.random.normal((1, H, 1, D)).astype(dt))
           for _ in range(8)]
    mx.eval(k, v, q, new)
    c = KVCacheFactory.create(KVCacheConfig(method=a.method, bit_width_inlier=a.bits, head_dim=D))
    dispatch.install()
    for cache in (c,):
        for s in range(0, T, 2048):
            K, V = cache.update_and_fetch(k[:, :, s:s + 2048], v[:, :, s:s + 2048])
            qq = mx.random.normal((1, H * R, K.shape[2] - s, D)).astype(dt)[:, :, -min(2048, T - s):]
            mx.eval(dispatch.dispatched_sdpa(qq, K, V, cache=cache, scale=D**-0.5, mask="causal"))
        mx.eval(cache.held_arrays())
    p = KVCache()
    p.update_and_fetch(k, v)
    mx.eval(p.keys, p.values)

    def run(cache, sdpa):
        outs, build = [], 0.0
        for i in range(a.steps):
            nk, nv = new[i % len(new)]
            t = time.perf_counter()
            K, V = cache.update_and_fetch(nk, nv)
            outs.append(sdpa(cache, K, V))
            build += time.perf_counter() - t
            if len(outs) == 32:
                mx.eval(outs)
                outs = []
        mx.eval(outs)
        return build / a.steps * 1e6

    ours = lambda cache, K, V: dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=D**-0.5, mask=None)  # noqa: E731
    plain = lambda cache, K, V: mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=None)  # noqa: E731
    for name, cache, f in ((a.method, c, ours), ("plain", p, plain), (a.method, c, ours), ("plain", p, plain)):
        t = time.perf_counter()
        build = run(cache, f)
        total = (time.perf_counter() - t) / a.steps * 1e6
        print(f"{name:10s} T={T}: graph build {build:7.1f} us/step, build + evaluate {total:7.1f} us/step", flush=True)


if __name__ == "__main__":
    main()
