"""Whole-model kv_bytes against fp16, and the fidelity to the plain cache, on every architecture of
``tests/tiny_models.ARCHITECTURES`` (mlx_lm's own model classes, tiny, random weights; no downloads).

For each architecture and method: ``--n-context`` random token ids prefilled in chunks of ``--step``
through ``KVCacheBuilder.for_model``'s caches, then ``--n-score`` decode steps teacher-forced on the same
ids (``eval.fidelity.next_token_fidelity``: mean next-token KL against mlx_lm's own caches, top-1
agreement); kv_bytes (what the caches hold at the end) over ``measure.fp16_kv_bytes`` (mlx_lm's caches at
float16: sliding-window layers count their window). ``before``: the same, had the sliding-window layers
kept mlx_lm's ring at float16 (as for_model did before cache/rotating.py). The sliding layers get a window
of ``--window`` rows (the builders' default, 8, is for the unit tests).

    python scripts/arch_kv_bytes.py                 # the table of docs/RESULTS.md
    python scripts/arch_kv_bytes.py --arch gpt_oss --n-context 1024
"""

from __future__ import annotations

import argparse
import inspect
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
from veloxquant_mlx.cache.rotating import RotatingQuantKVCache  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity  # noqa: E402

METHODS = {
    "kivi-4": KVCacheConfig(method="kivi", bit_width_inlier=4),
    "waterfill-4": KVCacheConfig(method="waterfill", bit_width_inlier=4, options=WaterfillOptions(residual_length=16)),
    "snapkv-64": KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=64)),
    "snapkv-64+waterfill-4": KVCacheConfig(method="snapkv", bit_width_inlier=4, options=SnapKVOptions(
        budget=64, quantize=WaterfillOptions(residual_length=16))),
}


def kinds(model) -> str:
    names = [type(c).__name__.replace("KVCache", "") or "full" for c in make_prompt_cache(model)]
    return " ".join(f"{names.count(n)} {n.lower()}" for n in dict.fromkeys(names))


def before_bytes(caches) -> int:
    """kv_bytes had the compressed rings been mlx_lm's RotatingKVCache at float16 (its window of rows)."""
    def fp16_ring(c):
        H, D, Dv = c._shape
        return c.k_codes.shape[0] * H * c.size() * (D + Dv) * 2

    return sum(fp16_ring(c) if isinstance(c, RotatingQuantKVCache) else c.nbytes for c in caches)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHITECTURES))
    ap.add_argument("--method", action="append", choices=sorted(METHODS))
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--window", type=int, default=128, help="rows of the sliding-window layers")
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--step", type=int, default=64, help="prefill chunk")
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"],
                    help="the models' dtype (float16: mlx_lm's own caches hold float16 rows, as on a GPU; "
                         "gpt_oss stays float32: MLX's CPU gather_mm is float32-only)")
    args = ap.parse_args(argv)
    mx.random.seed(1)
    tokens = mx.random.randint(0, VOCAB, (args.n_context + args.n_score,)).tolist()
    print("| architecture | dtype | layers (mlx_lm) | method | KLD | top-1 | kv_bytes | of fp16 | before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in args.arch or ARCHITECTURES:
        build = ARCHITECTURES[arch]
        model = build(window=args.window) if "window" in inspect.signature(build).parameters else build()
        dtype = "float32" if arch == "gpt_oss" else args.dtype  # MLX's CPU gather_mm (its MoE) is float32-only
        model.set_dtype(getattr(mx, dtype))
        for name in args.method or METHODS:
            held = []
            r = next_token_fidelity(model, tokens, args.n_context, args.n_score, METHODS[name], args.step,
                                    after_prefill=lambda caches, _: held.append(caches))
            before = before_bytes(held[0]) / r.kv_bytes_fp16
            print(f"| {arch} | {dtype} | {kinds(model)} | {name} | {r.kld:.4f} | {r.top1_agree:.2f} | {r.kv_bytes} "
                  f"| {r.kv_fraction_of_fp16:.3f} | {before:.3f} |", flush=True)


if __name__ == "__main__":
    main()
