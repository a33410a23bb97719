"""Next-token fidelity of CacheGen and AMC on the embedded SmolLM2-135M over an essay context, plus
CacheGen's saved-form sizes.

Prefill ``--n-context`` tokens through the method's caches, then score ``--n-score`` tokens one decode
step at a time against the uncompressed model (``veloxquant_mlx.eval.fidelity.next_token_fidelity``).
Prints mean next-token KL (nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes held in memory
after the run over mlx_lm's plain fp16 cache). For CacheGen it then prefills the context once more
and reports, summed over layers, the bytes of the quantized tokens in the saved entropy-coded form vs
the in-memory fixed-width form vs float16 (``compressed_*_bytes``, ``fixed_width_*_bytes``,
``fp16_*_bytes``: real arrays and real encoded bytes).

    python scripts/quality_quant_c.py
    python scripts/quality_quant_c.py --methods cachegen
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

from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache import options as O  # noqa: E402
from veloxquant_mlx.cache.base import method_info  # noqa: E402
from veloxquant_mlx.eval.fidelity import make_caches, next_token_fidelity, prefill, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

CONFIGS = {
    "cachegen[4b, 3 layer groups: 6/5/4b, delta]": ("cachegen", lambda: KVCacheConfig(
        method="cachegen", options=O.CacheGenOptions())),
    "cachegen[2b, 3 layer groups: 4/3/2b, delta]": ("cachegen", lambda: KVCacheConfig(
        method="cachegen", options=O.CacheGenOptions(bits=2))),
    "cachegen[2b uniform, delta]": ("cachegen", lambda: KVCacheConfig(
        method="cachegen", options=O.CacheGenOptions(bits=2, layer_groups=1))),
    "cachegen[2b uniform, no delta]": ("cachegen", lambda: KVCacheConfig(
        method="cachegen", options=O.CacheGenOptions(bits=2, layer_groups=1, use_delta=False))),
    "cachegen[2b, pooled tables]": ("cachegen", lambda: KVCacheConfig(
        method="cachegen", options=O.CacheGenOptions(bits=2, per_channel=False))),
    "amc[20% 8b / 30% 4b / 50% 2b]": ("amc", lambda: KVCacheConfig(method="amc", options=O.AMCOptions())),
    "amc[10% 8b / 20% 4b / 70% 2b]": ("amc", lambda: KVCacheConfig(
        method="amc", options=O.AMCOptions(k_high=0.1, k_mid=0.2))),
}


def saved_sizes(model, ids, n_context, config):
    caches = make_caches(model, config)
    prefill(model, mx.array(ids[:n_context])[None], caches, 512)
    ours = [c for c in caches if hasattr(c, "compressed_key_bytes")]
    tot = {k: sum(getattr(c, f"{k}_key_bytes") + getattr(c, f"{k}_value_bytes") for c in ours)
           for k in ("compressed", "fixed_width", "fp16")}
    return tot, sum(c.entropy_savings for c in ours) / len(ours)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--methods", nargs="*", default=None, help="method names to run (default: all registered)")
    ap.add_argument("--no-kld", action="store_true", help="only CacheGen's saved sizes")
    args = ap.parse_args(argv)
    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=8 * (args.n_context + args.n_score)),
                     add_special_tokens=False)[: args.n_context + args.n_score]
    if not args.no_kld:
        ref = reference_logprobs(model, ids, args.n_context, args.n_score)
        print("| config | KLD (nats) | top-1 | kv_bytes / fp16 | s |")
        print("|---|---|---|---|---|")
        for label, (method, make) in CONFIGS.items():
            if args.methods and method not in args.methods:
                continue
            if not method_info(method).implemented:
                print(f"| {label} | not registered | | | |")
                continue
            t = time.time()
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, make(), ref_logp=ref)
            print(f"| {label} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {time.time() - t:.0f} |",
                  flush=True)
    print("\n| cachegen config | saved entropy-coded / fixed-width | fixed-width / fp16 | mean key entropy_savings |")
    print("|---|---|---|---|")
    for label, (method, make) in CONFIGS.items():
        if method != "cachegen" or (args.methods and method not in args.methods):
            continue
        tot, sav = saved_sizes(model, ids, args.n_context, make())
        print(f"| {label} | {tot['compressed'] / tot['fixed_width']:.3f} | {tot['fixed_width'] / tot['fp16']:.3f} "
              f"| {sav:.3f} |", flush=True)


if __name__ == "__main__":
    main()
