"""ChunkKV (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", arXiv 2502.00299): tokens are kept or evicted in chunks of ``chunkkv_chunk_size``, so kept context
stays contiguous. A chunk scores the sum of its tokens' SnapKV votes (``"attn_mass"``) or minus their key norms
(``"key_norm"``); the top chunks are kept with the window and the first ``chunkkv_n_sink`` tokens. In each group of
``chunkkv_reuse_layers`` layers the leader selects and the followers reuse its indices (the
``ChunkKVIndexReuseCoordinator`` of ``build_layers``, one per prompt cache), scoring nothing.

Deviations:
* Chunks sit on absolute positions (chunk ``j``: ``n_sink + j*C`` to ``n_sink + (j+1)*C - 1``) and the window
  starts on a chunk boundary (``OBS_WINDOW`` to ``OBS_WINDOW + C - 1`` tokens), so a layer keeps ``protected +
  k*C`` rows, ``k = (budget - protected) // C``; after a trim into an evicted range one partial chunk may be kept.
* One selection per layer for all KV heads (votes summed), as index reuse needs.
* Decoding is compressed too; sinks are an addition; the default chunk size is 8 (the paper's: 10).
* A follower whose leader did not evict at the same step from the same rows selects by key norm; a reloaded
  prompt cache relinks each group (the leader, loaded first, brings a fresh coordinator).
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import VotingEviction, check_min
from ..layer_links import relink, relinking_state


class ChunkKVIndexReuseCoordinator:
    """Kept-row indices of each group leader's latest eviction, for the followers of its group."""

    def __init__(self, reuse_layers: int):
        self.reuse_layers, self.records = reuse_layers, {}  # layer -> (offset, rows, kept-row indices)

    def leader_of(self, layer_id: int) -> int:
        return layer_id - layer_id % self.reuse_layers

    def published(self, layer_id: int):
        """The indices ``layer_id`` last published (held here until it publishes again), or None."""
        return self.records.get(layer_id, (None,) * 3)[2]

    def lookup(self, layer_id: int, offset: int, rows: int):
        """The leader's indices if it evicted at this same step from the same number of rows."""
        rec = self.records.get(self.leader_of(layer_id), (None,) * 3)
        return rec[2] if rec[:2] == (offset, rows) else None


def key_norm_scores(keys: mx.array) -> mx.array:
    """[B, H, rows]: minus the L2 norm of each key (low-norm keys attract attention)."""
    k = keys.astype(mx.float32)
    return -mx.sqrt((k * k).sum(axis=-1))


@register_with_mlx_lm
@register("chunkkv")
class ChunkKVCache(VotingEviction):
    """Chunk-granular observation-window eviction with layer-wise index reuse."""
    chunk_invariant, exact_trim = False, False  # votes per prefill chunk; decode rows vote, evict
    layer_id = coordinator = None
    reuse_id = ""  # one id per prompt cache's set of layers that reuse indices ("": built alone)
    scalar_fields = VotingEviction.scalar_fields + ("layer_id", "reuse_id")

    def __init__(self, config, layer_id=None, coordinator=None):
        super().__init__(config)
        self.layer_id, self.coordinator = layer_id, coordinator

    def held_arrays(self):
        """The stored rows, plus the kept-row indices this layer published for its followers."""
        out = super().held_arrays()
        idx = self.coordinator.published(self.layer_id) if self.coordinator is not None else None
        return out + [idx] if idx is not None else out

    def _init_layout(self):
        o = self.config.options
        self.n_sink, self.chunk_size, self.score_mode, self.budget = o.n_sink, o.chunk_size, o.score, o.budget
        check_min("chunkkv_budget", self.budget, self.n_sink + self.obs_window + 2 * self.chunk_size - 1,
                  f"chunkkv_n_sink + {self.obs_window} + 2 * chunkkv_chunk_size - 1 (sinks, the window "
                  "with its chunk overhang, and one chunk)")

    @classmethod
    def build_layers(cls, layer_configs):
        reuse = layer_configs[0].options.reuse_layers if layer_configs else 1
        coord = ChunkKVIndexReuseCoordinator(reuse) if reuse > 1 and len(layer_configs) > 1 else None
        caches = [cls(cfg, layer_id=i, coordinator=coord) for i, cfg in enumerate(layer_configs)]
        uid = uuid.uuid4().hex if coord is not None else ""
        for c in caches:
            c.reuse_id = uid
        return caches

    def _relink_loaded(self):
        if not self.reuse_id or self.layer_id is None:
            return
        reuse = self.config.options.reuse_layers
        leader = self.layer_id - self.layer_id % reuse
        self.coordinator = relink(f"{self.reuse_id}:{leader}", leader == self.layer_id,
                                  lambda: ChunkKVIndexReuseCoordinator(reuse), "ChunkKVCache: the leader layer")

    state = relinking_state()

    @property
    def is_index_reuse_leader(self) -> bool:
        c, i = self.coordinator, self.layer_id
        return c is None or i is None or c.leader_of(i) == i

    @property
    def uses_attention_weights(self) -> bool:
        return self.score_mode == "attn_mass" and self.is_index_reuse_leader

    def _recent_start(self) -> int:
        """First protected recent position: ``offset - OBS_WINDOW`` rounded down to a chunk boundary."""
        ns, start = self.n_sink, self.offset - self.obs_window
        return ns if start <= ns else ns + (start - ns) // self.chunk_size * self.chunk_size

    def score(self, obs_queries, obs_positions, scale):
        if not self.is_index_reuse_leader:
            return None  # followers reuse the leader's selection
        if self.score_mode == "key_norm":
            return key_norm_scores(self.keys[:, :, : self.rows])
        return self.votes[:, :, : self.rows]

    def _drop(self, scores, keep):
        if not self.is_index_reuse_leader:
            idx = self.coordinator.lookup(self.layer_id, self.offset, self.rows)
            if idx is not None:
                self.keep_rows(idx)
                return
            scores = key_norm_scores(self.keys[:, :, : self.rows])
        idx = self.select_chunks(scores)
        if self.coordinator is not None:
            self.coordinator.records[self.layer_id] = (self.offset, self.rows, idx)
        self.keep_rows(idx)

    def select_chunks(self, scores: mx.array) -> mx.array:
        """Row indices [B, H, K] (ascending, the same for every head): protected rows and the best chunks."""
        B, H = scores.shape[:2]
        ns, C, off = self.n_sink, self.chunk_size, self.offset
        r0 = self._recent_start()
        n_prot = min(ns, off) + off - r0  # sinks and [r0, offset) are always held
        k = (self.budget - n_prot) // C
        n_keep = n_prot + k * C
        pos = self.positions[:, 0, : self.rows]  # positions are the same in every head
        prot = (pos < ns) | (pos >= r0)
        n_chunks = (r0 - ns) // C
        cid = mx.where(prot, n_chunks, (pos - ns) // C)  # protected rows go to an extra bucket
        b = mx.broadcast_to(mx.arange(B)[:, None], cid.shape)
        row = scores.astype(mx.float32).sum(axis=1)
        totals = mx.zeros((B, n_chunks + 1), mx.float32).at[b, cid].add(row)
        counts = mx.zeros((B, n_chunks + 1), mx.float32).at[b, cid].add(mx.ones_like(row))
        valid = (counts > 0) & (mx.arange(n_chunks + 1) < n_chunks)
        totals = mx.where(valid, totals, -mx.inf)
        keep = prot
        if k > 0:
            top = mx.argpartition(-totals, kth=k - 1, axis=-1)[:, :k]
            keep = keep | (cid[:, :, None] == top[:, None, :]).any(axis=-1)
        idx = mx.argpartition(-keep.astype(mx.float32), kth=n_keep - 1, axis=-1)[:, :n_keep]
        idx = mx.sort(idx, axis=-1).astype(mx.int32)
        return mx.broadcast_to(idx[:, None, :], (B, H, n_keep))

    chunkkv_kept_bytes = VotingEviction.kept_bytes
