"""The largest batch of long sequences each cache decodes within a memory budget, and its total decode rate
(issue 12, item 4): for the plain cache (mlx_lm's ``BatchKVCache``) and each method's batch form.

Each layer's single cache is filled with ``--context`` random rows (no prefill through the model: a server
prefills requests one by one and merges them, so decode is where the batch must fit), merged B times into the
batch cache, and decoded ``--steps`` greedy steps pipelined as mlx_lm's ``generate_step`` runs them. The fit:
at two probe batches the script measures the bytes held per sequence and the decode peak, fits
``peak(B) = a + b * B`` (weights, held bytes, per-step transients), takes the largest B with ``a + b * B`` within
the budget, runs it and checks the measured peak (one step smaller per overshoot, up to three times).

    python scripts/batch_capacity.py --shape llama-8b --context 32768 --budget-gb 120 \
        --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_model_cpu import cache_makers, filled  # noqa: E402

import mlx.core as mx  # noqa: E402

from veloxquant_mlx import bench  # noqa: E402


def _settle():
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def run(model, make, T: int, B: int, steps: int, one=None) -> dict:
    """Decode ``steps`` steps of a batch of ``B`` copies of one filled sequence: bytes held, peak, rate."""
    one = one or filled(model, make, T, chunk=4096)
    _settle()
    base = mx.get_active_memory()
    caches = [type(c).merge([c] * B) for c in one]
    mx.eval([c.state for c in caches])
    held = sum(c.nbytes for c in caches)
    _settle()
    mx.reset_peak_memory()

    def step(tok):
        return mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)

    try:
        tok = step(mx.zeros((B,), dtype=mx.int32))
        mx.eval(tok)
        _, times = bench.pipelined_decode(step, tok, steps)
        mx.synchronize()
    except RuntimeError as err:  # the device's memory ran out: over budget, whatever the budget
        if "out of memory" not in str(err):
            raise
        times = None
    out = {"batch": B, "held_bytes": int(held), "held_per_seq": held / B, "peak_bytes": int(mx.get_peak_memory()),
           "step_s": times and sorted(times)[len(times) // 2], "decode_tps": times and B * len(times) / sum(times),
           "active_before_merge": int(base), "out_of_memory": times is None}
    print(f"    B={B:4d} " + ("out of device memory" if times is None else
                               f"peak {out['peak_bytes'] / 1e9:7.2f} GB  held/seq {held / B / 1e9:.3f} GB  "
                               f"{out['decode_tps']:8.1f} tok/s  step {out['step_s'] * 1e3:.1f} ms"), flush=True)
    del caches
    _settle()
    return out


def fit(model, make, T: int, steps: int, budget: float, probes: tuple[int, int]) -> dict:
    """The probes, the linear fit of the peak and the runs at the predicted largest batch."""
    one = filled(model, make, T, chunk=4096)
    mx.eval([c.state for c in one])
    run(model, make, T, probes[0], 2, one)  # warm-up: kernels built and checked once against the op path, whose
    # transient would otherwise inflate the first probe's peak (and flatten the fit)
    runs = [run(model, make, T, b, steps, one) for b in probes]
    (b1, p1), (b2, p2) = ((r["batch"], r["peak_bytes"]) for r in runs)
    slope = (p2 - p1) / (b2 - b1)
    B = int((budget - (p1 - slope * b1)) // slope)
    for _ in range(4):
        r = run(model, make, T, B, steps, one)
        runs.append(r)
        if r["peak_bytes"] <= budget and not r["out_of_memory"]:
            break
        over = B // 10 if r["out_of_memory"] else -(-(r["peak_bytes"] - budget) // slope)
        B -= max(1, int(over))
    best = runs[-1] if runs[-1]["peak_bytes"] <= budget and not runs[-1]["out_of_memory"] else None
    return {"per_seq_peak_bytes": slope, "fixed_bytes": p1 - slope * b1, "largest_batch": best and best["batch"],
            "decode_tps": best and best["decode_tps"], "runs": runs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget-gb", type=float, default=120.0, help="peak memory allowed, weights included (1e9 B)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--probes", default="2,6", help="two batch sizes for the linear fit of the peak")
    ap.add_argument("--method", action="append", default=None, help="method[:field=value,...] (repeatable)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain cache")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    model = bench.random_model(a.shape)
    mx.eval(model.parameters())
    makers = cache_makers(a.method or [], plain=not a.no_plain)
    probes = tuple(int(x) for x in a.probes.split(","))
    res = {"shape": a.shape, "context": a.context, "budget_bytes": a.budget_gb * 1e9, "steps": a.steps,
           "device": str(mx.default_device()), "weights_bytes": int(mx.get_active_memory()), "candidates": {}}
    for name, make in makers.items():
        print(name, flush=True)
        r = res["candidates"][name] = fit(model, make, a.context, a.steps, a.budget_gb * 1e9, probes)
        print(f"{name:44s} largest batch {r['largest_batch']}  {r['decode_tps'] or 0:8.1f} tok/s  "
              f"({r['per_seq_peak_bytes'] / 1e9:.2f} GB per sequence at peak)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    base = res["candidates"].get("none")
    if base and base["largest_batch"]:
        for name, r in res["candidates"].items():
            if r["largest_batch"]:
                print(f"{name:44s} batch {r['largest_batch'] / base['largest_batch']:.2f}x  "
                      f"total decode {r['decode_tps'] / base['decode_tps']:.2f}x the plain cache's")


if __name__ == "__main__":
    main()
