"""Shared by the per-family quality scripts (quality_quant_a.py, quality_anchor_nsn.py, quality_vq.py):
one next-token-fidelity table over an essay context for a ``{label: (method, make_config)}`` table."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cache.base import method_info  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402


def main(configs: dict, description: str, argv=None) -> None:
    """Prefill ``--n-context`` essay tokens, score ``--n-score`` decode steps against the uncompressed
    model, and print one row per config: KLD (nats), top-1 agreement, kv_bytes / fp16, seconds."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--methods", nargs="*", default=None, help="method names to run (default: all registered)")
    args = ap.parse_args(argv)
    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=8 * (args.n_context + args.n_score)),
                     add_special_tokens=False)[: args.n_context + args.n_score]
    ref = reference_logprobs(model, ids, args.n_context, args.n_score)
    print("| config | KLD (nats) | top-1 | kv_bytes / fp16 | s |")
    print("|---|---|---|---|---|")
    for label, (method, make) in configs.items():
        if args.methods and method not in args.methods:
            continue
        if not method_info(method).implemented:
            print(f"| {label} | not registered | | | |")
            continue
        t = time.time()
        r = next_token_fidelity(model, ids, args.n_context, args.n_score, make(), ref_logp=ref)
        print(f"| {label} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {time.time() - t:.0f} |",
              flush=True)
