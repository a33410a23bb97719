"""Whole-model kv_bytes against fp16, and the fidelity to the plain cache, on every architecture of
``tests/tiny_models.ARCHITECTURES`` (mlx_lm's own model classes, tiny, random weights, float32; no downloads).

For each architecture and method: ``--n-context`` random token ids prefilled in chunks of ``--step``
through ``KVCacheBuilder.for_model``'s caches, then ``--n-score`` decode steps teacher-forced on the same
ids (``eval.fidelity.next_token_fidelity``: mean next-token KL against mlx_lm's own caches, top-1
agreement); kv_bytes (what the caches hold at the end) over ``measure.fp16_kv_bytes`` (mlx_lm's caches at
float16: sliding-window layers count their window). ``compressed`` lists the layers' cache kinds.

    python scripts/arch_kv_bytes.py                 # the table of docs/RESULTS.md
    python scripts/arch_kv_bytes.py --arch gpt_oss --n-context 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from tiny_models import ARCHITECTURES, VOCAB  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig, SnapKVOptions, WaterfillOptions  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity  # noqa: E402

METHODS = {
    "kivi-4": KVCacheConfig(method="kivi", bit_width_inlier=4),
    "waterfill-4": KVCacheConfig(method="waterfill", bit_width_inlier=4, options=WaterfillOptions(residual_length=16)),
    "snapkv-64": KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=64)),
}


def kinds(model) -> str:
    names = [type(c).__name__.replace("KVCache", "") or "full" for c in make_prompt_cache(model)]
    return " ".join(f"{names.count(n)} {n.lower()}" for n in dict.fromkeys(names))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHITECTURES))
    ap.add_argument("--method", action="append", choices=sorted(METHODS))
    ap.add_argument("--n-context", type=int, default=256)
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--step", type=int, default=64, help="prefill chunk")
    args = ap.parse_args(argv)
    mx.random.seed(1)
    tokens = mx.random.randint(0, VOCAB, (args.n_context + args.n_score,)).tolist()
    print("| architecture | layers (mlx_lm) | method | layers (ours) | KLD | top-1 | kv_bytes | fp16 | of fp16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in args.arch or ARCHITECTURES:
        model = ARCHITECTURES[arch]()
        for name in args.method or METHODS:
            r = next_token_fidelity(model, tokens, args.n_context, args.n_score, METHODS[name], args.step)
            from veloxquant_mlx.eval.fidelity import make_caches

            ours = sorted({type(c).__name__ for c in make_caches(model, METHODS[name])})
            print(f"| {arch} | {kinds(model)} | {name} | {', '.join(ours)} | {r.kld:.4f} | {r.top1_agree:.2f} "
                  f"| {r.kv_bytes} | {r.kv_bytes_fp16} | {r.kv_fraction_of_fp16:.3f} |", flush=True)


if __name__ == "__main__":
    main()
