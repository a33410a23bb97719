"""A2ATS (He, Xing, Wang, Xu, Wu, Zhou, Liu, Xue, Li, ACL Findings 2025, arXiv 2502.12665): each decode step
attends only to the top-K tokens (plus a recent window), scored from vector-quantized keys with a per-query lookup
table; the codebook is trained query-aware (metric weighted by ``E[q q^T]``).

Every row is held float16 plus its key codes (``D / a2ats_sub_dim`` sub-vectors of a per-layer k-means codebook
of ``2**a2ats_codebook_bits`` codewords, fitted once attention sees ``FIT_MIN`` rows, some outside the window, or
given as ``a2ats_codebook``). ``a2ats_use_query_aware``: k-means in the per-block metric ``M_j = (1 - beta) I
tr(H_j)/sub + beta H_j = L_j L_j^T`` (``H``: ``a2ats_query_h`` or the fitting call's query second moment); keys
map to ``L_j^T k_j``, queries to ``L_j^{-1} q_j``. A decode step (dispatch point) keeps, per KV head, the top
``min(a2ats_b, ceil(a2ats_retrieval_fraction * candidates))`` coded tokens outside ``a2ats_window`` by LUT softmax
summed over the GQA group, and attends exactly over them, the window and the uncoded rows; other calls attend
densely. ``nbytes`` counts the float16 rows (this saves attended rows, not memory), ``resident_nbytes`` what the
paper keeps on the accelerator.

Deviations from the paper:

* No windowed RoPE: keys arrive post-RoPE of an unknown variant, so codes and scores use rotated keys
  (``a2ats_rope_base`` / ``a2ats_rope_scaling`` are validated and recorded only).
* The query metric is per sub-vector block (diagonal blocks of E[q q^T]) blended with the identity by
  ``a2ats_beta``; the codebook is fitted online per layer. No CPU offload, no heterogeneous pipeline.
* Trim is exact; a trim below the rows the codebook was fitted on drops it (refitted at the next attention).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ... import native
from ...attention import group_queries
from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...kernels._common import checked_encode
from ...primitives import bitpack
from ...primitives.buffers import dtype_name, grow_rows, take_rows
from ...window import Partials, concat_rows, finish_partials, fp16_row_bytes, scaled_rows
from .vecinfer import _as_array, fit_codebook, vq_assign

FIT_MIN = 32
ROW_DTYPE = mx.float16


@register_with_mlx_lm
@register("a2ats")
class A2ATSKVCache(CompressedKVCache):
    """A2ATS: float16 K/V store + VQ key codes for query-aware top-k retrieval at decode."""
    chunk_invariant = False  # codebook and query metric fitted on the first call of >= 32 rows, with its queries
    exact_trim = True  # float16 rows + per-token codes; trimming below the fit drops the codebook

    array_fields = ("keys", "values", "codes", "codebook", "metric_l", "metric_linv")
    scalar_fields = ("n_rows", "n_coded", "fit_rows", "dtype_name")

    n_rows = n_coded = fit_rows = 0
    dtype_name = "float16"
    last_selected = None  # [B, H, k] retrieved token indices of the last sparse step (diagnostic)

    def held_arrays(self):  # the last step's retrieved indices are held too, so counted
        out = super().held_arrays()
        return out + [self.last_selected] if self.last_selected is not None else out

    def _init_layout(self):
        o = self.config.options
        self.sub, self.cbits = o.sub_dim, o.codebook_bits  # sub_dim must divide the head dim: checked at the fit
        self.window, self.cap, self.frac = o.window, o.b, float(o.retrieval_fraction)
        self.query_aware, self.beta = o.use_query_aware, float(o.beta)
        self._given_cb = None if o.codebook is None else _as_array(o.codebook, "a2ats_codebook", (2,))
        if self._given_cb is not None and (self._given_cb.shape[-1] != self.sub
                                           or self._given_cb.shape[0] > (1 << self.cbits)):
            raise QuantizerConfigError("a2ats_codebook", tuple(self._given_cb.shape),
                                       f"[K, {self.sub}] with K <= 2**{self.cbits}")
        self._given_h = None if o.query_h is None else _as_array(o.query_h, "a2ats_query_h", (2, 3))
        self.last_selected = None

    def _store(self, keys, values):
        t0 = self.n_rows
        self.dtype_name = dtype_name(keys.dtype)
        self.keys = grow_rows(self.keys, t0, keys.astype(ROW_DTYPE))
        self.values = grow_rows(self.values, t0, values.astype(ROW_DTYPE))
        self.n_rows = t0 + keys.shape[2]
        self._call = (t0, keys, values)

    def stored_rows(self) -> int:
        return self.n_rows

    def _dense(self):
        n, dt = self.n_rows, getattr(mx, self.dtype_name)
        return self.keys[:, :, :n].astype(dt), self.values[:, :, :n].astype(dt)

    def _fetched(self, dtype):
        t0, keys, values = self._call
        past = (self.keys[:, :, :t0], self.values[:, :, :t0]) if t0 else (None, None)
        return concat_rows((past, (keys, values)), dtype)

    def _metric(self, queries, H):
        """Cholesky factors L_j [m, s, s] of the per-block metric."""
        D, s = self.keys.shape[-1], self.sub
        m = D // s
        eye = np.broadcast_to(np.eye(s), (m, s, s))
        if not self.query_aware:
            return eye
        if self._given_h is not None:
            h = np.asarray(self._given_h, dtype=np.float64)
            h = h.mean(axis=0) if h.ndim == 3 else h
            if h.shape != (D, D):
                raise QuantizerConfigError("a2ats_query_h", h.shape, f"[{D}, {D}] or [H, {D}, {D}]")
        else:
            q = group_queries(queries.astype(mx.float32), H).reshape(-1, D)
            h = np.asarray(q.T @ q / q.shape[0], dtype=np.float64)
        blocks = np.stack([h[j * s:(j + 1) * s, j * s:(j + 1) * s] for j in range(m)])
        tr = np.maximum(np.trace(blocks, axis1=1, axis2=2)[:, None, None] / s, 1e-6)
        return np.linalg.cholesky((1 - self.beta) * eye * tr + self.beta * blocks + 1e-6 * eye * tr)

    def _to_code_space(self, k32):
        """Keys [B, H, n, D] -> rows L_j^T k_j [B, H, n, m, s]."""
        B, H, n, D = k32.shape
        kb = k32.reshape(B, H, n, D // self.sub, self.sub)
        return (kb[..., None, :] @ self.metric_l).squeeze(-2)  # k^T L = (L^T k)^T

    def _fit(self, queries):
        H, n, D = self.keys.shape[1], self.n_rows, self.keys.shape[-1]
        if D % self.sub:
            raise QuantizerConfigError("a2ats_sub_dim", self.sub, f"a divisor of the head dim {D}")
        L = self._metric(queries, H)
        self.metric_l = mx.array(L.astype(np.float32))
        self.metric_linv = mx.array(np.linalg.inv(L).astype(np.float32))
        if self._given_cb is not None:
            self.codebook = self._given_cb[None].astype(mx.float16)
        else:
            x = self._to_code_space(self.keys[:, :, :n].astype(mx.float32)).reshape(1, -1, self.sub)
            self.codebook = fit_codebook(x, 1 << self.cbits, int(self.config.seed)).astype(mx.float16)
        self.fit_rows = n
        self.n_coded = 0  # every row is encoded next, by attend

    def _encode_pending(self):
        t0, t1 = self.n_coded, self.n_rows
        if t1 <= t0:
            return
        k = self.keys[:, :, t0:t1].astype(mx.float32)
        B, H, n, D = k.shape
        x = self._to_code_space(k).reshape(1, -1, self.sub)
        c = vq_assign(x, self.codebook).reshape(B, H, n, D // self.sub)
        self.codes = grow_rows(self.codes, t0, bitpack.pack_bits(c, self.cbits))
        self.n_coded = t1

    def lookup_table(self, q):
        """``(L_j^{-1} q_j) . c`` for every sub-vector j and codeword c: q [B, H, Q, D] -> [B, H, Q, m, K]."""
        B, H, Q, D = q.shape
        m, s = D // self.sub, self.sub
        qb = q.astype(mx.float32).reshape(B, H, Q, m, 1, s) @ self.metric_linv.swapaxes(-1, -2)
        return qb.squeeze(-2) @ self.codebook[0].astype(mx.float32).T

    def approx_scores(self, q, n):
        """Approximate ``q . k`` for the first ``n`` coded tokens: q [B, H, Q, D] -> [B, H, Q, n] from the
        LUT ``(L_j^{-1} q_j) . c`` over codewords, gathered at the codes."""
        B, H, Q, D = q.shape
        m = D // self.sub
        codes = bitpack.unpack_bits(self.codes[:, :, :n], self.cbits, m).astype(mx.int32)
        idx = mx.broadcast_to(codes.transpose(0, 1, 3, 2)[:, :, None], (B, H, Q, m, n))
        return mx.take_along_axis(self.lookup_table(q), idx, axis=-1).sum(axis=3)

    def retrieval_vote(self, q, n):
        """The GQA group's vote [B, H, n] over the first ``n`` coded tokens: each query row's softmax of the
        approximate scores, summed over the group. On the CPU one native pass over the codes (``vq_vote``; the op
        path -- a gather over [B, H, Q, m, n], a softmax, a sum -- checked against it at first use)."""
        op = lambda: mx.softmax(self.approx_scores(q, n), axis=-1, precise=True).sum(axis=2)  # noqa: E731
        if not native.available():
            return op()
        return checked_encode("a2ats_vote", lambda: native.module().vq_vote(self.lookup_table(q), self.codes, n,
                                                                            self.cbits), op)

    def n_retrieved(self, n_candidates: int) -> int:
        return min(self.cap, math.ceil(self.frac * n_candidates))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        B, Hq, N, D = queries.shape
        step = call is not None and N == 1 and keys.shape[2] == self.n_rows and (mask is None or isinstance(mask, str))
        due = self.n_rows >= max(FIT_MIN, self.window + 2)  # some rows outside the window, else none retrieved
        if call is not None and self.codebook is None and (N > 1 or step) and due:
            self._fit(queries)  # on the prefill or a decode step: their queries give the query-aware metric
        if call is not None and self.codebook is not None:
            self._encode_pending()
        T = self.n_rows
        cand = max(0, min(T - self.window - 1, self.n_coded))  # coded rows outside the window (and not this row)
        k = self.n_retrieved(cand)
        if not step or self.codebook is None or cand == 0 or k >= cand:
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        H = self.keys.shape[1]
        qg = group_queries(queries, H).reshape(B, H, Hq // H, D)
        w = self.retrieval_vote(qg * scale, cand)  # [B, H, cand]
        sel = mx.sort(mx.argpartition(-w, k - 1, axis=-1)[..., :k], axis=-1)  # [B, H, k] in token order
        self.last_selected = sel
        # the retrieved rows and the window from the stored rows, the call's own row as given: the rows
        # ``update_and_fetch`` returned (every row, concatenated and cast) are never evaluated (at 4k on the CPU
        # they were two thirds of a step)
        t0, dt = call[0], queries.dtype
        picked = [take_rows(buf, sel) for buf in (self.keys, self.values)]
        groups = [picked, (self.keys[:, :, cand:t0], self.values[:, :, cand:t0]), call[1:]]
        if native.available():  # the float16 rows read in place in one primitive (4k, CPU: 3.7 -> 1.2 ms a layer)
            qf = scaled_rows(queries, H, scale)
            return finish_partials(queries, qf, Partials.empty(B, H, Hq // H, call[2].shape[-1]),
                                   [g for g in groups if g[0].shape[2]], sinks)
        kk, vv = (mx.concatenate([g[i].astype(dt) for g in groups], axis=2) for i in (0, 1))
        return mx.fast.scaled_dot_product_attention(queries, kk, vv, scale=scale, mask=None, sinks=sinks)

    def _trim_rows(self, n):
        self.n_rows -= n  # trim() caps n at the offset, which is n_rows
        self.n_coded = min(self.n_coded, self.n_rows)
        if self.codebook is not None and self.n_rows < self.fit_rows:
            self.codebook = self.codes = self.metric_l = self.metric_linv = None
            self.n_coded = self.fit_rows = 0
        return n

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        return 2 * (d + dv) + bitpack.packed_nbytes(d // self.sub, self.cbits)

    @property
    def used_nbytes(self) -> int:
        if self.keys is None:
            return 0
        B, H, _, D = self.keys.shape
        fixed = sum(a.nbytes for a in (self.codebook, self.metric_l, self.metric_linv) if a is not None)
        code = B * H * self.n_coded * bitpack.packed_nbytes(D // self.sub, self.cbits)
        return fp16_row_bytes(self.keys, self.values, self.n_rows) + code + fixed

    @property
    def resident_nbytes(self) -> int:
        """``used_nbytes`` less the float16 rows outside the window (the paper offloads them to host memory)."""
        offloaded = self.n_rows - min(self.n_rows, self.window + 1)
        return self.used_nbytes - fp16_row_bytes(self.keys, self.values, offloaded)

    @property
    def full_seq_bytes(self) -> int:
        return fp16_row_bytes(self.keys, self.values, self.offset)
