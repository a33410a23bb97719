"""adakv (MiKV-style importance-aware mixed precision): importance-aware tiers vs an importance-blind control with
the same tiers and the same bytes (``AdaKVKVCache.allocation = "uniform"``: a fixed in-group pattern), and KIVI
at 2 and 3 bits, on the embedded SmolLM2-135M with the protocol of ``veloxquant eval --task kld`` (the essay
tokens, ``--context`` prefilled, ``--n-score`` decode steps scored by KL vs the uncompressed cache).

    python scripts/quality_adakv.py [--context 1024] [--n-score 64] [--only attention uniform ...]
"""

from __future__ import annotations

import argparse
import time

from veloxquant_mlx.model import load_model  # first: preloads OpenBLAS before mlx.core

from veloxquant_mlx.cache import KVCacheConfig
from veloxquant_mlx.cache.methods.quantization.adakv import AdaKVKVCache
from veloxquant_mlx.cache.options import AdaKVOptions
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs
from veloxquant_mlx.eval.tasks import text_tokens


def adakv(importance):
    return KVCacheConfig(method="adakv", options=AdaKVOptions(importance=importance))


# name: (config, allocation of AdaKVKVCache while it runs)
CONFIGS = {
    "kivi 2-bit": (KVCacheConfig(method="kivi", bit_width_inlier=2), None),
    "kivi 3-bit": (KVCacheConfig(method="kivi", bit_width_inlier=3), None),
    "adakv 2.5 uniform (control)": (adakv("norm_variance"), "uniform"),
    "adakv 2.5 norm_variance": (adakv("norm_variance"), "importance"),
    "adakv 2.5 norm": (adakv("norm"), "importance"),
    "adakv 2.5 attention": (adakv("attention"), "importance"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n-score", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    model, tok = load_model()
    ids = text_tokens(tok, a.context + a.n_score)
    ref = reference_logprobs(model, ids, a.context, a.n_score)
    print("| setting | KLD | top-1 | kv/fp16 | s |\n|---|---|---|---|---|", flush=True)
    for name, (cfg, allocation) in CONFIGS.items():
        if a.only and not any(o in name for o in a.only):
            continue
        AdaKVKVCache.allocation = allocation or "importance"
        t0 = time.perf_counter()
        r = next_token_fidelity(model, ids, a.context, a.n_score, cfg, ref_logp=ref)
        print(f"| {name} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.kv_bytes / r.kv_bytes_fp16:.3f} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)
    AdaKVKVCache.allocation = "importance"


if __name__ == "__main__":
    main()
