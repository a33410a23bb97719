"""KLD cost of holding an eviction budget while generating (``decode_evict``), on the embedded
SmolLM2-135M.

A ``--n-context``-token essay prompt is followed by ``--n-gen`` tokens the uncompressed model generates
greedily (its own long answer). Each cache then prefills the prompt and is fed the generated tokens one
decode step at a time (``veloxquant_mlx.eval.fidelity.next_token_fidelity``); the table gives the mean
next-token KL divergence against the uncompressed model over the generated tokens, top-1 agreement, and
kv_bytes / fp16 bytes at the end (what the caches really hold after prompt + generation).
``--text`` scores the essay's own continuation instead of the generated one.

    python scripts/decode_budget_kld.py                      # 512 + 512, budget 256
    python scripts/decode_budget_kld.py --budget 128 --n-gen 1024
    python scripts/decode_budget_kld.py --methods snapkv --no-plain   # one method (runs in parallel)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.assets import essays_text  # noqa: E402
from veloxquant_mlx.cache import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache import options as opt  # noqa: E402
from veloxquant_mlx.eval import fidelity  # noqa: E402
from veloxquant_mlx.model import load_model  # noqa: E402

METHODS = {
    "snapkv": lambda b: opt.SnapKVOptions(budget=b),
    "h2o": lambda b: opt.H2OOptions(budget=b),
    "tova": lambda b: opt.TOVAOptions(budget=b),
    "pyramidkv": lambda b: opt.PyramidKVOptions(budget=b),
}


def with_decode_evict(config: KVCacheConfig, value: bool):
    """``config`` with ``decode_evict`` set: through the config field when it exists, else on each
    cache as ``for_model`` builds it."""
    if "decode_evict" in {f.name for f in dataclasses.fields(KVCacheConfig)}:
        return config.replace(decode_evict=value), None
    return config, value


def greedy_continuation(model, prompt, n):
    cache = make_prompt_cache(model)
    tok = model(mx.array([prompt]), cache=cache)[0, -1].argmax()
    out = []
    for _ in range(n):
        out.append(tok)
        tok = model(tok.reshape(1, 1), cache=cache)[0, -1].argmax()
        if len(out) % 32 == 0:
            mx.eval(out)
    return [int(t) for t in mx.stack(out).tolist()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=512)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--text", action="store_true", help="score the essay's continuation, not a generated one")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-cache row (KLD 0 by definition)")
    args = ap.parse_args(argv)

    model, tokenizer = load_model()
    need = args.n_context + args.n_gen
    ids = tokenizer.encode(essays_text(max_chars=12 * need), add_special_tokens=False)
    prompt = ids[: args.n_context]
    tokens = ids[:need] if args.text else prompt + greedy_continuation(model, prompt, args.n_gen)
    ref = fidelity.reference_logprobs(model, tokens, args.n_context, args.n_gen)

    print(f"SmolLM2-135M, {args.n_context}-token essay prompt + {args.n_gen} "
          f"{'essay' if args.text else 'generated'} tokens, budget {args.budget}")
    print(f"{'cache':<22} {'KLD':>8} {'top1':>6} {'kv/fp16':>8} {'time':>6}")
    runs = [] if args.no_plain else [("plain (none)", None, None)]
    for m in args.methods:
        for on in (False, True):
            runs.append((f"{m} decode_evict={'on' if on else 'off'}", m, on))
    orig = fidelity.make_caches
    for label, method, on in runs:
        cfg, per_cache = (None, None) if method is None else with_decode_evict(
            KVCacheConfig(method=method, options=METHODS[method](args.budget)), on)

        def make(model, config, _v=per_cache):
            caches = orig(model, config)
            if _v is not None:
                for c in caches:
                    if hasattr(c, "decode_evict"):
                        c.decode_evict = _v
            return caches

        fidelity.make_caches = make
        t0 = time.perf_counter()
        try:
            r = fidelity.next_token_fidelity(model, tokens, args.n_context, args.n_gen, cfg, ref_logp=ref)
        finally:
            fidelity.make_caches = orig
        print(f"{label:<22} {r.kld:>8.4f} {r.top1_agree:>6.3f} {r.kv_bytes / r.kv_bytes_fp16:>8.3f} "
              f"{time.perf_counter() - t0:>5.0f}s", flush=True)


if __name__ == "__main__":
    main()
