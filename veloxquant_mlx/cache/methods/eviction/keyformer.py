"""Keyformer (Adnan et al., "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative
Inference", arXiv 2403.09054). Each row accumulates softmax((x + z) / tau) of every query's logits x (as log p, a
per-query constant off) with Gumbel noise z, summed over the KV head's query heads; over budget a KV head keeps its
``keyformer_recent`` newest tokens plus the highest-scoring rows. tau is ``keyformer_tau``, else linear from
``keyformer_tau_init`` to ``keyformer_tau_end`` over ``keyformer_anneal_steps`` decode steps. The noise key derives
from ``keyformer_seed``, the layer, a call counter in ``state`` and the first query row of a tile (a long call is
scored in tiles of query rows, sized by the device: the noise, not its law, differs between a CPU and a GPU);
``gumbel_noise = False`` with tau = 1 is H2O.

Deviations: the first ``keyformer_n_sink`` tokens are kept (0 reproduces it); the anneal length is
``keyformer_anneal_steps`` (a cache does not know the generation length; 0: constant ``tau_init``, which
``tau_end`` must equal); decoding evicts once per ``evict_slack`` steps; ``keyformer_rope_base`` is unused (keys
cached after RoPE, the paper's variant); trim rewinds the decode-step count, keeps the trimmed queries' scores.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives.blocks import block_entries, queued_row_blocks
from ...primitives.fused import elementwise
from .h2o import H2OKVCache

TILES = 32  # a long call is scored in at least this many tiles of query rows (their temporaries beside the weights)


@elementwise
def _noisy_logits(w, u, inv_tau):
    """(log p + g) / tau, g = -log(-log u) a Gumbel draw from u ~ U[0, 1); log p = x - logsumexp(x) (hidden: -inf)."""
    return (mx.log(w) - mx.log(-mx.log(u))) * inv_tau


@elementwise
def _over_exponential(w, u):
    """p / E, E = -log u ~ Exp(1): exp(log p + g) for the Gumbel draw g = -log E (tau = 1)."""
    return w / -mx.log(u)


@elementwise
def _logits(w, inv_tau):
    return mx.log(w) * inv_tau


@elementwise
def _exp_shifted(z, m):
    return mx.exp(z - m)


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

    def observe(self, weights, first=0, total=None):
        """Accumulate softmax((log p + Gumbel) / tau) of weights [B, H, rep, n, rows] (rows [first, first + n) of a
        call of ``total``), over the queries in tiles of query rows (``queued_row_blocks``): at once, the log, the
        noise and the softmax were several [N, rows] float32 arrays beside the attention (2x the plain cache's peak
        with a 512-token prompt in one chunk). The noise is keyed by the call and each tile's first row."""
        B, H, rep, N, rows = weights.shape
        total = total or N
        if first == 0:
            self.noise_calls += int(self.gumbel_noise)
        tau, call = self.tau(), self.noise_calls - int(self.gumbel_noise)
        tile = min(block_entries() // max(1, B * H * rep * rows), -(-total // TILES))  # >= TILES tiles of a call
        parts = queued_row_blocks(lambda a, b: self._tile_mass(weights[:, :, :, a:b], tau, call, first + a), N, tile)
        self.acc[:, :, :rows] = self.acc[:, :, :rows] + sum(parts[1:], parts[0])
        self.decode_steps += int(total == 1)
        self.settle()

    def _tile_mass(self, w: mx.array, tau: float, call: int, first: int) -> mx.array:
        """[B, H, rows]: the summed softmax((log p + g) / tau) of the query rows ``w`` [B, H, rep, n, rows] (the
        first at ``first`` in the call, the noise's key with the call's counter); normalised by a matmul. With
        g = -log E (E ~ Exp(1)) the softmax is (p / E)^(1 / tau) normalised: at tau = 1 no exp or log of p."""
        u = None
        if self.gumbel_noise:
            seed = self.config.options.seed
            key = ((seed * 1_000_003 + self.noise_stream) * 1_000_003 + call) * 1_000_003 + first
            u = mx.random.uniform(shape=w.shape, key=mx.random.key(key % 2**63))
        if tau == 1.0:
            e = w if u is None else _over_exponential(w, u)
        else:
            inv_tau = mx.array(1.0 / tau, mx.float32)
            z = _logits(w, inv_tau) if u is None else _noisy_logits(w, u, inv_tau)
            e = _exp_shifted(z, z.max(axis=-1, keepdims=True))
        return (mx.reciprocal(e.sum(axis=-1))[..., None, :] @ e).sum(axis=(2, 3))

    def _trimmed(self, n):
        self.decode_steps = max(0, self.decode_steps - n)
