"""Compare variants of the decode kernels package on MLX's CUDA backend: each folder given holds a copy of
``veloxquant_mlx/cache/kernels/`` with a change (e.g. ``git show REV:...`` or an edited constant); every variant's
KIVI and waterfill decode steps (partials + merge, or one fused launch) run on the same caches (8 KV heads x 4 query heads, d 128, 4-bit), timed
(ms per 10 layers, host build included; and the evaluation alone, the graphs built before the clock starts) and
checked against the first variant. ``NCU=1``: one call each, no
timing, for ``ncu -k regex:decode`` (the kernels' own GPU time). Not for grid sizes (split counts): the ten timed
calls do not depend on each other, and a grid that leaves SMs idle looked 12-15% faster here while it was 38% slower
in the model, where each layer waits for the last (session 50): judge those with ``decode_timeline.py``.

    python scripts/decode_kernel_variants.py --context 8192,32768 kvar/A kvar/B
    NCU=1 ncu --section SpeedOfLight -k regex:decode python scripts/decode_kernel_variants.py --context 8192 kvar/A kvar/B
"""

from __future__ import annotations

import argparse
import functools
import inspect
import importlib
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, TurboQuantRVQOptions, WaterfillOptions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernel_time import eval_only, fill, timed  # noqa: E402

H, R, D = 8, 4, 128


def load(folder: str) -> dict:
    """The kernels package copy in ``folder``, loaded beside the installed one."""
    name = "veloxquant_mlx.cache.kernels_" + Path(folder).name
    spec = importlib.util.spec_from_file_location(name, Path(folder) / "__init__.py", submodule_search_locations=[folder])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    names = ("kivi", "waterfill", "turboquant_rvq", "turboquant_rvq_rows", "_common")
    mods = [n for n in names if (Path(folder) / f"{n}.py").exists()]
    return {n: importlib.import_module(f"{name}.{n}") for n in mods}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="8192,32768")
    ap.add_argument("--extra", default="0,17", help="rows past a multiple of the group (residual / window rows)")
    ap.add_argument("folders", nargs="+")
    a = ap.parse_args(argv)
    ncu = os.environ.get("NCU") == "1"
    variants = {Path(f).name: load(f) for f in a.folders}
    for T in (int(x) for x in a.context.split(",")):
        for extra in (int(x) for x in a.extra.split(",")):
            k, v = (mx.random.normal((1, H, T + extra, D)).astype(mx.float16) for _ in range(2))
            q = mx.random.normal((1, H * R, T + extra, D)).astype(mx.float16)
            one_q = mx.random.normal((1, H * R, 1, D)).astype(mx.float16)
            kv = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=4, head_dim=D,
                                                     options=KIVIOptions(group_size=32)))
            wf = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=4, head_dim=D,
                                                     options=WaterfillOptions(residual_length=16)))
            wf.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
            wf_consts = {}
            wf_partials = {}  # per variant, outside the timed calls: RoPE pairs in a lane where the variant knows them
            for M in variants.values():
                fn = M.get("waterfill") and M["waterfill"].waterfill_partials
                if fn and "paired" in inspect.signature(fn).parameters:
                    fn = functools.partial(fn, paired=M["waterfill"].paired_rope(wf.rope, D))
                wf_partials[id(M)] = fn
            tq = KVCacheFactory.create(KVCacheConfig(method="turboquant_rvq", head_dim=D,
                                                     options=TurboQuantRVQOptions()))  # default window: 128-160 exact rows
            fill(kv, k, v, q)
            fill(wf, k, v, q)
            fill(tq, k, v, q)
            tex = (tq.sink_k, tq.sink_v, tq.n_sink, tq.win_k, tq.win_v, tq.n_win, k[:, :, :1], v[:, :, :1])
            kex = (kv.res_k, kv.res_v, kv.n_res, kv.res_k, kv.res_v, 0, k[:, :, :1], v[:, :, :1])
            wex = (wf.sink_k, wf.sink_v, wf.n_sink, wf.win_k, wf.win_v, wf.n_win, k[:, :, :1], v[:, :, :1])

            def attend(M, partials, args, hadamard, rotation=None):
                """A variant's one step: fused (its ``_common`` has ``Merge``) or partials + merge kernel."""
                C = M["_common"]
                if rotation is not None:
                    return partials(*args, merge=C.Merge(None, False, one_q.dtype, None, rotation))
                if hasattr(C, "Merge"):
                    return partials(*args, merge=C.Merge(None, hadamard, one_q.dtype))
                return C.merge_kernel(*partials(*args), None, hadamard=hadamard, out_dtype=one_q.dtype)

            def kivi(M):
                return attend(M, M["kivi"].kivi_partials, (one_q, D**-0.5, kv.k_codes, kv.k_scales, kv.k_biases,
                                                           kv.v_codes, kv.v_scales, kv.v_biases, kv.n_quant, kv.qbits,
                                                           kv.group, kv.value_group(D), kex), False)

            def waterfill(M):
                if id(M) not in wf_consts:  # each variant's own tables (the cache holds one set at a time)
                    wf.__dict__.pop("_kconst", None)
                    wf_consts[id(M)] = M["waterfill"].cache_constants(wf)
                ktab, lo, st, rope, vpoly = wf_consts[id(M)]
                return attend(M, wf_partials[id(M)],
                              (one_q, D**-0.5, wf.k_words, ktab, lo, st, rope, wf.v_words, wf.v_scales, vpoly,
                               wf.n_quant, wf.n_sink, wf.bit_width, D, wex), True)

            def turboquant_rvq(M):
                kq, vq = tq._qs()
                return attend(M, M["turboquant_rvq"].tq_partials,
                              (one_q, one_q @ kq.rot_t, D**-0.5, (tq.k_codes1, tq.k_codes2), tq.k_norms,
                               (tq.v_codes1, None), tq.v_norms, kq.cb, vq.cb, vq.rotation_back(), tq.n_quant, tex),
                              False, vq.rotation_back())

            print(f"T={T}+{extra} (kivi residual {kv.n_res}, waterfill window {wf.n_win}); ms per 10 layers", flush=True)
            if not ncu:
                sdpa = lambda: [mx.fast.scaled_dot_product_attention(one_q, k, v, scale=D**-0.5) for _ in range(10)]  # noqa: E731
                print(f"  fused sdpa, float16 rows {timed(sdpa):8.3f} (evaluation alone {eval_only(sdpa):6.3f})")
            for name, f in (("kivi", kivi), ("waterfill", waterfill), ("turboquant_rvq", turboquant_rvq)):
                ref = None
                for vn, M in variants.items():
                    if name not in M:
                        continue
                    out = f(M)
                    mx.eval(out)
                    ref = out if ref is None else ref
                    rel = (mx.linalg.norm((out - ref).astype(mx.float32)) / mx.linalg.norm(ref.astype(mx.float32))).item()
                    t = "" if ncu else (f"{timed(lambda: [f(M) for _ in range(10)]):8.3f} ms (evaluation alone "
                                        f"{eval_only(lambda: [f(M) for _ in range(10)]):6.3f})  ")
                    print(f"  {name:10s} {vn:12s} {t}relative L2 vs {next(iter(variants))}: {rel:.1e}", flush=True)
            del kv, wf, tq
            mx.clear_cache()


if __name__ == "__main__":
    main()
