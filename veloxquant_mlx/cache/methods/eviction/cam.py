"""CaM (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024, PMLR 235): H2O chooses
the kept rows (``VotingEviction.h2o_votes``) and each evicted value is merged into kept ones (``merge="drop"``:
plain H2O). Evicted row i goes to kept rows j with weights ``s_ij`` (summing to 1): ``"mean"`` (the paper's) over
the ``MERGE_SPAN`` kept rows after it, ``"sim_weighted"`` by ``softmax_j(cos(k_i - c, k_j - c) / SIM_TEMPERATURE)``
(c: the mean kept key). With ``a`` the observation attention, ``abar_i = sum_j s_ij a_j`` and ``o = sum a v``, the
paper's Bernoulli gate (``cam_merge_gate``; off: its expectation ``s_ij p_i``) merges with probability ``p_i =
min(1, a_i / abar_i)``: ``v_j += s_ij (v_i - o)``, exact for the observation queries' output when ``a_i <= abar_i``.
Draws are seeded by ``config.seed``, layer and position; ``cam_merge_keys`` also moves each target key to the
merge-weighted mean of its keys.

Deviations:
* The paper adds ``v_i / m``, counting the evicted mass twice after the softmax renormalises: KL 4.3 nats on
  SmolLM2-135M at a 25% budget vs 0.051 dropping; merging ``v_i - o``: 0.050 ("mean"), 0.044 ("sim_weighted").
* Evictions are batched (prefill chunks, slack) and merge at once, per KV head; ``"sim_weighted"`` and
  ``cam_merge_keys`` are additions (temperature 0.1: 0.081, 0.3: 0.046, 1.0: 0.044); sinks (an addition) are
  never targets; ``a`` is the last ``OBS_WINDOW`` queries' attention of the latest call (keys without dispatch).
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import VotingEviction

MERGE_SPAN = 32  # "mean": an evicted value is spread over this many following kept rows (paper: 32)
SIM_TEMPERATURE = 1.0  # "sim_weighted": softmax temperature on the cosine of centred keys


def merge_weights(mode: str, pos_kept, pos_gone, keys_kept, keys_gone, n_sink_rows: int):
    """[B, H, E, K] weights ``s_ij`` of evicted row i on kept row j (rows sum to 1, sinks get 0)."""
    K, j = pos_kept.shape[-1], mx.arange(pos_kept.shape[-1])
    if mode == "mean":
        m = min(MERGE_SPAN, K - n_sink_rows)
        rank = (pos_kept[..., None, :] < pos_gone[..., :, None]).sum(axis=-1)  # kept rows before i
        start = mx.clip(rank, n_sink_rows, K - m)[..., None]
        return ((j >= start) & (j < start + m)).astype(mx.float32) / m
    kk, kg = keys_kept.astype(mx.float32), keys_gone.astype(mx.float32)
    centre = kk.mean(axis=2, keepdims=True)  # keys share a large common component: remove it
    kk, kg = (x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-6) for x in (kk - centre, kg - centre))
    logits = (kg @ kk.swapaxes(-1, -2)) / SIM_TEMPERATURE
    return mx.softmax(mx.where(j >= n_sink_rows, logits, -mx.inf), axis=-1, precise=True)


@register_with_mlx_lm
@register("cam")
class CaMKVCache(VotingEviction):
    """H2O eviction whose evicted values are merged into the kept ones."""
    chunk_invariant, exact_trim = False, False  # merges per prefill chunk; decode rows vote, evict, merge
    array_fields = VotingEviction.array_fields + ("attn",)
    row_fields = ("votes", "attn")
    scalar_fields = VotingEviction.scalar_fields + ("layer_id",)
    h2o_votes = True
    layer_id = 0  # decorrelates the layers' gate draws
    layer_field = "layer_id"

    def observe(self, weights, first=0, total=None):
        """Votes from every row; ``attn``: the mean over the call's last ``obs_window`` rows (tiles add to it)."""
        super().observe(weights, first, total)
        n = weights.shape[3]
        window = min(self.obs_window, total or n)
        start = (total or n) - window - first  # the window's first row in this tile (< 0: before it)
        if start >= n:
            return
        part = weights[..., max(start, 0) :, :].sum(axis=(2, 3)) / (weights.shape[2] * window)
        rows = self.rows
        self.attn[:, :, :rows] = part if start >= 0 else self.attn[:, :, :rows] + part

    def _drop(self, scores, keep):
        rows, o = self.rows, self.config.options
        order = mx.argsort(-self._guarded(scores), axis=-1)
        kept, gone = mx.sort(order[..., :keep], axis=-1), order[..., keep:]
        if o.merge == "drop":
            return self.keep_rows(kept)
        take = lambda a, idx: mx.take_along_axis(a[:, :, :rows], idx[..., None] if a.ndim == 4 else idx, axis=2)
        keys_k, keys_g = take(self.keys, kept), take(self.keys, gone)
        vals_k, vals_g = take(self.values, kept).astype(mx.float32), take(self.values, gone).astype(mx.float32)
        n_sink_rows = min(self.n_sink, self.offset)  # sinks are protected: the first kept rows
        s = merge_weights(o.merge, take(self.positions, kept), take(self.positions, gone), keys_k, keys_g, n_sink_rows)
        abar = (s * take(self.attn, kept)[..., None, :]).sum(axis=-1)
        p = mx.minimum(take(self.attn, gone) / mx.maximum(abar, 1e-30), 1.0)  # the paper's merge probability
        if o.merge_gate:  # seeded by the config, the layer and the position
            key = mx.random.key((self.config.seed * 1_000_003 + self.layer_id * 10_007 + self.offset) % (1 << 63))
            s = s * mx.random.bernoulli(p, key=key)[..., None].astype(mx.float32)
        else:
            s = s * p[..., None]  # the gated merge's expectation
        vals = self.values[:, :, :rows].astype(mx.float32)
        out = (self.attn[:, :, :rows, None] * vals).sum(axis=2, keepdims=True)  # o per head
        w = s.swapaxes(-1, -2)  # [B, H, K, E]
        self.keep_rows(kept)  # (the gathers above read the arrays held before)
        self.values[:, :, :keep] = (vals_k + w @ (vals_g - out)).astype(self.values.dtype)
        if o.merge_keys:
            new_keys = keys_k.astype(mx.float32) + w @ keys_g.astype(mx.float32)
            self.keys[:, :, :keep] = (new_keys / (1.0 + w.sum(axis=-1, keepdims=True))).astype(self.keys.dtype)

    cam_kept_bytes = VotingEviction.kept_bytes
