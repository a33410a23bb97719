"""Keyformer (Adnan et al., "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient
Generative Inference", arXiv 2403.09054).

Each query's unnormalised attention logits x get Gumbel noise z and a temperature tau, and the
regularised distribution softmax((x + z) / tau) is accumulated per cached row (summed over the query
heads of each KV head and over queries, for prefill and decode alike). When over budget, each KV
head keeps its ``keyformer_recent`` newest tokens plus the rows with the highest accumulated score
(the "key tokens"). tau is ``keyformer_tau`` when set, else it rises linearly from
``keyformer_tau_init`` to ``keyformer_tau_end`` over ``keyformer_anneal_steps`` decode steps (prompt
tokens use ``tau_init``). Real queries come from the attention dispatch point; keys stand in
without it.

Implementation notes: the logits are recovered from the attention probabilities as log p, which
differs from x by a per-query constant that softmax ignores, so the score is exact. The noise is
drawn from a key derived from ``keyformer_seed``, the layer index and a call counter kept in the
state, so a run is reproducible, layers draw independent noise, and a restored cache continues the
same noise sequence. With ``gumbel_noise = False`` and tau = 1 the score is exactly accumulated
attention (H2O without decay); as tau -> 0 the Gumbel-max trick makes its expectation accumulated
attention too. Scores are kept per KV head (summed over its query heads), like the other methods
of this package.

Deviations from the paper:
* Sinks: the first ``keyformer_n_sink`` tokens are never evicted (the paper has none;
  ``keyformer_n_sink=0`` reproduces it).
* ``keyformer_anneal_steps`` fixes the schedule's length (the paper spreads it over the generation
  length, unknown to a cache); ``anneal_steps=0`` means a constant ``tau_init`` (and then
  ``tau_end`` must equal it).
* Batched eviction: decoding evicts once per ``evict_slack`` steps (``eviction.py``), not every step.
* ``keyformer_rope_base`` is accepted and unused: keys are cached after RoPE at their original
  positions (the paper's "original positions" variant), so nothing is re-rotated.
* Trim drops the trimmed rows and their scores and rewinds the decode-step count; the score the
  trimmed queries added to the remaining rows stays.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...eviction import BatchedEviction, EvictionKVCache, check_budget, default_slack


@register_with_mlx_lm
@register("keyformer")
class KeyformerKVCache(BatchedEviction, EvictionKVCache):
    """Keep the rows with the highest accumulated Gumbel-regularised attention score."""
    chunk_invariant = False  # batched (slack) decode eviction; Gumbel noise drawn per call
    exact_trim = False  # decode rows add scores and evict (slack)

    array_fields = EvictionKVCache.array_fields + ("acc",)
    row_fields = ("acc",)
    scalar_fields = ("rows", "decode_steps", "noise_calls", "noise_stream")
    uses_attention_weights = True
    gumbel_noise = True  # set False (e.g. on an instance) to drop the noise term
    decode_steps = 0
    noise_calls = 0
    noise_stream = 0  # the layer index under ``for_model``: layers draw independent noise

    @classmethod
    def build_layers(cls, layer_configs):
        """One cache per layer (``KVCacheBuilder.for_model``), each with its own noise stream."""
        caches = [cls(c) for c in layer_configs]
        for i, c in enumerate(caches):
            c.noise_stream = i
        return caches

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.recent = o.budget, o.n_sink, o.recent
        self.tau_fixed, self.tau_init, self.tau_end = o.tau, o.tau_init, o.tau_end
        self.anneal_steps, self.seed = o.anneal_steps, o.seed
        self.rope_base = o.rope_base  # accepted, unused
        check_budget("keyformer_budget", self.budget, self.n_sink + self.recent,
                     "keyformer_n_sink + keyformer_recent")
        for name in ("tau_fixed", "tau_init", "tau_end"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                field = "keyformer_tau" if name == "tau_fixed" else f"keyformer_{name}"
                raise QuantizerConfigError(field, v, "a number > 0 (tau -> 0 is a limit, not a value)")
        if self.tau_fixed is None and self.anneal_steps == 0 and self.tau_end != self.tau_init:
            raise QuantizerConfigError("keyformer_anneal_steps", 0,
                                       "an int > 0 when keyformer_tau_end differs from keyformer_tau_init")
        self.evict_slack = default_slack(self.budget)

    def tau(self, step: int | None = None) -> float:
        """The temperature at decode step ``step`` (default: the next one)."""
        if self.tau_fixed is not None:
            return float(self.tau_fixed)
        t = self.decode_steps if step is None else step
        if self.anneal_steps == 0:
            return float(self.tau_init)
        return self.tau_init + (self.tau_end - self.tau_init) * min(t, self.anneal_steps) / self.anneal_steps

    def observe(self, weights):
        """weights [B, H, rep, N, rows]: accumulate softmax((log p + Gumbel) / tau)."""
        rows, n = self.rows, weights.shape[3]
        logits = mx.log(weights)  # = x - logsumexp(x): hidden keys stay -inf
        if self.gumbel_noise:
            key = mx.random.key(((self.seed * 1_000_003 + self.noise_stream) * 1_000_003 + self.noise_calls) % 2**63)
            logits = logits + mx.random.gumbel(weights.shape, key=key)
            self.noise_calls += 1
        f = mx.softmax(logits / self.tau(), axis=-1, precise=True)
        self.acc[:, :, :rows] = self.acc[:, :, :rows] + f.sum(axis=(2, 3))
        if n == 1:
            self.decode_steps += 1
        self.settle()

    def score(self, obs_queries, obs_positions, scale):
        return self.acc[:, :, : self.rows]

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        self.decode_steps = max(0, self.decode_steps - dropped)
        return dropped
