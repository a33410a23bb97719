"""The project's 4-bit-class target on the embedded SmolLM2-135M: whole-cache bytes <= 0.30x the fp16
KV bytes of the same tokens with next-token KLD <= 0.002 nats. Measures the closest configurations of
the existing methods (set through ``KVCacheConfig`` fields / options only; no method default changed)
at several context lengths.

Protocol (as ``scripts/quality_quant_a.py``): the first ``context + n_score`` tokens of the Paul Graham
essays; ``context - 1`` tokens are prefilled through the caches (one chunk up to 2048), then ``n_score``
tokens are fed one decode step at a time and each step's next-token distribution is compared with the
uncompressed model's (``veloxquant_mlx.eval.fidelity.next_token_fidelity``). kv/fp16 = sum of the
caches' ``nbytes`` after the run (everything held: float16 windows/residuals, sink rows, scales,
norms, spare capacity, shared constants) over mlx_lm's plain fp16 cache for the same tokens.

    python scripts/quality_target4.py                       # every config at 512, 1024 and 2048
    python scripts/quality_target4.py --contexts 1024 --configs tq_k10v16_r1 kivi_sink4
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
from veloxquant_mlx.cache import options as O  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

TARGET_KLD, TARGET_BYTES = 0.002, 0.30


def _tq(kb, ks, vb, vs, r):
    return lambda: KVCacheConfig(method="turboquant_rvq", options=O.TurboQuantRVQOptions(
        key_sub_dim=ks, key_codebook_bits=kb, value_sub_dim=vs, value_codebook_bits=vb, residual_length=r))


# name: (label, config factory)
CONFIGS = {
    "tq_k10v16_r1": ("turboquant_rvq K10/2 V16/4, residual_length=1", _tq(10, 2, 16, 4, 1)),
    "tq_k10v16_r32": ("turboquant_rvq K10/2 V16/4, residual_length=32", _tq(10, 2, 16, 4, 32)),
    "tq_k10v16_r128": ("turboquant_rvq K10/2 V16/4, residual_length=128", _tq(10, 2, 16, 4, 128)),
    "tq_k10v12_r1": ("turboquant_rvq K10/2 V12/4, residual_length=1", _tq(10, 2, 12, 4, 1)),
    "waterfill4_r16": ("waterfill 4-bit, residual_length=16", lambda: KVCacheConfig(
        method="waterfill", bit_width_inlier=4, options=O.WaterfillOptions(residual_length=16))),
    "waterfill4_r32": ("waterfill 4-bit, residual_length=32", lambda: KVCacheConfig(
        method="waterfill", bit_width_inlier=4, options=O.WaterfillOptions(residual_length=32))),
    "kivi_sink4": ("kivi_sink 4-bit, G=32, 5 sinks", lambda: KVCacheConfig(
        method="kivi_sink", bit_width_inlier=4, options=O.KIVISinkOptions())),
    "kivi4": ("kivi 4-bit, G=32", lambda: KVCacheConfig(method="kivi", bit_width_inlier=4)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 1024, 2048])
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args(argv)
    model, tok = load_model()
    print(f"target: KLD <= {TARGET_KLD} nats at kv/fp16 <= {TARGET_BYTES}")
    print("| config | context | KLD (nats) | top-1 | kv/fp16 (whole cache) | meets | s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for ctx in args.contexts:
        n = ctx + args.n_score
        ids = tok.encode(essays_text(max_chars=8 * n), add_special_tokens=False)[:n]
        ref = reference_logprobs(model, ids, ctx, args.n_score)
        for name in args.configs:
            label, make = CONFIGS[name]
            t = time.time()
            r = next_token_fidelity(model, ids, ctx, args.n_score, make(), ref_logp=ref)
            ok = "yes" if (r.kld <= TARGET_KLD and r.compression <= TARGET_BYTES) else "no"
            print(f"| {label} | {ctx} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {ok} | "
                  f"{time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
