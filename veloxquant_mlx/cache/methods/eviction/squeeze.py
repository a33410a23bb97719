"""SqueezeAttention (Wang, Cui, Gan, "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via Layer-wise
Optimal Budget", arXiv 2404.04793): layers are clustered by how little attention changes the hidden states (mean
cos of a token's state before and after attention; exact 1-D k-means, 3 clusters); the most similar cluster is
squeezed to a fraction ``p`` of the budget, the savings spread over the others, and each layer runs H2O with its
budget (``VotingEviction.h2o_votes``). ``for_model`` installs the ``io_hooks`` reports: the attention output ``a``
and the layer input ``h`` give ``mean_t cos(h_t, h_t + a_t)`` on the first forward pass; the
``SqueezeCoordinator`` (one per prompt cache) reads them once, resolves the budgets and evicts every layer.

Deviations:
* ``h + a`` is the post-attention state of pre-norm blocks (Gemma's post-attention norm: approximated).
* ``strength`` t >= 0 squeezes to ``p = 1 / (1 + t)`` of the selectable rows (0 uniform, default 1; the paper
  tunes p ~0.3 - 0.7); sinks and the window are never squeezed, nor a layer below the least budget H2O accepts
  (``least_h2o_budget``: the sinks and the newest half plus a row); budgets sum to ``n * budget``.
* The similarity is the first forward pass's (the first prefill chunk), and no layer evicts before it.
* Without reports the coordinator resolves at the second call (a silent layer counts as the mean; none: uniform);
  without a coordinator (single or reloaded caches) a layer keeps its state's budget, else
  ``squeeze_resolved_budget``, else ``budget``.
"""

from __future__ import annotations

from itertools import accumulate, combinations
import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import OBS_WINDOW, VotingEviction

N_CLUSTERS = 3


def kmeans_1d(values: list[float], k: int) -> list[int]:
    """Labels 0..k-1 (increasing with value) of the exact 1-D k-means optimum: optimal clusters are runs of
    the sorted values, so every split into k runs is tried (O(n^(k-1)), k = 3 here; Lloyd can stop worse)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    x = [float(values[i]) for i in order]
    n, k = len(x), max(1, min(k, len(x)))
    p1, p2 = [0.0, *accumulate(x)], [0.0, *accumulate(v * v for v in x)]

    def sse(cuts):  # squared error of the runs between consecutive cuts, each around its mean
        return sum(p2[j] - p2[i] - (p1[j] - p1[i]) ** 2 / (j - i) for i, j in zip(cuts, cuts[1:]))

    best = min(((0, *c, n) for c in combinations(range(1, n), k - 1)), key=sse) if n else (0,)
    run = [c for c, (i, j) in enumerate(zip(best, best[1:])) for _ in range(i, j)]  # cluster of each sorted value
    return [run[order.index(i)] for i in range(n)]


def least_h2o_budget(n_sink: int, window: int) -> int:
    """The smallest budget an H2O-voting layer accepts (``VotingEviction._init_layout``): a row beyond the sinks and
    the window, and beyond the sinks and the newest half of the budget."""
    b = n_sink + window + 1
    while n_sink + max(window, b // 2) >= b:
        b += 1
    return b


def squeeze_budgets(similarity: list[float], budget: int, protected: int, strength: float,
                    least: int | None = None) -> list[int]:
    """Per-layer budgets: the most similar k-means cluster keeps ``1 / (1 + strength)`` of its selectable
    rows (but a budget no smaller than ``least``, default ``protected + 1``), the rest go evenly to the other
    layers; the sum is ``n * budget``."""
    n, s = len(similarity), budget - protected
    if n < 2 or strength == 0 or max(similarity) - min(similarity) < 1e-6:
        return [budget] * n
    labels = kmeans_1d(similarity, min(N_CLUSTERS, n))
    means = {l: sum(c for c, m in zip(similarity, labels) if m == l) / labels.count(l) for l in set(labels)}
    squeezed = max(means, key=means.get)
    low, high = [i for i in range(n) if labels[i] == squeezed], [i for i in range(n) if labels[i] != squeezed]
    s_low = max(s / (1.0 + strength), (least or protected + 1) - protected)
    s_high = s + (s - s_low) * len(low) / len(high)
    vals = [int(s_low) if i in low else int(s_high) for i in range(n)]
    rest = n * s - sum(vals)  # rounding remainder, < n: to the least similar layers first
    for i in (sorted(high, key=lambda i: similarity[i]) + low)[: max(rest, 0)]:
        vals[i] += 1
    return [protected + v for v in vals]


def hidden_similarity(h: mx.array, attn_out: mx.array) -> mx.array:
    """Mean over tokens (and batch) of ``cos(h_t, h_t + a_t)`` (a lazy 0-d float32 array)."""
    h = h.astype(mx.float32)
    after = h + attn_out.astype(mx.float32)
    norms = mx.sqrt((h * h).sum(axis=-1) * (after * after).sum(axis=-1))
    return ((h * after).sum(axis=-1) / mx.maximum(norms, 1e-30)).mean()


class SqueezeCoordinator:
    """Collects the layers' similarities of the first forward pass, then resolves and applies the budgets."""

    def __init__(self, n_layers: int, budget: int, n_sink: int, strength: float):
        self.budget, self.protected, self.strength = budget, n_sink + OBS_WINDOW, strength
        self.least = least_h2o_budget(n_sink, OBS_WINDOW)  # a squeezed layer keeps a row beside what it must keep
        self.layers: list = [None] * n_layers
        self._reports: dict[int, mx.array] = {}
        self.similarities = self.budgets = None

    finalized = property(lambda self: self.budgets is not None)

    def report(self, layer_id: int, similarity: mx.array) -> None:
        self._reports[layer_id] = similarity
        if len(self._reports) == len(self.layers):
            self.finalize()

    def finalize(self) -> None:
        ids = sorted(self._reports)
        got = dict(zip(ids, mx.stack([self._reports[i] for i in ids]).tolist() if ids else []))  # one host read
        mean = sum(got.values()) / len(got) if got else 0.0  # a layer that never reported counts as average
        self.similarities = [float(got.get(i, mean)) for i in range(len(self.layers))]
        self.budgets = squeeze_budgets(self.similarities, self.budget, self.protected, self.strength, self.least)
        self._reports = {}
        for layer, b, c in zip(self.layers, self.budgets, self.similarities):
            layer.adopt(b, c)


@register_with_mlx_lm
@register("squeeze")
class SqueezeAttentionCache(VotingEviction):
    """H2O eviction with per-layer budgets reallocated by how little each layer changes the hidden states."""
    chunk_invariant, exact_trim = False, False  # budgets set on the 1st pass; decode rows vote, evict
    scalar_fields = VotingEviction.scalar_fields + ("squeezed", "similarity_value")
    h2o_votes = True
    #: reports ``for_model`` installs (``dispatch.report_io``): module -> the method it calls
    io_hooks = {"attention": "observe_attention_output", "layer": "observe_layer_io"}
    layer_id = coordinator = None
    squeezed = False  # True once this layer's budget is resolved (state: survives reloads)
    similarity_value = 0.0
    _attn_out = None  # this layer's attention output of the first call, until the layer reports

    def __init__(self, config, layer_id=None, coordinator=None):
        super().__init__(config)
        self.layer_id, self.coordinator = layer_id, coordinator
        if coordinator is not None:
            coordinator.layers[layer_id] = self

    @classmethod
    def build_layers(cls, layer_configs):
        coord = None
        if len(layer_configs) > 1 and layer_configs[0].squeeze_resolved_budget is None:
            o = layer_configs[0].options
            coord = SqueezeCoordinator(len(layer_configs), o.budget, o.n_sink, float(o.strength))
        return [cls(cfg, layer_id=i, coordinator=coord) for i, cfg in enumerate(layer_configs)]

    _waiting = property(lambda self: self.coordinator is not None and not self.squeezed)

    def _store(self, keys, values):
        if self._waiting and self.offset > 0:
            # a later call, yet some layer never reported: resolve with what was measured, before this
            # call's rows are stored (so every layer is evicted between calls)
            self.coordinator.finalize()
        super()._store(keys, values)

    def wants_eviction(self, n_new):
        return not self._waiting and super().wants_eviction(n_new)

    def observe_attention_output(self, x, out) -> None:
        """The attention module's output ``a`` [B, L, hidden] of the first call (kept until the layer reports)."""
        if self._waiting:
            self._attn_out = out

    def observe_layer_io(self, h, out):
        """The decoder layer's input ``h`` of the first call: report ``cos(h, h + a)`` to the coordinator and
        return the layer's output tied to it (``mx.depends``): left lazy to the coordinator's read it kept every
        layer's ``h`` and ``a`` alive (2x the plain cache's peak, 1023 tokens of SmolLM2 in one chunk)."""
        if self._waiting and self._attn_out is not None:
            a, self._attn_out = self._attn_out, None
            if a.shape == h.shape:
                similarity = hidden_similarity(h, a)
                self.coordinator.report(self.layer_id, similarity)
                return mx.depends(out, similarity) if isinstance(out, mx.array) else None
        return None

    def adopt(self, budget: int, similarity: float) -> None:
        """Take the resolved budget and evict down to it (after this call's attention was computed)."""
        self.budget, self.squeezed, self.similarity_value = int(budget), True, float(similarity)
        self._attn_out = None
        if self.rows > self.budget:
            self.evict(self.score(None, None, None))

    similarity = property(lambda self: self.similarity_value,
                          doc="Mean cos(h, h + a) on the first forward pass (0.0 before; the others' mean if missing).")
    concentration = property(lambda self: 1.0 - self.similarity_value if self.squeezed else 0.0,
                             doc="The spec's name for ``1 - similarity`` (0.0 before the first forward pass).")
    squeeze_kept_bytes = VotingEviction.kept_bytes
