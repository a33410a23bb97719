"""CaM (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024, PMLR 235).

Eviction perturbs the attention output; CaM reduces that by merging each to-be-evicted value into
values that stay. Which rows stay is decided by accumulated attention (H2O: every query's softmax
probabilities summed per row, ``VotingEviction.h2o_votes``; the first ``n_sink`` tokens and the newest
half of the budget are protected); ``merge="drop"`` stops there (plain H2O eviction). Otherwise evicted row ``i`` is merged
into targets ``j`` with weights ``s_ij`` (each row of ``s`` sums to 1): ``"mean"`` -- the paper's rule --
spreads it evenly over the ``m = MERGE_SPAN`` kept rows that follow it in position; ``"sim_weighted"``
over all kept rows by key similarity, ``s_ij = softmax_j(cos(k_i - c, k_j - c) / SIM_TEMPERATURE)``
(``c`` the mean kept key). With ``a`` the attention of the latest observation queries, ``abar_i =
sum_j s_ij a_j`` that of i's targets and ``o = sum a v`` the observation output, the paper's Bernoulli
merge mask (``cam_merge_gate=True``, the default) merges row ``i`` with probability
``p_i = min(1, a_i / abar_i)``, as ``v_j += s_ij (v_i - o)``; ``cam_merge_gate=False`` merges every
evicted row with the mask's expectation, ``v_j += s_ij p_i (v_i - o)``. Whenever ``a_i <= abar_i`` (the
usual case: evicted rows draw less attention than the rows kept), ``sum_j a_j dv_j = sum_i a_i (v_i - o)``,
so the observation queries' attention-weighted value mass over the kept rows, ``sum a v / sum a``, is
exactly the one over all rows before the eviction; the gated merge equals it in expectation. Draws
are seeded from ``config.seed``, the layer and the position (reproducible). ``cam_merge_keys=True`` also
moves each target key to the mean of itself and the keys merged into it (weighted by the merges).

Deviations from the paper:
* Merged quantity: the paper adds ``v_i / m`` itself. After an eviction the softmax renormalises over the
  kept rows, which already hands the evicted attention mass ``A`` to them; adding the values too counts
  it twice and scales the output by about ``1 / (1 - A)``: negligible for one token per step, ruinous
  when a prefill evicts most of a prompt at once (measured: KL 4.3 nats on SmolLM2-135M at a 25%
  budget, vs 0.051 for dropping). Merging the deviation ``v_i - o`` is what keeps the observation
  output exact (same budget: 0.050 "mean", 0.044 "sim_weighted").
* The paper merges one token at a time as it leaves a StreamingLLM/H2O window; here evictions are
  batched (a prefill chunk, or the default slack's decode rows at once: ``eviction``'s module
  docstring) and all evicted rows merge at once, per KV head. ``"sim_weighted"`` (a soft version of merging into
  the most similar kept key) and ``cam_merge_keys`` are additions; the temperature was chosen on the
  measurement above (0.1: 0.081, 0.3: 0.046, 1.0: 0.044). Sinks (positions < ``cam_n_sink``) are never
  merge targets (their large attention would amplify a merged value); sinks are themselves an addition.
* ``a`` is the attention of the latest call's last ``OBS_WINDOW`` queries (averaged over them and over
  the query heads of each KV head): real queries with the dispatch point, keys standing in without.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import VotingEviction, check_min

MERGE_SPAN = 32  # "mean": an evicted value is spread over this many following kept rows (paper: 32)
SIM_TEMPERATURE = 1.0  # "sim_weighted": softmax temperature on the cosine of centred keys


def merge_weights(mode: str, pos_kept, pos_gone, keys_kept, keys_gone, n_sink_rows: int):
    """[B, H, E, K] weights ``s_ij`` of evicted row i on kept row j (rows sum to 1, sinks get 0)."""
    K = pos_kept.shape[-1]
    j = mx.arange(K)
    if mode == "mean":
        m = min(MERGE_SPAN, K - n_sink_rows)
        rank = (pos_kept[..., None, :] < pos_gone[..., :, None]).sum(axis=-1)  # kept rows before i
        start = mx.clip(rank, n_sink_rows, K - m)[..., None]
        return ((j >= start) & (j < start + m)).astype(mx.float32) / m
    kk, kg = keys_kept.astype(mx.float32), keys_gone.astype(mx.float32)
    centre = kk.mean(axis=2, keepdims=True)  # keys share a large common component: remove it
    kk, kg = kk - centre, kg - centre
    kk = kk / mx.maximum(mx.linalg.norm(kk, axis=-1, keepdims=True), 1e-6)
    kg = kg / mx.maximum(mx.linalg.norm(kg, axis=-1, keepdims=True), 1e-6)
    logits = (kg @ kk.swapaxes(-1, -2)) / SIM_TEMPERATURE
    logits = mx.where(j >= n_sink_rows, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True)


@register_with_mlx_lm
@register("cam")
class CaMKVCache(VotingEviction):
    """H2O eviction whose evicted values are merged into the kept ones."""
    # eviction (with value merging) per prefill chunk; batched (slack) decode eviction
    chunk_invariant = False
    exact_trim = False  # decode rows add votes, evict and merge (slack)

    array_fields = VotingEviction.array_fields + ("attn",)
    row_fields = ("votes", "attn")
    scalar_fields = VotingEviction.scalar_fields + ("layer_id",)
    h2o_votes = True
    layer_id = 0  # decorrelates the layers' gate draws

    def __init__(self, config, layer_id: int = 0):
        super().__init__(config)
        self.layer_id = layer_id

    def _init_layout(self):
        o = self.config.options
        self.budget, self.n_sink, self.merge_mode, self.merge_keys, self.merge_gate = (
            o.budget, o.n_sink, o.merge, o.merge_keys, o.merge_gate)
        check_min("cam_budget", self.budget, self.n_sink + self.obs_window + 1, f"cam_n_sink + {self.obs_window} + 1")

    @classmethod
    def build_layers(cls, layer_configs):
        return [cls(c, layer_id=i) for i, c in enumerate(layer_configs)]

    def observe(self, weights):
        super().observe(weights)
        n = self.rows
        self.attn[:, :, :n] = weights[..., -self.obs_window :, :].mean(axis=(2, 3))

    def evict(self, scores, keep=None):
        self._pending = False
        keep = self.budget if keep is None else keep
        if self.rows <= keep:
            return
        rows = self.rows
        scores = mx.where(self.protected(), mx.inf, scores.astype(mx.float32))
        order = mx.argsort(-scores, axis=-1)
        kept, gone = mx.sort(order[..., :keep], axis=-1), order[..., keep:]
        if self.merge_mode == "drop":
            self.keep_rows(kept)
            return
        take = lambda a, idx: mx.take_along_axis(a[:, :, :rows], idx[..., None] if a.ndim == 4 else idx, axis=2)
        keys_k, keys_g = take(self.keys, kept), take(self.keys, gone)
        vals_k, vals_g = take(self.values, kept).astype(mx.float32), take(self.values, gone).astype(mx.float32)
        n_sink_rows = min(self.n_sink, self.offset)  # sinks are protected: the first kept rows
        s = merge_weights(self.merge_mode, take(self.positions, kept), take(self.positions, gone), keys_k, keys_g,
                          n_sink_rows)
        attn_k, attn_g = take(self.attn, kept), take(self.attn, gone)
        abar = (s * attn_k[..., None, :]).sum(axis=-1)
        p = mx.minimum(attn_g / mx.maximum(abar, 1e-30), 1.0)  # the paper's merge probability
        if self.merge_gate:
            s = s * mx.random.bernoulli(p, key=self._gate_key())[..., None].astype(mx.float32)
        else:
            s = s * p[..., None]  # the gated merge's expectation
        vals = self.values[:, :, :rows].astype(mx.float32)
        out = (self.attn[:, :, :rows, None] * vals).sum(axis=2, keepdims=True)  # o per head
        w = s.swapaxes(-1, -2)  # [B, H, K, E]
        new_vals = vals_k + w @ (vals_g - out)
        new_keys = None
        if self.merge_keys:
            mass = w.sum(axis=-1, keepdims=True)
            new_keys = (keys_k.astype(mx.float32) + w @ keys_g.astype(mx.float32)) / (1.0 + mass)
        self.keep_rows(kept)
        self.values[:, :, :keep] = new_vals.astype(self.values.dtype)
        if new_keys is not None:
            self.keys[:, :, :keep] = new_keys.astype(self.keys.dtype)

    def _gate_key(self):
        return mx.random.key((self.config.seed * 1_000_003 + self.layer_id * 10_007 + self.offset) % (1 << 63))

    cam_kept_bytes = VotingEviction.kept_bytes
