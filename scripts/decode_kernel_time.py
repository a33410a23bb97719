"""Time of the fused decode kernels alone (partials + merge, ten layers' worth in one evaluation) for KIVI's and
waterfill's layouts against MLX's fused attention over the same rows in float16, on MLX's CUDA backend;
with ``--old-kernels DIR`` also an earlier version of the kernels package (``DIR/__init__.py``, ``_common.py``, ...,
e.g. from ``git show REV:veloxquant_mlx/cache/kernels/kivi.py``), checked against the current ones; with
``--host`` also the host time to build each row's graph (no evaluation).

    python scripts/decode_kernel_time.py --context 8192,32768 --heads 8 --rep 4 --dim 128
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory  # noqa: E402
from veloxquant_mlx.cache import kernels as kpkg  # noqa: E402
from veloxquant_mlx.cache.kernels import kivi as kivi_k  # noqa: E402
from veloxquant_mlx.cache.kernels import waterfill as wf_k  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, WaterfillOptions  # noqa: E402

CHUNK = 4096


def load_old(folder: str) -> dict:
    """An earlier version of the kernels package (``DIR/__init__.py``, ``_common.py``, ``kivi.py``, ``waterfill.py``,
    e.g. from ``git show REV:veloxquant_mlx/cache/kernels/NAME.py``), loaded beside the current one."""
    name = "veloxquant_mlx.cache.kernels_old"
    spec = importlib.util.spec_from_file_location(name, Path(folder) / "__init__.py",
                                                  submodule_search_locations=[folder])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    mods = {n: importlib.import_module(f"{name}.{n}") for n in ("kivi", "waterfill")}
    return {**mods, "merge": pkg.merge_kernel}


def timed(f, reps: int = 20) -> float:
    """Milliseconds per call of ``f`` (evaluated), after three warm-up calls."""
    for _ in range(3):
        mx.eval(f())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - t) / reps * 1e3


def eval_only(f, reps: int = 20) -> float:
    """Milliseconds per call of ``f`` with its graph built before the clock starts: the evaluation alone (the launches'
    queueing and the device's work), after three warm-up calls."""
    for _ in range(3):
        mx.eval(f())
    outs = [f() for _ in range(reps)]
    t = time.perf_counter()
    mx.eval(outs)
    return (time.perf_counter() - t) / reps * 1e3


def host_build(f, reps: int = 50) -> float:
    """Microseconds per layer to build ``f``'s graph (ten layers per call), without evaluating it."""
    f()
    t = time.perf_counter()
    outs = [f() for _ in range(reps)]
    dt = (time.perf_counter() - t) / reps / 10 * 1e6
    mx.eval(outs)
    return dt


def fill(c, k, v, q):
    for a in range(0, k.shape[2], CHUNK):
        K, V = c.update_and_fetch(k[:, :, a:a + CHUNK], v[:, :, a:a + CHUNK])
        mx.eval(c.attend(q[:, :, a:a + CHUNK], K, V, scale=k.shape[-1] ** -0.5, mask="causal"), c.held_arrays())


def kernels_for(T: int, H: int, R: int, D: int, bits: int, old: dict | None):
    """The timed rows at context ``T``: name -> function returning ten layers' outputs."""
    k, v = mx.random.normal((1, H, T, D)).astype(mx.float16), mx.random.normal((1, H, T, D)).astype(mx.float16)
    q = mx.random.normal((1, H * R, T, D)).astype(mx.float16)
    one_q = mx.random.normal((1, H * R, 1, D)).astype(mx.float16)
    nk, nv = k[:, :, :1], v[:, :, :1]
    kv = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bits, head_dim=D,
                                             options=KIVIOptions(group_size=32)))
    wf = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=bits, head_dim=D,
                                             options=WaterfillOptions(residual_length=16)))
    wf.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
    fill(kv, k, v, q)
    fill(wf, k, v, q)
    kex = (kv.res_k, kv.res_v, kv.n_res, kv.res_k, kv.res_v, 0, nk, nv)
    wex = (wf.sink_k, wf.sink_v, wf.n_sink, wf.win_k, wf.win_v, wf.n_win, nk, nv)

    def kivi(mod=kivi_k, merge=kpkg.merge_kernel):
        m, l, acc = mod.kivi_partials(one_q, D**-0.5, kv.k_codes, kv.k_scales, kv.k_biases, kv.v_codes, kv.v_scales,
                                      kv.v_biases, kv.n_quant, kv.qbits, kv.group, kv.value_group(D), kex)
        return merge(m, l, acc, None, hadamard=False, out_dtype=one_q.dtype)

    def waterfill(mod=wf_k, merge=kpkg.merge_kernel):
        ktab, lo, st, rope, vpoly = wf_k.cache_constants(wf)
        m, l, acc = mod.waterfill_partials(one_q, D**-0.5, wf.k_words, ktab, lo, st, rope, wf.v_words, wf.v_scales,
                                           vpoly, wf.n_quant, wf.n_sink, wf.bit_width, D, wex)
        return merge(m, l, acc, None, hadamard=True, out_dtype=one_q.dtype)

    rows = {"fused sdpa, float16 rows": lambda: [mx.fast.scaled_dot_product_attention(one_q, k, v, scale=D**-0.5)
                                                 for _ in range(10)],
            "kivi kernel": lambda: [kivi() for _ in range(10)],
            "waterfill kernel": lambda: [waterfill() for _ in range(10)]}
    if old:
        for name, f in (("kivi", kivi), ("waterfill", waterfill)):
            a, b = f(), f(old[name], old["merge"])
            rel = (mx.linalg.norm((a - b).astype(mx.float32)) / mx.linalg.norm(a.astype(mx.float32))).item()
            print(f"  {name}: current vs previous kernel, relative L2 difference {rel:.2e}")
        rows["kivi kernel, previous version"] = lambda: [kivi(old["kivi"], old["merge"]) for _ in range(10)]
        rows["waterfill kernel, previous version"] = lambda: [waterfill(old["waterfill"], old["merge"])
                                                              for _ in range(10)]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="8192,32768")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rep", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--old-kernels", default=None)
    ap.add_argument("--host", action="store_true", help="also the host time to build each row's graph")
    a = ap.parse_args(argv)
    if not kpkg.kernels_enabled():
        sys.exit("the decode kernels need MLX's CUDA backend")
    old = load_old(a.old_kernels) if a.old_kernels else None
    for T in (int(x) for x in a.context.split(",")):
        print(f"T={T}, H={a.heads}, rep={a.rep}, D={a.dim}, {a.bits}-bit (ms per 10 layers, one evaluation)")
        for name, f in kernels_for(T, a.heads, a.rep, a.dim, a.bits, old).items():
            host = f", host build {host_build(f):6.1f} us per layer" if a.host else ""
            print(f"  {name:36s} {timed(f):8.3f} ms{host}", flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
