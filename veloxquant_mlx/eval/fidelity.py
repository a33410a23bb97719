"""Fidelity to the uncompressed model: next-token KL divergence, top-1 agreement and perplexity.

The context is prefilled through the compressed cache, then ``n_score`` tokens are fed one at a time, so both
prefill- and decode-time compression run; each step's next-token distribution is compared with the
uncompressed model's on the same tokens (mlx_lm's plain cache, :func:`reference_logprobs`, shareable as ``ref_logp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache import KVCacheConfig
from ..generate import make_caches as _make_caches
from ..measure import fp16_kv_bytes, kv_bytes

__all__ = ["FidelityResult", "make_caches", "prefill", "reconstruct", "reference_logprobs", "next_token_fidelity"]

PREFILL_STEP = 2048  # mlx_lm's default prefill chunk


@dataclass
class FidelityResult:
    kld: float  # mean KL(P_uncompressed || P_compressed) in nats
    top1_agree: float  # fraction of steps whose argmax agrees
    ppl: float  # perplexity of the scored tokens under the compressed cache
    ppl_ref: float  # ... and under the uncompressed cache
    kv_bytes: int  # measured bytes held by the caches after the run
    kv_bytes_fp16: int  # the same tokens in mlx_lm's plain cache at fp16
    n_scored: int
    top1_target: float = float("nan")  # fraction of steps whose argmax is the text's next token
    top1_target_ref: float = float("nan")  # ... under the uncompressed cache

    @property
    def kv_fraction_of_fp16(self) -> float:
        return self.kv_bytes / self.kv_bytes_fp16 if self.kv_bytes_fp16 else 1.0

    compression = kv_fraction_of_fp16  # the older name, still used by scripts and tests


def make_caches(model, config):
    """Caches for ``config`` (None or "none": mlx_lm's plain KVCache)."""
    return _make_caches(model, "none" if config is None or config == "none" else config.method, config)


def reconstruct(model, tokenizer) -> Callable[[list, list], None]:
    """An ``after_prefill`` step: each cache class's context-reconstruction pass (KVzip's ``compress_with_model``)."""

    def run(caches, context_ids):
        for cls in dict.fromkeys(type(c) for c in caches):
            if hasattr(cls, "compress_with_model"):
                cls.compress_with_model(model, caches, context_ids, tokenizer=tokenizer)
    return run


def _log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def prefill(model, tokens, caches, step: int = PREFILL_STEP,
            on_chunk: Optional[Callable[[int, int], None]] = None) -> None:
    """Run ``tokens`` ([1, T] or a list) through ``caches`` in chunks of ``step``; ``on_chunk(done, T)`` after each."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    n = tokens.shape[1]
    for start in range(0, n, step):
        model(tokens[:, start : min(start + step, n)], cache=caches)
        mx.eval([c.state for c in caches])
        if on_chunk is not None:
            on_chunk(min(start + step, n), n)


def _scored(tokens, n_context: int, n_score: int) -> mx.array:
    tokens = mx.array(list(tokens)[: n_context + n_score]).reshape(1, -1)
    if tokens.shape[1] < n_context + n_score:
        raise ValueError(f"need {n_context + n_score} tokens, got {tokens.shape[1]}")
    return tokens


def reference_logprobs(model, tokens, n_context: int, n_score: int, step: int = PREFILL_STEP) -> mx.array:
    """[n_score, vocab] log-probabilities of the uncompressed model at positions n_context-1 .. +n_score-2: the
    context prefilled into mlx_lm's plain cache in chunks of ``step`` (as the compressed runs are), then the scored
    tokens in one call. The same function as one call over the whole sequence, without its [T, T] scores per head:
    that call took 159 s for 4128 tokens on the 2-core CPU (its scores' exponentials)."""
    tokens = _scored(tokens, n_context, n_score)
    cache = make_prompt_cache(model)
    prefill(model, tokens[:, : n_context - 1], cache, step)
    out = _log_softmax(model(tokens[:, n_context - 1 : n_context + n_score - 1], cache=cache)[0])
    mx.eval(out)
    return out


def next_token_fidelity(model, tokens, n_context: int, n_score: int, config: KVCacheConfig | None,
                        prefill_step_size: int = PREFILL_STEP,
                        ref_logp: Optional[mx.array] = None,
                        on_chunk: Optional[Callable[[int, int], None]] = None,
                        after_prefill: Optional[Callable[[list, list], None]] = None) -> FidelityResult:
    """Compare next-token distributions at positions n_context-1 .. n_context+n_score-2; ``ref_logp``: the same
    tokens' :func:`reference_logprobs`, if known; ``after_prefill(caches, context_ids)``: e.g. :func:`reconstruct`."""
    if n_context < 2 or n_score < 1:
        raise ValueError(f"need n_context >= 2 and n_score >= 1, got {n_context}, {n_score}")
    tokens = _scored(tokens, n_context, n_score)
    if ref_logp is None:
        ref_logp = reference_logprobs(model, tokens[0].tolist(), n_context, n_score)
    caches = make_caches(model, config)
    prefill(model, tokens[:, : n_context - 1], caches, prefill_step_size, on_chunk)
    if after_prefill is not None:
        after_prefill(caches, tokens[0, : n_context - 1].tolist())
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
    hit = (logp.argmax(-1) == targets).astype(mx.float32).mean()
    hit_ref = (ref_logp.argmax(-1) == targets).astype(mx.float32).mean()
    mx.eval([c.state for c in caches])
    return FidelityResult(
        kld=float(kld.mean()), top1_agree=float(agree), ppl=float(mx.exp(nll)), ppl_ref=float(mx.exp(nll_ref)),
        kv_bytes=kv_bytes(caches), kv_bytes_fp16=fp16_kv_bytes(model, n_context + n_score - 1), n_scored=n_score,
        top1_target=float(hit), top1_target_ref=float(hit_ref))
