"""SqueezeAttention (Wang, Cui, Gan, "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via
Layer-wise Optimal Budget", arXiv 2404.04793).

The paper measures, at prefill, how much each attention layer changes the hidden states (cosine
similarity of the hidden state before and after self-attention), clusters the layers by it with
k-means (3 clusters), squeezes the budget of the least important cluster (highest similarity: the
layer barely changes its input) to a fraction ``p`` of the initial budget and spreads what it saves
evenly over the other layers, so the total is unchanged. Each layer then runs a sequence-wise policy
with its own budget: H2O here (per-row accumulated attention of every query; the first
``squeeze_n_sink`` tokens and, as in H2O, the newest half of the layer's budget are protected).
The ``SqueezeCoordinator`` built in ``build_layers`` (lifetime: one prompt cache) collects one
importance value per layer during the first forward pass and, when the last layer has reported,
resolves every layer's budget and evicts every layer down to it.

Deviations from the paper:
* Importance proxy: a KV cache never sees hidden states, so a layer's importance is measured from its
  attention instead: the *concentration* ``1 - H / log(n)`` of the observation queries' attention
  (``H`` the entropy of a query's softmax over its ``n`` visible tokens, averaged over the last
  ``OBS_WINDOW`` queries of the first call, the query heads and the batch), from the model's real
  queries when the dispatch point is installed (keys standing in for queries without it). A layer whose
  attention concentrates on few tokens (typically the sinks, whose values are near zero) changes its
  input little, the situation the paper's high cosine similarity detects; so the most concentrated
  cluster is squeezed and broad-attention layers get more. It is one host read per prompt. On
  SmolLM2-135M over an essay prompt the proxy's correlation with the paper's cosine similarity across
  the 30 layers is 0.71 (both single out layer 0 as the most important).
* ``squeeze_strength`` (``t >= 0``) sets the squeezed fraction ``p = 1 / (1 + t)`` of the selectable
  rows (``budget - n_sink - OBS_WINDOW``): ``t = 0`` is uniform, the default ``t = 1`` keeps half
  (the paper tunes ``p`` per model, roughly 0.3 - 0.7). Sinks and a 32-token window are never squeezed. Budgets
  are rounded so they sum to exactly ``n_layers * squeeze_budget``.
* Until the coordinator has resolved the budgets (the end of the first forward pass) the layers do not
  evict, so the first prefill chunk is held whole for that one call. Decoding evicts in batches: the
  cache may grow by ``evict_slack`` rows (``min(32, max(1, budget // 16))``), then cuts back.
* Without a coordinator (a single cache, or caches reloaded from a file) a layer keeps its budget
  (``squeeze_resolved_budget`` if set, else the resolved one saved in its state, else
  ``squeeze_budget``): uniform H2O.
"""

from __future__ import annotations

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..eviction import check_min
from .pyramidkv import OBS_WINDOW, VotingEviction

N_CLUSTERS = 3


def kmeans_1d(values: list[float], k: int, iters: int = 50) -> list[int]:
    """Cluster labels of 1-D ``values`` (deterministic: centroids start at evenly spaced quantiles)."""
    order = sorted(values)
    n = len(values)
    cents = [order[round(i * (n - 1) / max(k - 1, 1))] for i in range(k)]
    labels = [0] * n
    for _ in range(iters):
        labels = [min(range(k), key=lambda j: (abs(v - cents[j]), j)) for v in values]
        new = [sum(v for v, l in zip(values, labels) if l == j) / max(1, labels.count(j)) if j in labels
               else cents[j] for j in range(k)]
        if new == cents:
            break
        cents = new
    return labels


def squeeze_budgets(concentration: list[float], budget: int, protected: int, strength: float) -> list[int]:
    """Per-layer budgets: the most concentrated k-means cluster keeps ``1 / (1 + strength)`` of its
    selectable rows, the rest are shared evenly by the other layers; the sum is ``n * budget``."""
    n = len(concentration)
    s = budget - protected
    if n < 2 or strength == 0 or max(concentration) - min(concentration) < 1e-6:
        return [budget] * n
    labels = kmeans_1d(concentration, min(N_CLUSTERS, n))
    means = {l: sum(c for c, m in zip(concentration, labels) if m == l) / labels.count(l) for l in set(labels)}
    squeezed = max(means, key=means.get)
    low = [i for i in range(n) if labels[i] == squeezed]
    high = [i for i in range(n) if labels[i] != squeezed]
    if not high:
        return [budget] * n
    s_low = s / (1.0 + strength)
    s_high = s + (s - s_low) * len(low) / len(high)
    vals = [int(s_low) if i in low else int(s_high) for i in range(n)]
    rest = n * s - sum(vals)  # rounding remainder, < n: to the least concentrated layers first
    for i in sorted(high, key=lambda i: concentration[i]) + low:
        if rest <= 0:
            break
        vals[i] += 1
        rest -= 1
    return [protected + v for v in vals]


class SqueezeCoordinator:
    """Shared by the layers of one prompt cache: collects each layer's concentration during the first
    forward pass, then resolves the budgets (``squeeze_budgets``) and applies them to every layer."""

    def __init__(self, n_layers: int, budget: int, protected: int, strength: float):
        self.budget, self.protected, self.strength = budget, protected, strength
        self.layers: list = [None] * n_layers
        self._reports: dict[int, mx.array] = {}
        self.concentrations: list[float] | None = None
        self.budgets: list[int] | None = None

    @property
    def finalized(self) -> bool:
        return self.budgets is not None

    def report(self, layer_id: int, concentration: mx.array) -> None:
        self._reports[layer_id] = concentration
        if len(self._reports) == len(self.layers):
            self.finalize()

    def finalize(self) -> None:
        ids = sorted(self._reports)
        conc = mx.stack([self._reports[i] for i in ids]).tolist()  # one host read per prompt
        mean = sum(conc) / len(conc)
        got = dict(zip(ids, conc))  # a layer that never reported counts as average
        self.concentrations = [float(got.get(i, mean)) for i in range(len(self.layers))]
        self.budgets = squeeze_budgets(self.concentrations, self.budget, self.protected, self.strength)
        self._reports = {}
        for layer, b, c in zip(self.layers, self.budgets, self.concentrations):
            layer.adopt(b, c)


@register_with_mlx_lm
@register("squeeze")
class SqueezeAttentionCache(VotingEviction):
    """H2O-style eviction with a per-layer budget reallocated by measured layer importance."""
    # layer budgets calibrated once, on the first forward pass; batched (slack) decode eviction
    chunk_invariant = False
    exact_trim = False  # decode rows add votes and evict (slack)

    scalar_fields = VotingEviction.scalar_fields + ("budget", "squeezed", "concentration_value")
    vote_all_queries = True
    layer_id = None
    coordinator = None
    squeezed = False  # True once this layer's budget is resolved (state: survives reloads)
    concentration_value = 0.0
    _reported_at = None

    def __init__(self, config, layer_id=None, coordinator=None):
        super().__init__(config)
        self.layer_id, self.coordinator = layer_id, coordinator
        if coordinator is not None:
            coordinator.layers[layer_id] = self

    @property
    def recent(self) -> int:
        """H2O's split: the newest half of the budget is the protected recent window (at least the
        observation window)."""
        return max(self.obs_window, self.budget // 2)

    def _init_layout(self):
        c = self.config
        self.n_sink = c.squeeze_n_sink
        protected = self.n_sink + self.obs_window
        check_min("squeeze_budget", c.squeeze_budget, protected + 1, f"squeeze_n_sink + {self.obs_window} + 1")
        if c.squeeze_resolved_budget is not None:
            check_min("squeeze_resolved_budget", c.squeeze_resolved_budget, protected + 1,
                      f"squeeze_n_sink + {self.obs_window} + 1")
        if c.squeeze_strength < 0:
            raise QuantizerConfigError("squeeze_strength", c.squeeze_strength, "a number >= 0")
        self.budget = c.squeeze_budget if c.squeeze_resolved_budget is None else c.squeeze_resolved_budget

    @classmethod
    def build_layers(cls, layer_configs):
        if not layer_configs:
            return []
        c = layer_configs[0]
        if c.squeeze_resolved_budget is not None or len(layer_configs) == 1:
            return [cls(cfg, layer_id=i) for i, cfg in enumerate(layer_configs)]
        coord = SqueezeCoordinator(len(layer_configs), c.squeeze_budget, c.squeeze_n_sink + OBS_WINDOW,
                                   float(c.squeeze_strength))
        return [cls(cfg, layer_id=i, coordinator=coord) for i, cfg in enumerate(layer_configs)]

    @property
    def _waiting(self) -> bool:
        return self.coordinator is not None and not self.squeezed

    def wants_eviction(self, n_new):
        if self._waiting and self._reported_at is not None and self.offset > self._reported_at:
            # reported in an earlier call, yet some layer never did (its attention bypassed
            # ``observe``): resolve with what was measured rather than wait forever
            self.coordinator.finalize()
        return not self._waiting and super().wants_eviction(n_new)

    def observe(self, weights):
        super().observe(weights)
        if self._waiting and self._reported_at is None:
            self._reported_at = self.offset
            self.coordinator.report(self.layer_id, self._concentration(weights))

    def _concentration(self, weights):
        """1 - mean normalised entropy of the last ``obs_window`` queries' attention (a 0-d array)."""
        w = weights[..., -self.obs_window :, :]  # [B, H, rep, W, rows]
        n_q = w.shape[3]
        q_pos = mx.arange(self.offset - n_q, self.offset, dtype=mx.int32)
        pos = self.positions[:, :, : self.rows]
        visible = (pos[:, :, None, :] <= q_pos[None, None, :, None]).sum(axis=-1)  # [B, H, W]
        ent = -(w * mx.log(mx.maximum(w, 1e-30))).sum(axis=-1)  # [B, H, rep, W]
        norm = mx.log(mx.maximum(visible, 2).astype(mx.float32))[:, :, None, :]
        return 1.0 - (ent / norm).mean()

    def adopt(self, budget: int, concentration: float) -> None:
        """Take the resolved budget and evict down to it (called by the coordinator, after this layer's
        attention of the current call was computed)."""
        self.budget, self.squeezed, self.concentration_value = int(budget), True, concentration
        if self.rows > self.budget:
            self.evict(self.score(None, None, None))

    @property
    def concentration(self) -> float:
        """This layer's measured attention concentration (0.0 before the first forward pass)."""
        return self.concentration_value

    @property
    def squeeze_kept_bytes(self) -> int:
        return self.nbytes
