"""Next-token fidelity of the query-aware eviction methods (Q-Filters, KVzip, CurDKV, NestedKV, RocketKV)
on the embedded SmolLM2-135M, for a 1024-token essay context at budgets 256 and 512 (25% / 50%).

    python scripts/quality_query.py [--n-context 1024] [--n-score 64] [--budgets 256 512] [--methods ...]

For each method and budget it prints the mean next-token KL divergence against the uncompressed cache,
the top-1 agreement and kv_bytes / kv_bytes_fp16, all from ``veloxquant_mlx.eval.fidelity``. KVzip is
run twice: with its reconstruction pass (``compress_with_model`` right after the prefill; the fidelity
loop is ``next_token_fidelity``'s with that one step added) and without it (plain
``next_token_fidelity``; importance = max attention from the prompt's own queries). RocketKV has no
token budget: its compression ratio is set to n_context / budget, the paper's convention (the budget
is the number of tokens each decode step attends to); its stored rows are ceil(n / sqrt(c)) plus the
decode tokens, so its kv_bytes ratio is higher than budget / n_context.
"""

from __future__ import annotations

import argparse
import time

from veloxquant_mlx.model import load_model  # first: preloads OpenBLAS before mlx.core

import mlx.core as mx

from veloxquant_mlx.assets import essays_text
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.methods.eviction.kvzip import KVzipKVCache
from veloxquant_mlx.cache.options import (CurDKVOptions, KVzipOptions, NestedKVOptions, QFiltersOptions,
                                          RocketKVOptions)
from veloxquant_mlx.eval.fidelity import (FidelityResult, _log_softmax, next_token_fidelity, prefill,
                                          reference_logprobs)
from veloxquant_mlx.measure import fp16_kv_bytes, kv_bytes

METHODS = ("qfilters", "kvzip", "kvzip_norecon", "curdkv", "nestedkv", "rocketkv")


def config_for(method: str, budget: int, n_context: int) -> KVCacheConfig:
    if method == "qfilters":
        return KVCacheConfig(method="qfilters", options=QFiltersOptions(budget=budget))
    if method in ("kvzip", "kvzip_norecon"):
        return KVCacheConfig(method="kvzip", options=KVzipOptions(budget=budget))
    if method == "curdkv":
        return KVCacheConfig(method="curdkv", options=CurDKVOptions(budget=budget))
    if method == "nestedkv":
        return KVCacheConfig(method="nestedkv", options=NestedKVOptions(budget=budget))
    if method == "rocketkv":
        return KVCacheConfig(method="rocketkv", options=RocketKVOptions(compression_ratio=n_context / budget))
    raise ValueError(method)


def kvzip_fidelity(model, tokenizer, tokens, n_context, n_score, config, ref_logp) -> FidelityResult:
    """``next_token_fidelity`` with KVzip's reconstruction pass between the prefill and the scoring."""
    tokens = mx.array(tokens[: n_context + n_score]).reshape(1, -1)
    caches = KVCacheBuilder.for_model(model, config)
    prefill(model, tokens[:, : n_context - 1], caches)
    KVzipKVCache.compress_with_model(model, caches, tokens[0, : n_context - 1], tokenizer=tokenizer)
    steps = []
    for i in range(n_score):
        pos = n_context - 1 + i
        steps.append(_log_softmax(model(tokens[:, pos : pos + 1], cache=caches)[0, -1]))
        if i % 16 == 15:
            mx.eval(steps)
    logp = mx.stack(steps)
    kld = (mx.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
    targets = tokens[0, n_context : n_context + n_score]
    nll = -mx.take_along_axis(logp, targets[:, None], axis=-1).mean()
    nll_ref = -mx.take_along_axis(ref_logp, targets[:, None], axis=-1).mean()
    agree = (logp.argmax(-1) == ref_logp.argmax(-1)).astype(mx.float32).mean()
    mx.eval([c.state for c in caches])
    return FidelityResult(
        kld=float(kld.mean()), top1_agree=float(agree), ppl=float(mx.exp(nll)), ppl_ref=float(mx.exp(nll_ref)),
        kv_bytes=kv_bytes(caches), kv_bytes_fp16=fp16_kv_bytes(model, n_context + n_score - 1), n_scored=n_score,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-context", type=int, default=1024)
    ap.add_argument("--n-score", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = ap.parse_args()
    model, tokenizer = load_model()
    ids = tokenizer.encode(essays_text(max_chars=40_000))[: args.n_context + args.n_score]
    ref_logp = reference_logprobs(model, ids, args.n_context, args.n_score)  # once for every method
    print(f"SmolLM2-135M, context {args.n_context} tokens of essays, {args.n_score} scored tokens", flush=True)
    print(f"{'method':<15} {'budget':>6} {'KLD':>8} {'top1':>6} {'kv/fp16':>8} {'ppl':>7} {'ppl_ref':>7} {'s':>5}",
          flush=True)
    for method in args.methods:
        for budget in args.budgets:
            cfg = config_for(method, budget, args.n_context)
            t = time.time()
            if method == "kvzip":
                r = kvzip_fidelity(model, tokenizer, ids, args.n_context, args.n_score, cfg, ref_logp)
            else:
                r = next_token_fidelity(model, ids, args.n_context, args.n_score, cfg, ref_logp=ref_logp)
            print(f"{method:<15} {budget:>6} {r.kld:>8.4f} {r.top1_agree:>6.3f} {r.compression:>8.3f} "
                  f"{r.ppl:>7.2f} {r.ppl_ref:>7.2f} {time.time() - t:>5.0f}", flush=True)


if __name__ == "__main__":
    main()
