"""Next-token fidelity of the cross-layer methods (MiniCache; xKV when registered) on the embedded
SmolLM2-135M, over an essay context: prefill ``--n-context`` tokens through the method's caches,
then score the next ``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints mean next-token KL (nats), top-1
agreement, kv_bytes / kv_bytes_fp16 (bytes really held after the run over mlx_lm's fp16 cache), the
stored bits per K/V element over every full-KV layer (filled parts, float16 windows included; 16 =
fp16) and, for MiniCache, the retention rate of the merge layers.

    python scripts/quality_crosslayer.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.options import MiniCacheOptions, XKVOptions  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

RUNS = {
    "minicache (default: from 1/2 depth, theta 0.9, t 0.5)":
        KVCacheConfig(method="minicache", options=MiniCacheOptions()),
    "minicache (from 1/2 depth, theta 0: merge cos >= 0)":
        KVCacheConfig(method="minicache", options=MiniCacheOptions(retention_threshold=0.0)),
    "minicache (from 1/2 depth, theta 0.99)":
        KVCacheConfig(method="minicache", options=MiniCacheOptions(retention_threshold=0.99)),
    "minicache (from 1/2 depth, theta -1: merge everything)":
        KVCacheConfig(method="minicache", options=MiniCacheOptions(retention_threshold=-1.0)),
    "xkv (default: pairs, energy 0.95, 4-bit latents)": KVCacheConfig(method="xkv", options=XKVOptions()),
    "xkv (pairs, rank 64, 4-bit latents)": KVCacheConfig(method="xkv", options=XKVOptions(rank=64)),
    "xkv per-layer SVD (group 1, rank 32, 4-bit; same latent bytes)":
        KVCacheConfig(method="xkv", options=XKVOptions(group_size=1, rank=32)),
    "xkv per-layer SVD (group 1, rank 40, 4-bit; ~same total bytes)":
        KVCacheConfig(method="xkv", options=XKVOptions(group_size=1, rank=40)),
    "xkv (groups of 4, rank 96, 4-bit latents)": KVCacheConfig(method="xkv", options=XKVOptions(group_size=4, rank=96)),
    "xkv per-layer SVD (group 1, rank 24, 4-bit; same latent bytes)":
        KVCacheConfig(method="xkv", options=XKVOptions(group_size=1, rank=24)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of run labels to keep")
    args = ap.parse_args(argv)
    model, tokenizer = load_model()
    need = args.n_context + args.n_score
    ids = tokenizer.encode(essays_text(max_chars=12 * need), add_special_tokens=False)[:need]
    ref = reference_logprobs(model, ids, args.n_context, args.n_score)
    print(f"SmolLM2-135M, essay context {args.n_context} tokens, {args.n_score} scored decode steps")
    print(f"| {'method':<56} | {'KLD':>7} | {'top1':>5} | {'kv/fp16':>7} | {'bits/elt':>8} | {'ret':>5} | {'time':>5} |")
    print(f"|{'-' * 58}|{'-' * 9}|{'-' * 7}|{'-' * 9}|{'-' * 10}|{'-' * 7}|{'-' * 7}|")
    import veloxquant_mlx.eval.fidelity as fid

    for label, cfg in RUNS.items():
        if args.only and not any(s in label for s in args.only):
            continue
        t0 = time.time()
        captured = []
        orig = fid.make_caches
        fid.make_caches = lambda m, c: captured.append(orig(m, c)) or captured[-1]
        try:
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg, ref_logp=ref)
        finally:
            fid.make_caches = orig
        caches = [c for c in captured[0] if hasattr(c, "used_nbytes")]
        bits = 16 * sum(c.used_nbytes for c in caches) / sum(c.full_seq_bytes for c in caches)
        merges = [c for c in caches if getattr(c, "role", "") == "merge"]
        ret = sum(c.n_retained for c in merges) / max(1, sum(c.n_retained + c.n_merged for c in merges))
        print(f"| {label:<56} | {r.kld:7.4f} | {r.top1_agree:5.2f} | {r.compression:7.3f} | {bits:8.2f} | "
              f"{ret:5.2f} | {time.time() - t0:4.0f}s |", flush=True)


if __name__ == "__main__":
    main()
