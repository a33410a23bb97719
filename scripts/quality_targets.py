"""The project's quality targets on the embedded SmolLM2-135M, whole-cache bytes vs the fp16 KV bytes of
the same tokens and next-token KLD: 4-bit class <= 0.30x with KLD <= 0.002 nats, 2-bit class <= 0.17x
with KLD <= 0.08. Measures configurations of the methods (set through ``KVCacheConfig`` fields /
options only; no method default changed) at several context lengths; each configuration is judged
against the target of its class.

Protocol (as ``scripts/quality_quant_a.py``): the first ``context + n_score`` tokens of the Paul Graham
essays; ``context - 1`` tokens are prefilled through the caches (one chunk up to 2048), then ``n_score``
tokens are fed one decode step at a time and each step's next-token distribution is compared with the
uncompressed model's (``veloxquant_mlx.eval.fidelity.next_token_fidelity``). kv/fp16 = sum of the
caches' ``nbytes`` after the run (everything held: float16 windows/residuals, sink rows, scales,
norms, spare capacity, shared constants) over mlx_lm's plain fp16 cache for the same tokens.

    python scripts/quality_targets.py                       # every config at 512, 1024 and 2048
    python scripts/quality_targets.py --contexts 1024 --configs waterfill4_r16 kivi_sink4
"""

from __future__ import annotations

import argparse
import contextlib
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

import numpy as np  # noqa: E402

TARGETS = {4: (0.002, 0.30), 2: (0.08, 0.17)}  # class: (max KLD, max kv/fp16)


def _tq(kb, ks, vb, vs, r):
    return lambda: KVCacheConfig(method="turboquant_rvq", options=O.TurboQuantRVQOptions(
        key_sub_dim=ks, key_codebook_bits=kb, value_sub_dim=vs, value_codebook_bits=vb, residual_length=r))


def _wf(bits, r):
    return lambda: KVCacheConfig(method="waterfill", bit_width_inlier=bits,
                                 options=O.WaterfillOptions(residual_length=r))


def _ablation(what):
    """waterfill 4-bit, 16-row window, with one ingredient removed (``what``): "post_rope" (keys
    quantized after RoPE), "no_queries" (channel weights all equal instead of the queries' energy),
    "uniform_widths" (4 bits on every key channel). Applied to the caches the harness builds."""
    from veloxquant_mlx.cache.methods.quantization import waterfill as wf
    from veloxquant_mlx.eval import fidelity

    class Patched:
        def __enter__(self):
            self.make, self.alloc = fidelity.make_caches, wf.allocate_bits

            def make(model, config):
                caches = self.make(model, config)
                for c in caches:
                    if what == "post_rope":
                        c.rope = None
                    if what == "no_queries":
                        c._observe = lambda queries: None
                return caches

            fidelity.make_caches = make
            if what == "uniform_widths":
                wf.allocate_bits = lambda s, total: np.full(np.shape(s), total // np.shape(s)[1])
            return self

        def __exit__(self, *exc):
            fidelity.make_caches, wf.allocate_bits = self.make, self.alloc

    return Patched()


# name: (label, config factory[, class[, patch]]); class 4 unless given; ``patch`` a context manager
# applied while the configuration runs (ablations)
CONFIGS = {
    "tq_k10v16_r1": ("turboquant_rvq K10/2 V16/4, residual_length=1", _tq(10, 2, 16, 4, 1)),
    "tq_k10v16_r32": ("turboquant_rvq K10/2 V16/4, residual_length=32", _tq(10, 2, 16, 4, 32)),
    "tq_k10v16_r128": ("turboquant_rvq K10/2 V16/4, residual_length=128", _tq(10, 2, 16, 4, 128)),
    "tq_k10v12_r1": ("turboquant_rvq K10/2 V12/4, residual_length=1", _tq(10, 2, 12, 4, 1)),
    "waterfill4_r16": ("waterfill 4-bit, residual_length=16", _wf(4, 16)),
    "waterfill4_r32": ("waterfill 4-bit, residual_length=32", _wf(4, 32)),
    "waterfill2_r16": ("waterfill 2-bit, residual_length=16", _wf(2, 16), 2),
    "waterfill2_r32": ("waterfill 2-bit, residual_length=32", _wf(2, 32), 2),
    "waterfill2_r64": ("waterfill 2-bit, residual_length=64", _wf(2, 64), 2),
    "tq_defaults": ("turboquant_rvq defaults (K12/4 V8/8, residual_length=128)",
                    lambda: KVCacheConfig(method="turboquant_rvq"), 2),
    "waterfill4_post_rope": ("waterfill 4-bit, r=16, keys quantized after RoPE", _wf(4, 16), 4, "post_rope"),
    "waterfill4_no_queries": ("waterfill 4-bit, r=16, equal channel weights (no queries)", _wf(4, 16), 4,
                              "no_queries"),
    "waterfill4_uniform": ("waterfill 4-bit, r=16, 4 bits on every key channel", _wf(4, 16), 4, "uniform_widths"),
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
    for cls, (kld, size) in TARGETS.items():
        print(f"{cls}-bit class target: KLD <= {kld} nats at kv/fp16 <= {size}")
    print("| config | class | context | KLD (nats) | top-1 | kv/fp16 (whole cache) | meets | s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for ctx in args.contexts:
        n = ctx + args.n_score
        ids = tok.encode(essays_text(max_chars=8 * n), add_special_tokens=False)[:n]
        ref = reference_logprobs(model, ids, ctx, args.n_score)
        for name in args.configs:
            label, make, *rest = CONFIGS[name]
            cls = rest[0] if rest else 4
            max_kld, max_bytes = TARGETS[cls]
            t = time.time()
            with (_ablation(rest[1]) if len(rest) > 1 else contextlib.nullcontext()):
                r = next_token_fidelity(model, ids, ctx, args.n_score, make(), ref_logp=ref)
            ok = "yes" if (r.kld <= max_kld and r.compression <= max_bytes) else "no"
            print(f"| {label} | {cls}-bit | {ctx} | {r.kld:.4f} | {r.top1_agree:.3f} | {r.compression:.3f} | {ok} | "
                  f"{time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
