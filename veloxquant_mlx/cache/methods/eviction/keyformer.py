"""Keyformer (Adnan et al., "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative
Inference", arXiv 2403.09054). Each row accumulates softmax((x + z) / tau) of every query's logits x (as log p, a
per-query constant off) with Gumbel noise z, summed over the KV head's query heads; over budget a KV head keeps its
``keyformer_recent`` newest tokens plus the highest-scoring rows. tau is ``keyformer_tau``, else linear from
``keyformer_tau_init`` to ``keyformer_tau_end`` over ``keyformer_anneal_steps`` decode steps. The noise key derives
from ``keyformer_seed``, the layer and a call counter in ``state``; ``gumbel_noise = False`` with tau = 1 is H2O.

Deviations: the first ``keyformer_n_sink`` tokens are kept (0 reproduces it); the anneal length is
``keyformer_anneal_steps`` (a cache does not know the generation length; 0: constant ``tau_init``, which
``tau_end`` must equal); decoding evicts once per ``evict_slack`` steps; ``keyformer_rope_base`` is unused (keys
cached after RoPE, the paper's variant); trim rewinds the decode-step count, keeps the trimmed queries' scores.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from .h2o import H2OKVCache


@register_with_mlx_lm
@register("keyformer")
class KeyformerKVCache(H2OKVCache):
    """Keep the rows with the highest accumulated (``acc``, H2O's) Gumbel-regularised attention score."""
    chunk_invariant, exact_trim = False, False  # noise drawn per call; decode rows add scores, evict
    scalar_fields = H2OKVCache.scalar_fields + ("decode_steps", "noise_calls", "noise_stream")
    gumbel_noise = True  # set False (e.g. on an instance) to drop the noise term
    decode_steps = noise_calls = 0
    noise_stream = 0  # the layer index under ``for_model``: layers draw independent noise
    layer_field = "noise_stream"
    recent_option = "recent"

    def tau(self, step: int | None = None) -> float:
        """The temperature at decode step ``step`` (default: the next one)."""
        o = self.config.options
        if o.tau is not None or o.anneal_steps == 0:
            return float(o.tau_init if o.tau is None else o.tau)
        t = min(self.decode_steps if step is None else step, o.anneal_steps)
        return o.tau_init + (o.tau_end - o.tau_init) * t / o.anneal_steps

    def observe(self, weights):
        """Accumulate softmax((log p + Gumbel) / tau) of weights [B, H, rep, N, rows]."""
        logits = mx.log(weights)  # = x - logsumexp(x): hidden keys stay -inf
        if self.gumbel_noise:
            seed = self.config.options.seed
            key = mx.random.key(((seed * 1_000_003 + self.noise_stream) * 1_000_003 + self.noise_calls) % 2**63)
            logits = logits + mx.random.gumbel(weights.shape, key=key)
            self.noise_calls += 1
        f = mx.softmax(logits / self.tau(), axis=-1, precise=True)
        self.acc[:, :, : self.rows] = self.acc[:, :, : self.rows] + f.sum(axis=(2, 3))
        self.decode_steps += int(weights.shape[3] == 1)
        self.settle()

    def _trimmed(self, n):
        self.decode_steps = max(0, self.decode_steps - n)
