"""SqueezeAttention (Wang, Cui, Gan, "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via
Layer-wise Optimal Budget", arXiv 2404.04793).

The paper measures, at prefill, how much each attention layer changes the hidden states: the cosine
similarity of a token's hidden state before and after self-attention, averaged over the prompt. It
clusters the layers by it with k-means (3 clusters; solved exactly here, ``kmeans_1d``), squeezes the
cluster of highest similarity (the layers that barely change their input) to a fraction ``p`` of the
initial budget and spreads what it saves evenly over the other layers (two groups in the end), so the
total is unchanged. Each layer then
runs a sequence-wise policy with its own budget: H2O here (``VotingEviction.h2o_votes``: per-row
accumulated attention of every query; the first ``n_sink`` tokens and the newest half of the layer's
budget are protected). Real queries, slack, spare rows, ``decode_evict`` and trim: ``eviction``'s
module docstring.

How the hidden states are seen: ``KVCacheBuilder.for_model`` installs, next to the attention dispatch
point, the two reports this class asks for in ``io_hooks`` (``dispatch.report_io``): the attention
module hands the cache its output ``a`` and the decoder layer its input ``h`` (the residual stream), and
the layer's similarity is ``mean_t cos(h_t, h_t + a_t)`` over the tokens (and batch) of the first forward
pass, a lazy 0-d array. The ``SqueezeCoordinator`` built in ``build_layers`` (lifetime: one prompt cache)
collects one per layer; when the last layer has reported it reads them (the one host read per prompt),
resolves every layer's budget and evicts every layer down to it. Afterwards the reports return at once
(a Python flag: no work and no host sync on the decode path).

Deviations from the paper:
* ``h + a`` is the hidden state after attention in pre-norm blocks (Llama, Qwen, Mistral); blocks that
  normalise the attention output before adding it (Gemma's post-attention norm) get the un-normalised
  sum, an approximation.
* ``strength`` (``t >= 0``) sets the squeezed fraction ``p = 1 / (1 + t)`` of the selectable rows
  (``budget - n_sink - OBS_WINDOW``): ``t = 0`` is uniform, the default ``t = 1`` keeps half (the paper
  tunes ``p`` per model, roughly 0.3 - 0.7). Sinks and a 32-token window are never squeezed. Budgets
  are rounded so they sum to exactly ``n_layers * budget``.
* The similarity comes from the first forward pass (the first prefill chunk when mlx_lm chunks a long
  prompt), not from the whole prompt. Until the budgets are resolved the layers do not evict, so that
  chunk is held whole for that one call. Decoding is compressed too (the default slack).
* Without the reports (caches built with ``install_dispatch=False`` or ``VELOXQUANT_DISPATCH=0``, or a
  model whose layers were never called with these caches) the coordinator resolves at the second call
  with what it has; a layer that never reported counts as the mean of the others, and with no report at
  all the budgets are uniform. Without a coordinator (a single cache, or caches reloaded from a file) a
  layer keeps its budget (the resolved one saved in its state, else ``squeeze_resolved_budget`` if set,
  else ``budget``): uniform H2O.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...eviction import OBS_WINDOW, VotingEviction, check_min

N_CLUSTERS = 3


def kmeans_1d(values: list[float], k: int) -> list[int]:
    """Cluster labels of 1-D ``values``: the k-means optimum (least within-cluster squared error), found
    exactly -- in 1-D optimal clusters are runs of the sorted values, so a dynamic program over the
    split points finds it (O(k n²); Lloyd's iterations can stop in a worse local optimum). Labels are
    0..k-1 in increasing order of value."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    x = [float(values[i]) for i in order]
    n = len(x)
    k = max(1, min(k, n))
    p1, p2 = [0.0], [0.0]
    for v in x:
        p1.append(p1[-1] + v)
        p2.append(p2[-1] + v * v)

    def sse(i, j):  # squared error of the run x[i:j] around its mean
        return p2[j] - p2[i] - (p1[j] - p1[i]) ** 2 / (j - i)

    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n + 1):
            for i in range(c - 1, j):
                v = cost[c - 1][i] + sse(i, j)
                if v < cost[c][j] - 1e-15:
                    cost[c][j], cut[c][j] = v, i
    labels, j = [0] * n, n
    for c in range(k, 0, -1):
        i = cut[c][j]
        for t in range(i, j):
            labels[order[t]] = c - 1
        j = i
    return labels


def squeeze_budgets(similarity: list[float], budget: int, protected: int, strength: float) -> list[int]:
    """Per-layer budgets: the k-means cluster of highest similarity (layers that change their hidden
    states least) keeps ``1 / (1 + strength)`` of its selectable rows, the rest are shared evenly by the
    other layers; the sum is ``n * budget``."""
    n = len(similarity)
    s = budget - protected
    if n < 2 or strength == 0 or max(similarity) - min(similarity) < 1e-6:
        return [budget] * n
    labels = kmeans_1d(similarity, min(N_CLUSTERS, n))
    means = {l: sum(c for c, m in zip(similarity, labels) if m == l) / labels.count(l) for l in set(labels)}
    squeezed = max(means, key=means.get)
    low = [i for i in range(n) if labels[i] == squeezed]
    high = [i for i in range(n) if labels[i] != squeezed]
    if not high:
        return [budget] * n
    s_low = s / (1.0 + strength)
    s_high = s + (s - s_low) * len(low) / len(high)
    vals = [int(s_low) if i in low else int(s_high) for i in range(n)]
    rest = n * s - sum(vals)  # rounding remainder, < n: to the least similar layers first
    for i in sorted(high, key=lambda i: similarity[i]) + low:
        if rest <= 0:
            break
        vals[i] += 1
        rest -= 1
    return [protected + v for v in vals]


def hidden_similarity(h: mx.array, attn_out: mx.array) -> mx.array:
    """Mean over tokens (and batch) of ``cos(h_t, h_t + a_t)``: how little attention changed the hidden
    state (a lazy 0-d float32 array)."""
    h = h.astype(mx.float32)
    after = h + attn_out.astype(mx.float32)
    dot = (h * after).sum(axis=-1)
    norms = mx.sqrt((h * h).sum(axis=-1) * (after * after).sum(axis=-1))
    return (dot / mx.maximum(norms, 1e-30)).mean()


class SqueezeCoordinator:
    """Shared by the layers of one prompt cache: collects each layer's hidden-state similarity during
    the first forward pass, then resolves the budgets (``squeeze_budgets``) and applies them to every
    layer."""

    def __init__(self, n_layers: int, budget: int, protected: int, strength: float):
        self.budget, self.protected, self.strength = budget, protected, strength
        self.layers: list = [None] * n_layers
        self._reports: dict[int, mx.array] = {}
        self.similarities: list[float] | None = None
        self.budgets: list[int] | None = None

    @property
    def finalized(self) -> bool:
        return self.budgets is not None

    def report(self, layer_id: int, similarity: mx.array) -> None:
        self._reports[layer_id] = similarity
        if len(self._reports) == len(self.layers):
            self.finalize()

    def finalize(self) -> None:
        ids = sorted(self._reports)
        sims = mx.stack([self._reports[i] for i in ids]).tolist() if ids else []  # one host read per prompt
        mean = sum(sims) / len(sims) if sims else 0.0
        got = dict(zip(ids, sims))  # a layer that never reported counts as average
        self.similarities = [float(got.get(i, mean)) for i in range(len(self.layers))]
        self.budgets = squeeze_budgets(self.similarities, self.budget, self.protected, self.strength)
        self._reports = {}
        for layer, b, c in zip(self.layers, self.budgets, self.similarities):
            layer.adopt(b, c)


@register_with_mlx_lm
@register("squeeze")
class SqueezeAttentionCache(VotingEviction):
    """H2O-style eviction with a per-layer budget reallocated by how little each layer's attention
    changes the hidden states."""
    # layer budgets calibrated once, on the first forward pass; batched (slack) decode eviction
    chunk_invariant = False
    exact_trim = False  # decode rows add votes and evict (slack)

    scalar_fields = VotingEviction.scalar_fields + ("squeezed", "similarity_value")
    h2o_votes = True
    #: reports ``for_model`` installs (``dispatch.report_io``): module -> the method it calls
    io_hooks = {"attention": "observe_attention_output", "layer": "observe_layer_io"}
    layer_id = None
    coordinator = None
    squeezed = False  # True once this layer's budget is resolved (state: survives reloads)
    similarity_value = 0.0
    _attn_out = None  # this layer's attention output of the first call, until the layer reports

    def __init__(self, config, layer_id=None, coordinator=None):
        super().__init__(config)
        self.layer_id, self.coordinator = layer_id, coordinator
        if coordinator is not None:
            coordinator.layers[layer_id] = self

    def _init_layout(self):
        o, resolved = self.config.options, self.config.squeeze_resolved_budget
        self.n_sink = o.n_sink
        protected = self.n_sink + self.obs_window
        check_min("squeeze_budget", o.budget, protected + 1, f"squeeze_n_sink + {self.obs_window} + 1")
        if resolved is not None:
            check_min("squeeze_resolved_budget", resolved, protected + 1, f"squeeze_n_sink + {self.obs_window} + 1")
        if o.strength < 0:
            raise QuantizerConfigError("squeeze_strength", o.strength, "a number >= 0")
        self.budget = o.budget if resolved is None else resolved

    @classmethod
    def build_layers(cls, layer_configs):
        if not layer_configs:
            return []
        c, o = layer_configs[0], layer_configs[0].options
        coord = None
        if c.squeeze_resolved_budget is None and len(layer_configs) > 1:
            coord = SqueezeCoordinator(len(layer_configs), o.budget, o.n_sink + OBS_WINDOW, float(o.strength))
        return [cls(cfg, layer_id=i, coordinator=coord) for i, cfg in enumerate(layer_configs)]

    @property
    def _waiting(self) -> bool:
        return self.coordinator is not None and not self.squeezed

    def _store(self, keys, values):
        if self._waiting and self.offset > 0:
            # a later call, yet some layer never reported (no hidden-state reports installed, or its
            # layer was not called): resolve with what was measured rather than wait forever (before
            # this call's rows are stored, so every layer is evicted between calls)
            self.coordinator.finalize()
        super()._store(keys, values)

    def wants_eviction(self, n_new):
        return not self._waiting and super().wants_eviction(n_new)

    # ---------------------------------------------------------------- hidden-state reports
    def observe_attention_output(self, x, out) -> None:
        """The attention module's output ``a`` [B, L, hidden] of the first call (kept until the layer
        reports; afterwards a no-op)."""
        if self._waiting:
            self._attn_out = out

    def observe_layer_io(self, h, out) -> None:
        """The decoder layer's input ``h`` (residual stream) of the first call: report
        ``cos(h, h + a)`` to the coordinator (lazy; afterwards a no-op)."""
        if self._waiting and self._attn_out is not None:
            a, self._attn_out = self._attn_out, None
            if a.shape == h.shape:
                self.coordinator.report(self.layer_id, hidden_similarity(h, a))

    def adopt(self, budget: int, similarity: float) -> None:
        """Take the resolved budget and evict down to it (called by the coordinator, after this layer's
        attention of the current call was computed)."""
        self.budget, self.squeezed, self.similarity_value = int(budget), True, float(similarity)
        self._attn_out = None
        if self.rows > self.budget:
            self.evict(self.score(None, None, None))

    @property
    def similarity(self) -> float:
        """Mean cosine similarity of this layer's hidden states before and after attention, measured on
        the first forward pass (0.0 before it; the mean of the other layers if this one never reported)."""
        return self.similarity_value

    @property
    def concentration(self) -> float:
        """The spec's name for this layer's measured importance: ``1 - similarity`` (0.0 before the
        first forward pass)."""
        return 1.0 - self.similarity_value if self.squeezed else 0.0

    squeeze_kept_bytes = VotingEviction.kept_bytes
