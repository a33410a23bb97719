"""Peak MLX memory (beyond what is live before) and time of a chunked prefill, plain cache vs compressed.

    python scripts/prefill_peak.py --shape smollm2 --contexts 2048,4096 --steps 512,2048 \
        --methods none,waterfill:bit_width_inlier=4:residual_length=16,kivi:bit_width_inlier=4,turboquant_rvq

Each (method, context, step) runs in this process after ``mx.clear_cache``: the prompt is prefilled
as mlx_lm's ``generate_step`` does (chunks of ``step`` rows, every cache's state evaluated after each
chunk), and ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()`` minus the memory live before
is printed with the caches' ``nbytes`` and the prefill time. ``--methods all``: the plain cache, then every built
mlx_lm-protocol method at its defaults; ``--warm``: each measured after a first, unmeasured run (process-wide
constants, e.g. codebooks, are then not counted). A prompt in one chunk, every method:

    python scripts/prefill_peak.py --contexts 1023 --steps 2048 --methods all --warm

``--profile N``: after each measured run, one more prefill under ``cProfile``; its N functions of most own time
are printed (host work; on a GPU ``eval``/``synchronize``/``item`` are the host waiting for the device).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import veloxquant_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from veloxquant_mlx.bench import random_model
from veloxquant_mlx.eval.fidelity import make_caches, prefill
from veloxquant_mlx.measure import kv_bytes


def parse_method(text: str):
    name, *sets = text.split(":")
    if name == "none":
        return name, None
    from veloxquant_mlx.cli import build_config
    import json

    settings = {}
    for s in sets:
        k, v = s.split("=", 1)
        try:
            settings[k] = json.loads(v)
        except ValueError:
            settings[k] = v
    return text, build_config(name, settings)


def measure(model, config, n: int, step: int, seed: int = 0) -> dict:
    caches = make_caches(model, config)
    prompt = mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(seed))
    mx.eval(prompt)
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    prefill(model, prompt, caches, step)
    mx.synchronize()
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory() - base
    return {"peak": peak, "nbytes": kv_bytes(caches), "s": dt}


def profile(model, config, n: int, step: int, top: int) -> str:
    """One more prefill of ``n`` tokens under cProfile: the ``top`` functions by own time."""
    caches = make_caches(model, config)
    prompt = mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(0))
    mx.eval(prompt)
    mx.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    prefill(model, prompt, caches, step)
    mx.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip() and "Ordered by" not in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--steps", default="512,2048")
    ap.add_argument("--methods", default="none,kivi:bit_width_inlier=4,turboquant_rvq,"
                                        "waterfill:bit_width_inlier=4:residual_length=16")
    ap.add_argument("--warm", action="store_true", help="measure each after a first, unmeasured run")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile one more prefill per method: its N functions of most own time")
    args = ap.parse_args()
    from veloxquant_mlx import bench

    if args.layers:
        bench.SHAPES[args.shape] = dict(bench.SHAPES[args.shape], num_hidden_layers=args.layers)
    model = random_model(args.shape)
    if args.methods == "all":
        from veloxquant_mlx.cache import all_methods
        from veloxquant_mlx.cache.base import MLX_LM

        args.methods = ",".join(["none"] + [i.name for i in all_methods() if i.implemented and i.protocol == MLX_LM])
    methods = [parse_method(m) for m in args.methods.split(",")]
    print(f"shape={args.shape} layers={len(model.layers)} dtype={bench.default_dtype()}")
    print(f"{'method':48s} {'ctx':>6s} {'step':>5s} {'peak MB':>9s} {'x plain':>8s} {'nbytes MB':>9s} {'s':>7s} "
          f"{'x plain':>8s}")
    for n in [int(x) for x in args.contexts.split(",")]:
        for step in [int(x) for x in args.steps.split(",")]:
            plain = None
            for label, config in methods:
                try:
                    if args.warm:
                        measure(model, config, n, step)
                    r = measure(model, config, n, step)
                except Exception as e:  # one method's failure does not end the table
                    print(f"{label:48s} {n:6d} {step:5d} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if plain is None:
                    plain = r
                print(f"{label:48s} {n:6d} {step:5d} {r['peak'] / 1e6:9.1f} {r['peak'] / plain['peak']:8.2f} "
                      f"{r['nbytes'] / 1e6:9.2f} {r['s']:7.2f} {r['s'] / plain['s']:8.2f}", flush=True)
                if args.profile:
                    print(profile(model, config, n, step, args.profile), flush=True)


if __name__ == "__main__":
    main()
