"""Fidelity to the uncompressed model: next-token KL divergence and top-1 agreement.

The context is prefilled through the compressed cache (so prefill-time compression runs), then the
following ``n_score`` tokens are fed one at a time (so decode-time compression runs too). At each
step the compressed model's next-token distribution is compared with the uncompressed model's on the
same tokens (one dense forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache import KVCacheBuilder, KVCacheConfig
from ..measure import fp16_kv_bytes, kv_bytes


@dataclass
class FidelityResult:
    kld: float  # mean KL(P_uncompressed || P_compressed) in nats
    top1_agree: float  # fraction of steps whose argmax agrees
    ppl: float  # perplexity of the scored tokens under the compressed cache
    ppl_ref: float  # ... and under the uncompressed cache
    kv_bytes: int  # measured bytes held by the caches after the run
    kv_bytes_fp16: int  # the same tokens in mlx_lm's plain cache at fp16
    n_scored: int

    @property
    def compression(self) -> float:
        return self.kv_bytes / self.kv_bytes_fp16 if self.kv_bytes_fp16 else 1.0


def make_caches(model, config):
    """Caches for ``config`` (None or "none" = mlx_lm's plain KVCache)."""
    if config is None or config == "none":
        return make_prompt_cache(model)
    return KVCacheBuilder.for_model(model, config)


def _log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def next_token_fidelity(model, tokens, n_context: int, n_score: int, config: KVCacheConfig | None,
                        prefill_step_size: int = 2048) -> FidelityResult:
    """Compare next-token distributions at positions n_context-1 .. n_context+n_score-2."""
    tokens = mx.array(tokens[: n_context + n_score]).reshape(1, -1)
    if tokens.shape[1] < n_context + n_score:
        raise ValueError(f"need {n_context + n_score} tokens, got {tokens.shape[1]}")
    ref_logp = _log_softmax(model(tokens, cache=make_prompt_cache(model))[0, n_context - 1 : -1])
    caches = make_caches(model, config)
    for start in range(0, n_context - 1, prefill_step_size):  # chunked prefill, as mlx_lm does
        end = min(start + prefill_step_size, n_context - 1)
        model(tokens[:, start:end], cache=caches)
        mx.eval([c.state for c in caches])
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
    return FidelityResult(
        kld=float(kld.mean()), top1_agree=float(agree), ppl=float(mx.exp(nll)), ppl_ref=float(mx.exp(nll_ref)),
        kv_bytes=kv_bytes(caches), kv_bytes_fp16=fp16_kv_bytes(model, n_context + n_score - 1), n_scored=n_score,
    )
