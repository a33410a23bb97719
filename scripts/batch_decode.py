"""Batched decode speed: B requests of ragged lengths decoded together, compressed batch cache vs mlx_lm's.

    python scripts/batch_decode.py [--shape llama-8b|llama-1b|smollm2] [--batch 8] [--context 4096]
                                   [--steps 32] [--repeats 3] [--methods none,kivi:bit_width_inlier=4]
                                   [--method waterfill:bit_width_inlier=4,residual_length=16 ...] [--out FILE.json]

Each request (lengths ``context - i * context // (4 * batch)``, so they differ) is prefilled alone into its
own per-layer caches (``none``: mlx_lm's ``KVCache``; otherwise ``KVCacheBuilder.for_model``), the B caches
of each layer are merged with the class's ``merge`` (``BatchKVCache`` for ``none``, ``KIVIBatchKVCache``
for ``kivi``), then ``--steps`` greedy-shaped decode steps run on the batch (one ``mx.eval`` per step,
as mlx_lm's batch generator does). Every batch is built once, then the methods alternate within each repeat
(``--method`` takes one method with several settings; ``--methods`` a comma-separated list of one setting
each); reported: the median per-step time over repeats (min..max of the repeat medians), batch tokens/s, its
ratio to ``none`` in the same run, and the merged caches' measured bytes (before the steps) vs fp16 bytes of
the same tokens. Random weights (speed does not
depend on weight values).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import veloxquant_mlx  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.bench import random_model  # noqa: E402
from veloxquant_mlx.cli import build_config, parse_set  # noqa: E402
from veloxquant_mlx.measure import fp16_kv_bytes  # noqa: E402


def parse_method(text):
    name, _, rest = text.partition(":")
    return name, dict(parse_set(item) for item in rest.split(",") if item)


def build_batch(model, name, sets, lengths, vocab, chunk=2048):
    from veloxquant_mlx.cache import KVCacheBuilder

    per_request = []
    for i, n in enumerate(lengths):
        caches = make_prompt_cache(model) if name == "none" else KVCacheBuilder.for_model(model, build_config(name, sets))
        tokens = mx.random.randint(0, vocab, (1, n), key=mx.random.key(i))
        for s in range(0, n, chunk):
            model(tokens[:, s:s + chunk], cache=caches)
            mx.eval([c.state for c in caches])
        per_request.append(caches)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*per_request)]
    mx.eval([c.state for c in batch])
    return batch


def time_steps(model, batch, steps, vocab):
    B = len(batch[0].offset.tolist()) if isinstance(batch[0].offset, mx.array) else 1
    tok = mx.random.randint(0, vocab, (B, 1), key=mx.random.key(99))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(tok, cache=batch)
        tok = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(tok)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:] or times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=None)
    ap.add_argument("--method", action="append", default=[], help="name:key=value,key=value (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    model = random_model(args.shape)
    vocab = model.args.vocab_size
    lengths = [args.context - i * (args.context // (4 * args.batch)) for i in range(args.batch)]
    listed = args.methods or ("" if args.method else "none,kivi:bit_width_inlier=4")
    specs = [m for m in listed.split(",") if m] + args.method
    if args.method and "none" not in specs:
        specs.insert(0, "none")
    methods = [(spec, *parse_method(spec)) for spec in specs]
    batches = {spec: build_batch(model, name, sets, lengths, vocab) for spec, name, sets in methods}
    medians = {spec: [] for spec in batches}
    figures = {spec: {"kv_bytes": sum(c.nbytes for c in batch),
                      "kv_bytes_fp16": sum(fp16_kv_bytes(model, n) for n in lengths),
                      "cache": type(batch[0]).__name__} for spec, batch in batches.items()}
    for _ in range(args.repeats):
        for spec, batch in batches.items():
            medians[spec].append(time_steps(model, batch, args.steps, vocab))
    base = statistics.median(medians["none"]) if "none" in medians else None
    rows = []
    print(f"{args.shape}, batch {args.batch}, lengths {lengths[-1]}..{lengths[0]}, device {mx.default_device()}")
    print("| method | batch cache | step ms (min..max) | batch tok/s | vs none | kv_bytes / fp16 |")
    print("|---|---|---|---|---|---|")
    for spec, name, sets in methods:
        med = statistics.median(medians[spec])
        row = {"method": name, "settings": sets, "step_s": med, "step_s_min": min(medians[spec]),
               "step_s_max": max(medians[spec]), "tokens_per_s": args.batch / med,
               "vs_none": (base / med) if base else None, **figures[spec]}
        rows.append(row)
        label = name + "".join(f" {k}={v}" for k, v in sets.items())
        print(f"| {label} | {row['cache']} | {1e3 * med:.1f} ({1e3 * row['step_s_min']:.1f}..{1e3 * row['step_s_max']:.1f}) "
              f"| {row['tokens_per_s']:.1f} | {row['vs_none']:.2f}x | {row['kv_bytes'] / row['kv_bytes_fp16']:.3f} |")
    if args.out:
        meta = {"machine": f"{platform.machine()} {platform.system()}", "mlx": mx.__version__,
                "device": str(mx.default_device()), "args": vars(args), "lengths": lengths,
                "date": time.strftime("%Y-%m-%d")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
