"""Shared by the eviction quality scripts (quality_layers.py, quality_scoring.py): next-token fidelity of
``{name: options_for_budget}`` methods (plus ``{label: (name, options_for_budget)}`` variants) at several
budgets over an essay context, one row per (budget, method). The calling script puts the repository on
``sys.path`` and loads OpenBLAS first."""

from __future__ import annotations

import argparse
import time

from veloxquant_mlx.assets import essays_text
from veloxquant_mlx.cache import KVCacheConfig
from veloxquant_mlx.eval.fidelity import next_token_fidelity
from veloxquant_mlx.model import load_model


def main(methods: dict, variants: dict, description: str, argv=None, label_width: int = 28) -> None:
    """Flags: ``--budgets``, ``--methods``, ``--n-context`` (1024), ``--n-score`` (64), ``--variants``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    ap.add_argument("--n-context", type=int, default=1024)
    ap.add_argument("--n-score", type=int, default=64)
    ap.add_argument("--variants", action="store_true", help="also run paper-like settings")
    args = ap.parse_args(argv)

    model, tokenizer = load_model()
    need = args.n_context + args.n_score
    ids = tokenizer.encode(essays_text(max_chars=12 * need), add_special_tokens=False)[:need]

    runs = [(m, m, methods[m]) for m in args.methods]
    if args.variants:
        runs += [(label, m, make) for label, (m, make) in variants.items() if m in args.methods]

    print(f"SmolLM2-135M, essay context {args.n_context} tokens, {args.n_score} scored decode steps")
    print(f"{'method':<{label_width}} {'budget':>6} {'KLD':>8} {'top1':>6} {'kv/fp16':>8} {'time':>6}")
    for budget in args.budgets:
        for label, method, make in runs:
            t0 = time.perf_counter()
            cfg = KVCacheConfig(method=method, options=make(budget))
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg)
            dt = time.perf_counter() - t0
            print(f"{label:<{label_width}} {budget:>6} {r.kld:>8.4f} {r.top1_agree:>6.3f} "
                  f"{r.kv_bytes / r.kv_bytes_fp16:>8.3f} {dt:>5.0f}s", flush=True)
