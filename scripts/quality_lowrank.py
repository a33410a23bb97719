"""Next-token fidelity of the low-rank / cross-layer methods (SVDq, Palu, KVTC, XQuant) on the embedded SmolLM2-135M, over
an essay context: prefill ``--n-context`` tokens through the method's caches, then score the next
``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints mean next-token KL (nats), top-1
agreement, kv_bytes / kv_bytes_fp16 (bytes really held after the run over mlx_lm's fp16 cache), and
the stored bits per K/V element (everything held, bases and residual buffers included; 16 = fp16).
KIVI rows are printed as references; xquant pairs sharing 4-bit codes hold exactly the bytes of KIVI
2-bit on every layer, the comparison that says whether xquant's cross-layer sharing helps.

    python scripts/quality_lowrank.py            # default settings of each method + a few variants
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
from veloxquant_mlx.cache.options import (  # noqa: E402
    KIVIOptions,
    KVTCOptions,
    PaluOptions,
    SVDqOptions,
    XQuantOptions,
)
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

RUNS = {
    "svdq (default: e=0.95, sched 8,4,2,1,1,0,0,0; V 4-bit KIVI)":
        KVCacheConfig(method="svdq", bit_width_inlier=4, options=SVDqOptions()),
    "svdq (e=0.99, sched 8,8,4,4,2,2,1,1; V 4-bit)":
        KVCacheConfig(method="svdq", bit_width_inlier=4,
                      options=SVDqOptions(energy_threshold=0.99, bit_schedule=(8, 8, 4, 4, 2, 2, 1, 1))),
    "palu (default: e=0.9, 4/2 bits, hi 25%)": KVCacheConfig(method="palu", options=PaluOptions()),
    "palu (e=0.99, 8/4 bits, hi 25%)":
        KVCacheConfig(method="palu", options=PaluOptions(energy_threshold=0.99, hi_bit=8, lo_bit=4)),
    "kvtc (default: 512 bits/token vector)": KVCacheConfig(method="kvtc", options=KVTCOptions()),
    "kvtc (768 bits/token vector)": KVCacheConfig(method="kvtc", options=KVTCOptions(bit_budget=768)),
    "xquant (default: pairs sharing 2-bit codes)": KVCacheConfig(method="xquant", options=XQuantOptions()),
    "xquant (pairs sharing 4-bit codes; the bytes of kivi 2-bit)":
        KVCacheConfig(method="xquant", options=XQuantOptions(base_bits=4)),
    "kivi 4-bit (reference)": KVCacheConfig(method="kivi", bit_width_inlier=4, options=KIVIOptions()),
    "kivi 2-bit (reference)": KVCacheConfig(method="kivi", bit_width_inlier=2, options=KIVIOptions()),
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
    print(f"| {'method':<62} | {'KLD':>7} | {'top1':>5} | {'kv/fp16':>7} | {'bits/elt':>8} | {'time':>5} |")
    print(f"|{'-' * 64}|{'-' * 9}|{'-' * 7}|{'-' * 9}|{'-' * 10}|{'-' * 7}|")
    for label, cfg in RUNS.items():
        if args.only and not any(s in label for s in args.only):
            continue
        t0 = time.time()
        captured = []
        import veloxquant_mlx.eval.fidelity as fid

        orig = fid.make_caches
        fid.make_caches = lambda m, c: captured.append(orig(m, c)) or captured[-1]
        try:
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg, ref_logp=ref)
        finally:
            fid.make_caches = orig
        caches = [c for c in captured[0] if hasattr(c, "used_nbytes")]
        if hasattr(caches[0], "assigned_avg_bits"):
            used = sum(c.compressed_key_bytes + c.compressed_value_bytes for c in caches)
            fp = sum(c.fp16_key_bytes + c.fp16_value_bytes for c in caches)
            bits = f"{16 * used / fp:8.2f}"
        else:
            bits = f"{16 * sum(c.used_nbytes for c in caches) / sum(c.full_seq_bytes for c in caches):8.2f}"
        print(f"| {label:<62} | {r.kld:7.4f} | {r.top1_agree:5.2f} | {r.compression:7.3f} | {bits} | "
              f"{time.time() - t0:4.0f}s |", flush=True)


if __name__ == "__main__":
    main()
