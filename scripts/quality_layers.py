"""Next-token fidelity of the layer-budget eviction methods (PyramidKV, SqueezeAttention, ChunkKV, CaM)
on the embedded SmolLM2-135M, over an essay context.

For each method and budget: prefill ``--n-context`` tokens through the method's caches (built by
``KVCacheBuilder.for_model``, so per-layer budgets and coordinators are in place), then score the next
``--n-score`` tokens one decode step at a time against the uncompressed model
(``veloxquant_mlx.eval.fidelity.next_token_fidelity``). Prints the mean next-token KL divergence (nats),
top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes the caches really hold after the run over mlx_lm's
plain fp16 cache for the same tokens). ``budget`` is the per-layer average (PyramidKV, Squeeze) or
per-layer budget (ChunkKV, CaM). SnapKV at the same budget is printed as a reference row;
``--variants`` adds paper-like settings as extra rows.

    python scripts/quality_layers.py                 # budgets 256 and 512 of a 1024-token context
    python scripts/quality_layers.py --variants      # + paper-like settings
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
    CaMOptions,
    ChunkKVOptions,
    PyramidKVOptions,
    SnapKVOptions,
    SqueezeOptions,
)
from veloxquant_mlx.eval.fidelity import next_token_fidelity  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

METHODS = {
    "pyramidkv": lambda b: PyramidKVOptions(budget=b),
    "squeeze": lambda b: SqueezeOptions(budget=b),
    "chunkkv": lambda b: ChunkKVOptions(budget=b),
    "cam": lambda b: CaMOptions(budget=b),
    "snapkv": lambda b: SnapKVOptions(budget=b),  # reference: uniform budget, prompt-only
}

# Paper-like settings (extra rows with --variants).
VARIANTS = {
    "pyramidkv[beta=20]": ("pyramidkv", lambda b: PyramidKVOptions(budget=b, beta=20.0)),
    "squeeze[strength=2]": ("squeeze", lambda b: SqueezeOptions(budget=b, strength=2.0)),
    "chunkkv[chunk=10, reuse=2]": ("chunkkv", lambda b: ChunkKVOptions(budget=b, chunk_size=10, reuse_layers=2)),
    "chunkkv[key_norm]": ("chunkkv", lambda b: ChunkKVOptions(budget=b, score="key_norm")),
    "cam[mean]": ("cam", lambda b: CaMOptions(budget=b, merge="mean")),
    "cam[drop]": ("cam", lambda b: CaMOptions(budget=b, merge="drop")),
    "cam[no gate]": ("cam", lambda b: CaMOptions(budget=b, merge_gate=False)),
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
    print(f"{'method':<28} {'budget':>6} {'KLD':>8} {'top1':>6} {'kv/fp16':>8} {'time':>6}")
    for budget in args.budgets:
        for label, method, make in runs:
            t0 = time.perf_counter()
            cfg = KVCacheConfig(method=method, options=make(budget))
            r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg)
            dt = time.perf_counter() - t0
            print(f"{label:<28} {budget:>6} {r.kld:>8.4f} {r.top1_agree:>6.3f} "
                  f"{r.kv_bytes / r.kv_bytes_fp16:>8.3f} {dt:>5.0f}s", flush=True)


if __name__ == "__main__":
    main()
