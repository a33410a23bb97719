"""Next-token fidelity of KVQuant, GEAR and AdaKV (and KIVI at the same bits, for reference) on the embedded
SmolLM2-135M: 512-token essay context, 32 scored decode tokens, KL vs the uncompressed cache.

    python scripts/quality_quant_b.py [--n-context 512] [--n-score 32]
"""

from __future__ import annotations

import argparse
import time

from veloxquant_mlx.model import load_model  # first: preloads OpenBLAS before mlx.core

from veloxquant_mlx.assets import essays_text
from veloxquant_mlx.cache import KVCacheConfig
from veloxquant_mlx.cache.options import AdaKVOptions, GEAROptions, KVQuantOptions
from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs

CONFIGS = {
    "kvquant-3b": KVCacheConfig(method="kvquant", options=KVQuantOptions(bits=3)),
    "kvquant-2b": KVCacheConfig(method="kvquant", options=KVQuantOptions(bits=2)),
    "kivi-2b (ref)": KVCacheConfig(method="kivi", bit_width_inlier=2),
    "gear-2b (rank auto)": KVCacheConfig(method="gear", options=GEAROptions(bits=2)),
    "adakv-2.5b (2/3/4)": KVCacheConfig(method="adakv", options=AdaKVOptions(target_avg_bits=2.5)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-score", type=int, default=32)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=8 * (a.n_context + a.n_score)), add_special_tokens=False)
    ids = ids[: a.n_context + a.n_score]
    ref = reference_logprobs(model, ids, a.n_context, a.n_score)
    print(f"| method | KLD | top-1 | kv_bytes / fp16 | s |\n|---|---|---|---|---|")
    for name, cfg in CONFIGS.items():
        if a.only and not any(o in name for o in a.only):
            continue
        t = time.time()
        r = next_token_fidelity(model, ids, a.n_context, a.n_score, cfg, ref_logp=ref)
        print(f"| {name} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {time.time() - t:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
