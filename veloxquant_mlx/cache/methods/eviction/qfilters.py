"""Q-Filters (Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression", arXiv
2503.02812): a head's queries share a dominant direction ``u`` (top right singular vector, signed so E<q, u> > 0),
so <k, u> (the filter) estimates a key's attention without computing any. Each KV head keeps the
``qfilters_budget`` keys projecting highest on its query heads' mean filter plus the first ``qfilters_n_sink`` and
last ``qfilters_recent`` tokens (``qfilters_sign=-1`` reverses it, an ablation). The filters are the top
eigenvector of the Gram matrix of ``qfilters_calib_tokens`` real queries (keys without the dispatch point),
gathered from the call that brings a cache within ``calib_tokens`` rows of its budget; then the attention mass the
queries put on the rows the filter would keep (``retention``) is measured, and below ``qfilters_min_retention``
the cache warns, raises ``QFiltersRetentionError`` or ignores it (``qfilters_on_low_retention``).

Deviations: each layer cache calibrates online on its own queries (the paper: offline, once per model; the filters
are in ``state``); the retention check is an addition; decoding evicts in batches of ``slack`` rows.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ... import dispatch
from ...base import register
from ...contract import register_with_mlx_lm
from ...eviction import EvictionKVCache, causal_weights
from ...observers import notify


class QFiltersRetentionError(RuntimeError):
    """The calibrated filter keeps less real attention mass than ``qfilters_min_retention``."""


def principal_direction(gram: mx.array, total: mx.array) -> mx.array:
    """Top eigenvector of each Gram matrix [.., D, D], sign-fixed so <total, u> >= 0. Returns [.., D]."""
    u = mx.linalg.eigh(gram, stream=mx.cpu)[1][..., :, -1]
    return u * mx.where((u * total).sum(-1, keepdims=True) < 0, -1.0, 1.0)


@register_with_mlx_lm
@register("qfilters")
class QFiltersKVCache(EvictionKVCache):
    """Eviction by projection of keys on calibrated per-head query directions."""
    chunk_invariant, exact_trim = False, False  # filters fit on the first queries; decode steps evict
    array_fields = EvictionKVCache.array_fields + ("qf_gram", "qf_sum", "qf_filter")
    scalar_fields = EvictionKVCache.scalar_fields + ("qf_count", "qf_source", "retention")
    qf_count = 0
    qf_source = ""  # "queries" (dispatch) or "keys" (fallback)
    retention = None  # measured retention (real-query calibration only)
    recent_option = "recent"

    calibrated = property(lambda self: self.qf_filter is not None)

    def _calibration_due(self, rows: int) -> bool:
        """Whether a call that leaves ``rows`` rows feeds the Gram accumulator (see the module doc)."""
        return self.qf_gram is not None or rows + self.config.options.calib_tokens > self.budget

    def _accumulate(self, x: mx.array, source: str) -> int:
        """Add the first still-needed vectors of ``x`` [B, Hx, N, D] to the Gram sums; returns how many."""
        if source != self.qf_source:  # (re)start: the source changed (dispatch installed midway)
            self.qf_gram = self.qf_sum = None
            self.qf_count, self.qf_source = 0, source
        need = self.config.options.calib_tokens
        used = min(need - self.qf_count, x.shape[2])
        xs = x[:, :, :used].astype(mx.float32)
        gram, total = mx.einsum("bhnd,bhne->hde", xs, xs), xs.sum(axis=(0, 2))
        self.qf_gram = gram if self.qf_gram is None else self.qf_gram + gram
        self.qf_sum = total if self.qf_sum is None else self.qf_sum + total
        self.qf_count += used
        if self.qf_count >= need:
            self._finalize()
        return used

    def _finalize(self):
        self.qf_filter = principal_direction(self.qf_gram, self.qf_sum)  # [Hx, D]
        self.qf_gram = self.qf_sum = None  # no longer needed: free them
        notify(self.config.observers, "calibrated", self.method_name, source=self.qf_source, tokens=self.qf_count)

    def filter_scores(self, keys: mx.array) -> mx.array:
        """[B, H, M] sign * <k, filter> for keys [B, H, M, D]; a KV head's filter is its query heads' mean."""
        H, f = keys.shape[1], self.qf_filter
        f = f.reshape(H, f.shape[0] // H, f.shape[-1]).mean(axis=1)
        return self.config.options.sign * (keys.astype(mx.float32) * f[None, :, None, :]).sum(-1)

    def update_and_fetch(self, keys, values):
        if not self.calibrated and not dispatch.installed() and self._calibration_due(self.rows + keys.shape[2]):
            self._accumulate(keys, "keys")  # fallback: keys stand in for queries
        return super().update_and_fetch(keys, values)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if not self.calibrated and self._calibration_due(self.rows):
            used = self._accumulate(queries, "queries")
            if self.calibrated:
                self._check_retention(queries[:, :, :used], scale)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def score(self, obs_queries, obs_positions, scale):
        if not self.calibrated:  # fewer than calib_tokens seen before the first eviction
            if self.qf_gram is None:  # no query reached ``attend``: calibrate on the held keys
                self._accumulate(self.keys[:, :, : self.rows], "keys")
            if not self.calibrated:
                self._finalize()
        return self.filter_scores(self.keys[:, :, : self.rows])

    def retention_of(self, queries: mx.array, q_positions: mx.array, scale: float) -> mx.array:
        """Mean share of the attention mass of ``queries`` on the rows the filter keeps at budget / rows."""
        rows = self.rows
        keys, pos = self.keys[:, :, :rows], self.positions[:, :, :rows]
        visible = pos <= q_positions[-1]  # [B, H, rows]
        fraction = min(1.0, self.budget / max(rows, 1))
        k = mx.maximum(mx.ceil(visible.sum(-1, keepdims=True) * fraction), 1).astype(mx.int32)
        s = mx.where(visible, self.filter_scores(keys), -mx.inf)
        s = mx.where(visible & (pos < self.n_sink), mx.inf, s)
        thresh = mx.take_along_axis(-mx.sort(-s, axis=-1), k - 1, axis=-1)  # k-th largest per head
        kept = visible & (s >= thresh)
        w = causal_weights(queries, keys, scale, q_positions, pos)  # [B, H, rep, n, rows]
        return (w * kept[:, :, None, None, :]).sum(-1).mean()

    def _check_retention(self, calib_queries, scale):
        o = self.config.options
        if o.min_retention is None or o.on_low_retention == "ignore":
            return
        first = self.offset - self._n_new  # position of this call's first query
        q_pos = mx.arange(first, first + calib_queries.shape[2], dtype=mx.int32)
        self.retention = float(self.retention_of(calib_queries, q_pos, scale))  # once per cache
        notify(self.config.observers, "retention", self.method_name, retention=self.retention)
        if self.retention < o.min_retention:
            msg = (f"Q-Filters: the calibrated filter keeps only {self.retention:.3f} of the calibration "
                   f"queries' attention mass (qfilters_min_retention={o.min_retention}); the queries of "
                   "this layer may not share a dominant direction")
            if o.on_low_retention == "raise":
                raise QFiltersRetentionError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
