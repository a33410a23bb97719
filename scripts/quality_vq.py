"""Next-token fidelity of the vector-quantization caches (vecinfer, a2ats where registered) on the
embedded SmolLM2-135M over an essay context.

Prefill ``--n-context`` tokens through the method's caches, then score ``--n-score`` tokens one decode
step at a time against the uncompressed model (``veloxquant_mlx.eval.fidelity.next_token_fidelity``).
Prints mean next-token KL (nats), top-1 agreement and kv_bytes / kv_bytes_fp16 (bytes really held
after the run over mlx_lm's plain fp16 cache for the same tokens).

    python scripts/quality_vq.py
    python scripts/quality_vq.py --methods vecinfer
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache import options as O  # noqa: E402
from veloxquant_mlx.cache.base import method_info  # noqa: E402
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)  # key_sub_dim & co. are shared flat fields

CONFIGS = {
    "vecinfer[K 4d/12b, V 8d/8b] (2 bits/coord)": ("vecinfer", lambda: KVCacheConfig(
        method="vecinfer", options=O.VecInferOptions())),
    "vecinfer[K 4d/8b, V 4d/8b] (2/2 bits/coord)": ("vecinfer", lambda: KVCacheConfig(
        method="vecinfer", key_codebook_bits=8, value_sub_dim=4, value_codebook_bits=8, options=O.VecInferOptions())),
    "a2ats[default, 20% + W=128]": ("a2ats", lambda: KVCacheConfig(method="a2ats", options=O.A2ATSOptions())),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    for label, (method, make) in CONFIGS.items():
        if args.methods and method not in args.methods:
            continue
        if not method_info(method).implemented:
            print(f"| {label} | not registered | | | |")
            continue
        t = time.time()
        r = next_token_fidelity(model, ids, args.n_context, args.n_score, make(), ref_logp=ref)
        print(f"| {label} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {time.time() - t:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
