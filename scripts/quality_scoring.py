"""Next-token fidelity of the attention-scoring eviction methods (H2O, TOVA, K-norm, Keyformer,
MorphKV) on the embedded SmolLM2-135M, over an essay context.

For each method and budget: prefill ``--n-context`` tokens through the method's caches, then score
the next ``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints the mean next-token KL divergence
(nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes the caches really hold after the run over
mlx_lm's plain fp16 cache for the same tokens). Methods run with their default options except the
budget; ``--variants`` adds paper-like settings as extra rows.

    python scripts/quality_scoring.py                 # budgets 256 and 512 of a 1024-token context
    python scripts/quality_scoring.py --variants      # + paper-like settings
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
    H2OOptions,
    KeyformerOptions,
    KNormOptions,
    MorphKVOptions,
    TOVAOptions,
)
from veloxquant_mlx.eval.fidelity import next_token_fidelity  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

METHODS = {
    "h2o": lambda b: H2OOptions(budget=b),
    "tova": lambda b: TOVAOptions(budget=b),
    "knorm": lambda b: KNormOptions(budget=b),
    "keyformer": lambda b: KeyformerOptions(budget=b),
    "morphkv": lambda b: MorphKVOptions(budget=b),
}

# Paper-like settings (extra rows with --variants).
VARIANTS = {
    "h2o[paper: decay=1, recent=b/2]": ("h2o", lambda b: H2OOptions(budget=b, decay=1.0, grace=b // 2)),
    "keyformer[recent=b/4, tau 1->2]": ("keyformer", lambda b: KeyformerOptions(
        budget=b, recent=b // 4, tau_init=1.0, tau_end=2.0, anneal_steps=64)),
    "knorm[recent=32]": ("knorm", lambda b: KNormOptions(budget=b, recent=32)),
    "morphkv[window=32]": ("morphkv", lambda b: MorphKVOptions(budget=b, window=32)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--n-context", type=int, default=1024)
    ap.add_argument("--n-score", type=int, default=64)
    ap.add_argument("--variants", action="store_true", help="also run paper-like settings")
    args = ap.parse_args(argv)

    model, tokenizer = load_model()
    need = args.n_context + args.n_score
    ids = tokenizer.encode(essays_text(max_chars=12 * need), add_special_tokens=False)[:need]

    runs = [(m, m, METHODS[m]) for m in args.methods]
    if args.variants:
        runs += [(label, m, make) for label, (m, make) in VARIANTS.items() if m in args.methods]

    print(f"SmolLM2-135M, essay context {args.n_context} tokens, {args.n_score} scored decode steps")
    print(f"{'method':<34} {'budget':>6} {'KLD':>8} {'top1':>6} {'kv/fp16':>8} {'time':>6}")
    for budget in args.budgets:
        for label, method, make in runs:
            t0 = time.perf_counter()
            cfg = KVCacheConfig(method=method, options=make(budget))
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg)
            dt = time.perf_counter() - t0
            print(f"{label:<34} {budget:>6} {r.kld:>8.4f} {r.top1_agree:>6.3f} "
                  f"{r.kv_bytes / r.kv_bytes_fp16:>8.3f} {dt:>5.0f}s", flush=True)


if __name__ == "__main__":
    main()
