"""Where one layer's prefill chunk goes: a cache filled to ``--context`` rows takes one more chunk, timed whole
(``update_and_fetch`` + attention through the dispatch point) and in parts, against mlx_lm's plain ``KVCache`` +
fused attention at the same length.

    python scripts/prefill_chunk_cost.py --method waterfill --set residual_length=16 --context 8192,30720

Parts (each evaluated alone on a copy of the filled cache; min over ``--repeats``):
* ``store``: ``_store`` (the chunk enters the window / residual, whole blocks or groups quantized);
* ``fetch``: ``update_and_fetch`` (store + the stored rows decoded to the dense form the fused attention reads);
* ``rows``: the quantized past alone decoded to dense rows (``_quantized_dense`` / ``_quantized_rows``);
* ``encode``: TurboQuant-RVQ's codes of the chunk's rows alone (KVQuant on CUDA: its encode kernel's launch alone);
* ``chunk``: ``update_and_fetch`` + attention, the whole layer-chunk;
* ``plain``: the same for mlx_lm's ``KVCache``.
``--profile`` prints the Python functions of one whole chunk call by cumulative time (host syncs show as
``eval``/``item``/``tolist``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch  # noqa: E402
from veloxquant_mlx.cache.kernels import kernels_enabled, kvquant_rows  # noqa: E402
from veloxquant_mlx.cache.kernels.waterfill import cache_constants  # noqa: E402
from veloxquant_mlx.cache.methods.quantization.kvquant import KVQuantKVCache  # noqa: E402
from veloxquant_mlx.cache.methods.quantization.waterfill import WaterfillKVCache  # noqa: E402
from veloxquant_mlx.cache.settings import parse_sets  # noqa: E402


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        arg = fn.setup() if hasattr(fn, "setup") else None
        mx.synchronize()
        t = time.perf_counter()
        out = fn(arg)
        mx.eval(out)
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


class _Step:
    def __init__(self, run, setup=None):
        self.run, self.setup_fn = run, setup

    def setup(self):
        return self.setup_fn() if self.setup_fn else None

    def __call__(self, arg):
        return self.run(arg)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="waterfill")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE for the method's config")
    ap.add_argument("--context", default="8192,30720", help="rows stored before the timed chunk")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rep", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    H, R, D, n = a.heads, a.rep, a.dim, a.chunk
    dt = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    scale = D**-0.5
    kw = parse_sets(a.set, a.method)
    dispatch.install()
    rope = nn.RoPE(D, traditional=False, base=500000.0)
    attn = type("Attn", (), {"rope": rope})()
    print(f"{a.method} {kw} bits={a.bits}, H={H} rep={R} D={D}, chunk {n}, {mx.default_device()}, {dt}", flush=True)
    for T in (int(x) for x in a.context.split(",")):
        rows = T + n
        k, v = (mx.random.normal((1, H, rows, D)).astype(dt) for _ in range(2))
        q = mx.random.normal((1, H * R, rows, D)).astype(dt)
        mx.eval(k, v, q)
        cache = KVCacheFactory.create(KVCacheConfig(method=a.method, bit_width_inlier=a.bits, head_dim=D, **kw))
        if hasattr(cache, "bind_attention"):
            cache.bind_attention(attn)
        plain = KVCache()
        for c in (cache, plain):
            for s in range(0, T, n):
                K, V = c.update_and_fetch(k[:, :, s:s + n], v[:, :, s:s + n])
                mx.eval(dispatch.dispatched_sdpa(q[:, :, s:s + n], K, V, cache=c, scale=scale, mask="causal"))
            mx.eval(c.state)
        nk, nv, nq = k[:, :, T:], v[:, :, T:], q[:, :, T:]

        def fresh(c=cache):
            c2 = copy.deepcopy(c)
            if kernels_enabled() and isinstance(c2, WaterfillKVCache) and c2.calibrated:
                cache_constants(c2)  # a copy rebuilds the kernel tables once (a host sync): not a chunk's cost
            mx.eval(c2.state)
            return c2

        def chunk(c):
            K, V = c.update_and_fetch(nk, nv)
            return [dispatch.dispatched_sdpa(nq, K, V, cache=c, scale=scale, mask="causal"), c.state]

        def fetch(c):
            return [*c.update_and_fetch(nk, nv), c.state]

        def store(c):
            c._store(nk, nv)
            return c.state

        def plain_chunk(c):
            K, V = c.update_and_fetch(nk, nv)
            return [mx.fast.scaled_dot_product_attention(nq, K, V, scale=scale, mask="causal"), c.state]

        def rows(c):  # the stored past as dense rows alone (the rows kernel on CUDA)
            dense = getattr(c, "_quantized_dense", None) or c._quantized_rows
            return list(dense(c.n_quant, dt))

        def encode(c):  # TurboQuant-RVQ: the chunk's keys and values to codes alone (the encode kernel on CUDA)
            return [x for qz, rows in zip(c._qs(), (nk, nv)) for x in qz.encode(rows, c) if x is not None]

        parts = {"plain": _Step(plain_chunk, lambda: fresh(plain)), "chunk": _Step(chunk, fresh),
                 "fetch": _Step(fetch, fresh)}
        if hasattr(cache, "_store"):
            parts["store"] = _Step(store, fresh)
        if hasattr(cache, "_qs"):
            parts["encode"] = _Step(encode, fresh)
        if isinstance(cache, KVQuantKVCache) and kernels_enabled():
            parts["encode"] = _Step(lambda c: [x for side in kvquant_rows.encode(c, nk, nv, c.n_quant) for x in side
                                               if x is not None], fresh)
        if hasattr(cache, "_quantized_dense") or hasattr(cache, "_quantized_rows"):
            parts["rows"] = _Step(rows, fresh)
        times = {name: _timed(f, a.repeats) for name, f in parts.items()}
        times["plain"] = min(times["plain"], _timed(parts["plain"], a.repeats))
        base = times["plain"]
        for name, t in times.items():
            print(f"  T={T:6d} {name:6s} {t * 1e3:8.2f} ms  {t / base:6.2f}x plain", flush=True)
        if a.profile:
            c = fresh()
            prof = cProfile.Profile()
            prof.enable()
            mx.eval(chunk(c))
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
