"""RocketKV (Behnam et al., "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage KV Cache Compression",
arXiv 2502.14051): the ratio c = ``rocketkv_compression_ratio`` splits into c1 = sqrt(c) and c2 = c / c1. Stage 1
(SnapKV++): after each prefill chunk the last ``rocketkv_obs_window`` queries vote (GQA-summed, pooled) and each KV
head keeps ceil(offset / c1) rows, sinks and window included; decode rows are all kept. Stage 2 (hybrid sparse
attention): keys form pages of ``page_size`` rows with element-wise max / min summaries; a decode query's
``head_topk1`` largest |q| channels (group-summed) bound each page's logits, and the top ceil(n_pages / c2) pages
(softmax of the bounds, group-summed) plus sink and recent pages are attended. Defaults (s = sqrt(c2)):
``head_topk1 = round(head_dim / s)``, ``page_size`` the power of two >= 2 s, so the summaries read stay below 1/c2
of the keys.

Deviations: fixed pooling kernel 7 and an even sqrt split (the paper adapts / tunes them); no second token ranking
inside the selected pages; stage 2 needs the dispatch point (else dense, stage 1 scoring with keys);
``select_indices`` returns stored-row indices.
"""

from __future__ import annotations

import math
import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...eviction import EvictionKVCache
from ...primitives.buffers import grow_rows, take_rows
from ...window import Partials, finish_partials, scaled_rows
from .snapkv import SnapKVKVCache


@register_with_mlx_lm
@register("rocketkv")
class RocketKVKVCache(EvictionKVCache):
    """SnapKV++ prompt eviction (stage 1) + paged hybrid sparse attention at decode (stage 2)."""
    chunk_invariant, exact_trim = False, True  # stage 1 cuts each prefill chunk; decode rows are kept
    array_fields = EvictionKVCache.array_fields + ("page_max", "page_min")
    last_attended_rows = 0  # rows the last sparse decode step attended (diagnostic)

    def _init_layout(self):
        o, d = self.config.options, self.config.head_dim
        self.ratio = float(o.compression_ratio)
        self.stage1_ratio = math.sqrt(self.ratio)
        self.stage2_ratio = self.ratio / self.stage1_ratio
        self.obs_window, self.n_sink, self.recent = o.obs_window, o.n_sink, o.obs_window
        s = math.sqrt(self.stage2_ratio)
        self.head_topk1 = o.head_topk1 or max(1, min(d, round(d / s)))
        self.page_size = o.page_size or max(2, 2 ** math.ceil(math.log2(2 * s)))
        if self.head_topk1 > d:
            raise QuantizerConfigError("rocketkv_head_topk1", self.head_topk1, f"an int <= head_dim={d}")
        self.budget = self.n_sink + self.recent

    def wants_eviction(self, n_new):
        if n_new == 1:
            return False  # decode tokens are kept; stage 2 handles them
        self.budget = max(math.ceil(self.offset / self.stage1_ratio), self.n_sink + self.recent)
        return self.rows > self.budget

    score = SnapKVKVCache.score  # stage 1: SnapKV's pooled votes (prefill chunks only)
    qring = None  # no decode-time query ring (SnapKV's ``decode_evict``)
    n_pages = property(lambda self: -(-self.rows // self.page_size))

    def _refresh_pages(self, from_row: int) -> None:
        """Recompute the max/min summaries of the pages holding rows ``from_row`` .. rows - 1."""
        P, p1 = self.page_size, self.n_pages
        p0 = from_row // P
        if p1 <= p0:
            return
        seg = self.keys[:, :, p0 * P : self.rows]
        B, H, n, D = seg.shape
        pad, lo, hi = (p1 - p0) * P - n, seg, seg
        if pad:  # whole pages: fill with +-inf
            fill = mx.full((B, H, pad, D), mx.inf, dtype=seg.dtype)
            lo, hi = mx.concatenate([seg, fill], axis=2), mx.concatenate([seg, -fill], axis=2)
        self.page_min = grow_rows(self.page_min, p0, lo.reshape(B, H, p1 - p0, P, D).min(axis=3))
        self.page_max = grow_rows(self.page_max, p0, hi.reshape(B, H, p1 - p0, P, D).max(axis=3))

    def _store(self, keys, values):
        super()._store(keys, values)  # (a pending eviction runs first, and may shrink the rows held before)
        self._refresh_pages(self.rows - keys.shape[2])

    def keep_rows(self, idx):
        super().keep_rows(idx)
        self.page_max = self.page_min = None
        self._refresh_pages(0)

    def _trimmed(self, n):
        self._refresh_pages(self.rows)  # the last page is partial again

    def n_selected_pages(self, keep_recent: int | None = None) -> int:
        """Pages attended per decode step: the top ceil(n_pages / c2) plus sink and recent pages."""
        keep_recent = self.recent if keep_recent is None else keep_recent
        P, n = self.page_size, self.n_pages
        forced = -(-self.n_sink // P) + -(-keep_recent // P) + 1
        return min(n, math.ceil(n / self.stage2_ratio) + forced)

    def _page_scores(self, q: mx.array, keep_recent: int) -> mx.array:
        """q [B, H, rep, D] decode queries of each KV head's group -> [B, H, n_pages] (forced = inf)."""
        n, P, rows = self.n_pages, self.page_size, self.rows
        k1 = min(self.head_topk1, q.shape[-1])
        q = q.astype(mx.float32)
        ch = mx.argpartition(-mx.abs(q).sum(axis=2), kth=k1 - 1, axis=-1)[..., :k1]  # [B, H, k1]
        qs = mx.take_along_axis(q, ch[:, :, None, :], axis=-1)[:, :, :, None, :]  # [B, H, rep, 1, k1]
        hi = mx.take_along_axis(self.page_max[:, :, :n], ch[:, :, None, :], axis=-1).astype(mx.float32)
        lo = mx.take_along_axis(self.page_min[:, :, :n], ch[:, :, None, :], axis=-1).astype(mx.float32)
        bound = mx.maximum(qs * hi[:, :, None], qs * lo[:, :, None]).sum(-1)  # [B, H, rep, n]
        score = mx.softmax(bound * q.shape[-1] ** -0.5, axis=-1, precise=True).sum(axis=2)
        page = mx.arange(n)
        forced = (page < -(-self.n_sink // P)) | (page >= max(rows - keep_recent, 0) // P)
        return mx.where(forced, mx.inf, score)

    def _select_rows(self, q: mx.array, keep_recent: int):
        """Batched selection: (row indices [B, H, S] ascending, valid mask [B, H, S])."""
        n_sel, P = self.n_selected_pages(keep_recent), self.page_size
        score = self._page_scores(q, keep_recent)
        pages = mx.sort(mx.argpartition(-score, kth=n_sel - 1, axis=-1)[..., :n_sel], axis=-1)
        idx = (pages[..., None] * P + mx.arange(P)).reshape(*pages.shape[:2], n_sel * P)
        valid = idx < self.rows
        return mx.minimum(idx, self.rows - 1).astype(mx.int32), valid

    def select_indices(self, query: mx.array, b: int, h: int, keep_recent: int = 0) -> mx.array:
        """Stage-2 row indices (int32, ascending) of KV head (b, h) for ``query`` [D] or [rep, D] (a diagnostic)."""
        q = query.reshape(1, 1, -1, query.shape[-1])
        idx, valid = self._select_rows(mx.broadcast_to(q, self.page_max.shape[:2] + q.shape[2:]), keep_recent)
        return mx.array([i for i, v in zip(idx[b, h].tolist(), valid[b, h].tolist()) if v], dtype=mx.int32)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        B, Hq, N, D = queries.shape
        if N > 1 or sinks is not None or self.n_selected_pages() >= self.n_pages:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        H = self.keys.shape[1]
        idx, valid = self._select_rows(queries.reshape(B, H, Hq // H, D), self.recent)
        if native.available() and self.recent > 0 and isinstance(mask, (str, type(None))):
            # the last page is forced (it holds recent rows), so the clamped rows past the end are idx's last ones:
            # cut off, and the rows read in place by one primitive (no float32 copy, no mask)
            n = idx.shape[-1] - (self.n_pages * self.page_size - self.rows)
            k, v = (take_rows(a, idx[..., :n]) for a in (self.keys, self.values))
            self.last_attended_rows = n
            return finish_partials(queries, scaled_rows(queries, H, scale), Partials.empty(B, H, Hq // H, v.shape[-1]),
                                   [(k, v)], None)
        k, v = (mx.take_along_axis(a, idx[..., None], axis=2).astype(queries.dtype) for a in (self.keys, self.values))
        m = mx.broadcast_to(valid[:, :, None, None, :], (B, H, Hq // H, 1, idx.shape[-1]))
        self.last_attended_rows = idx.shape[-1]
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=m.reshape(B, Hq, 1, -1))

    full_fp16_bytes_total, tokens_total = EvictionKVCache.full_seq_bytes, EvictionKVCache.tokens_seen
    stage1_bytes = property(lambda self: sum(a.nbytes for a in (self.keys, self.values, self.positions)
                                             if a is not None))
    stage2_aux_bytes = property(lambda self: sum(a.nbytes for a in (self.page_max, self.page_min) if a is not None))
