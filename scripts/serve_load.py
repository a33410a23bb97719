"""Loopback load test of ``veloxquant serve``: requests/s and latency per method, vs ``--method none``.

    python scripts/serve_load.py [--methods none,kivi:bit_width_inlier=4,turboquant_rvq,snapkv:snap_budget=128]
                                 [--requests 12] [--concurrency 4] [--prompt-tokens 400] [--max-tokens 32]
                                 [--out docs/data/serve_load_cpu.json]

For each method, in one process and one after the other: a server (``server.make_server``, the embedded
SmolLM2-135M, greedy) on 127.0.0.1 with that method as its default; ``--requests`` chat requests, each an
essay excerpt of about ``--prompt-tokens`` tokens (all different) and a question, first sent one by one
(the reference outputs and latencies), then all at once from ``--concurrency`` client threads. Reported:
requests/s and p50/p99 latency of the concurrent phase, whether its outputs equal the one-by-one ones, the
KV bytes of one finished request (measured ``kv_bytes`` vs the fp16 reference), and MLX active memory
idle / after, next to the bytes of the prompt caches the server keeps for reuse (mlx_lm's own store for
``none``, which ignores ``kv_cache.reuse``). ``kv_cache.reuse`` is off so every request computes its own prompt. Ratios
are against the ``none`` server measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import veloxquant_mlx  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx import server as S  # noqa: E402
from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cli import parse_set  # noqa: E402


def parse_method(text: str):
    name, _, rest = text.partition(":")
    sets = dict(parse_set(item) for item in rest.split(",") if item)
    return name, sets


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["choices"][0]["message"]["content"], time.perf_counter() - t, out["usage"]


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_method(name, sets, prompts, args):
    kv = S.parse_kv_settings(name, sets)
    httpd, gen = S.make_server(kv, S.server_args(port=0, max_tokens=args.max_tokens),
                               max_prompt_tokens=4 * args.prompt_tokens + 200)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = "http://%s:%d" % httpd.server_address[:2]
    model, tokenizer = gen.model_provider.model, gen.model_provider.tokenizer  # reset at shutdown
    body = lambda p: {"messages": p, "max_tokens": args.max_tokens, "kv_cache": {"reuse": False}}  # noqa: E731
    try:
        post(base, body(prompts[0]))  # warm-up (compiles, allocations)
        mx.clear_cache()
        idle = mx.get_active_memory()
        serial = [post(base, body(p)) for p in prompts]
        with urllib.request.urlopen(base + "/v1/kv/stats") as r:
            stats = json.loads(r.read())
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            together = list(pool.map(lambda p: post(base, body(p)), prompts))
        wall = time.perf_counter() - t0
        time.sleep(0.2)
        mx.clear_cache()
        after = mx.get_active_memory()
        with urllib.request.urlopen(base + "/v1/kv/stats") as r:
            end = json.loads(r.read())
        kept = end["cached_kv_bytes"]
    finally:
        S.shutdown(httpd, gen)
    lat = [t for _, t, _ in together]
    tokens = sum(u["completion_tokens"] for _, _, u in together)
    # KV figures of one request, recomputed here with the server's own accounting
    probe = None
    if name != "none":
        from veloxquant_mlx.cache import KVCacheBuilder
        from veloxquant_mlx.cli import encode_prompt, run_generation

        caches = KVCacheBuilder.for_model(model, kv.config)
        run_generation(model, tokenizer, encode_prompt(tokenizer, prompts[0][0]["content"]), caches,
                       args.max_tokens)
        probe = S.cache_figures(model, caches)
    return {
        "method": name, "settings": sets, "batching": stats["default"]["batching"],
        "requests": len(prompts), "concurrency": args.concurrency,
        "requests_per_s": len(prompts) / wall, "completion_tokens_per_s": tokens / wall,
        "latency_p50_s": statistics.median(lat), "latency_p99_s": percentile(lat, 0.99),
        "serial_latency_p50_s": statistics.median(t for _, t, _ in serial),
        "outputs_equal_one_by_one": [o for o, _, _ in together] == [o for o, _, _ in serial],
        "prompt_tokens_mean": statistics.mean(u["prompt_tokens"] for _, _, u in serial),
        "kv_one_request": probe, "mlx_active_idle": idle, "mlx_active_after": after,
        "kept_prompt_cache_bytes": kept,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="none,kivi:bit_width_inlier=4,turboquant_rvq,snapkv:snap_budget=128")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    text = essays_text()
    chars = args.prompt_tokens * 4
    prompts = [[{"role": "user", "content": text[i * chars:(i + 1) * chars] + "\n\nWhat is this text about?"}]
               for i in range(args.requests)]
    rows = [run_method(*parse_method(m), prompts, args) for m in args.methods.split(",")]
    ref = next((r for r in rows if r["method"] == "none"), None)
    print("| method | batching | req/s | vs none | p50 s | p99 s | equal 1-by-1 | kv_bytes/fp16 | "
          "MLX active idle -> after (kept prompt caches) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["requests_per_s"] / ref["requests_per_s"] if ref else float("nan")
        kv = r["kv_one_request"]
        kvr = f"{kv['kv_bytes'] / kv['kv_bytes_fp16']:.3f}" if kv else "1 (plain)"
        label = r["method"] + "".join(f" {k}={v}" for k, v in r["settings"].items())
        print(f"| {label} | {r['batching']} | {r['requests_per_s']:.2f} | {ratio:.2f}x | {r['latency_p50_s']:.2f} | "
              f"{r['latency_p99_s']:.2f} | {r['outputs_equal_one_by_one']} | {kvr} | "
              f"{r['mlx_active_idle'] / 2**20:.0f} -> {r['mlx_active_after'] / 2**20:.0f} MiB "
              f"({r['kept_prompt_cache_bytes'] / 2**20:.0f} MiB) |")
    if args.out:
        meta = {"machine": f"{platform.machine()} {platform.system()}", "mlx": mx.__version__,
                "device": str(mx.default_device()), "args": vars(args), "date": time.strftime("%Y-%m-%d")}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
