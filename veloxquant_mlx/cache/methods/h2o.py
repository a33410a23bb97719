"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048).

Every query's attention probabilities are added to a per-row score (the attention mass each cached
token has received so far, summed over the query heads of each KV head); when the cache is over
budget, each KV head keeps its highest-scoring rows (the "heavy hitters") plus the newest tokens.
Prefill chunks and decode steps go through the same accumulation, with the model's real queries when
the attention dispatch point is installed (keys stand in for queries without it).

Deviations from the paper:
* Recent window: the newest ``h2o_grace`` tokens are protected (the paper splits the budget half
  heavy hitters, half recent tokens); the first ``h2o_n_sink`` tokens are protected too (the paper
  has no sinks; ``h2o_n_sink=0`` removes them).
* ``h2o_decay`` multiplies every score by ``decay`` once per query before that query's mass is
  added (within a prefill chunk too, query by query), so old mass fades; the paper never decays
  (``h2o_decay=1.0`` reproduces it).
* Batched eviction: the paper evicts one token per decode step. Here the cache may grow by
  ``evict_slack`` rows (``min(32, max(1, budget // 16))``) during decoding before evicting back to
  ``h2o_budget`` at once, so at most ``budget + evict_slack`` rows are held; after a prefill chunk
  the cache is cut to ``budget`` immediately.
* ``h2o_rope_base`` is accepted and unused: keys are cached after RoPE at their original positions
  and ``offset`` stays the logical position, so nothing needs re-rotating.
* Trim drops the trimmed rows and their scores; the mass the trimmed queries added to the rows
  that remain is not subtracted (it only affects later eviction choices, never the attention over
  the held rows).

This module also holds ``BatchedEviction``, the small layer the other scoring methods of this group
(TOVA, K-norm, Keyformer, MorphKV) share on top of ``EvictionKVCache``.
"""

from __future__ import annotations

import mlx.core as mx

from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..eviction import EvictionKVCache

# Un-evaluated per-row score updates are scheduled for evaluation (mx.async_eval, no host sync)
# after this many calls without an eviction, so the lazy graph (and its memory) stays bounded.
SETTLE_EVERY = 32


def default_slack(budget: int) -> int:
    """Decode-time growth allowed before a batched eviction: 1/16 of the budget, 1 .. 32 rows."""
    return max(1, min(32, budget // 16))


def check_budget(field: str, budget: int, protected: int, what: str) -> None:
    """Every head must keep at least one evictable row beyond the protected ones."""
    if budget <= protected:
        raise QuantizerConfigError(field, budget, f"an int > {what} = {protected}")


class BatchedEviction:
    """Mixin for ``EvictionKVCache`` scoring methods.

    * ``evict_slack``: after a decode step (one new row) eviction waits until more than
      ``budget + evict_slack`` rows are held, then cuts back to ``budget``; after a multi-row call it
      cuts to ``budget`` at once. ``evict_slack = 0`` evicts every step. Between calls at most
      ``budget + evict_slack`` rows are held, in buffers of ``budget + evict_slack + 1`` rows (the
      eviction gathers the spare rows along, so decode appends never re-allocate).
    * Evicting exactly one row uses an argmin instead of a partition and a sort.
    * ``settle()`` keeps lazily accumulated per-row state from building an unbounded graph when no
      eviction consumes it (``mx.async_eval`` every ``SETTLE_EVERY`` calls: no host sync).
    """

    evict_slack = 0
    _unsettled = 0

    def wants_eviction(self, n_new: int) -> bool:
        return self.rows > self.budget + (self.evict_slack if n_new == 1 else 0)

    def evict(self, scores, keep=None):
        keep = self.budget if keep is None else keep
        if self.rows != keep + 1:
            return super().evict(scores, keep)
        self._pending = False
        scores = mx.where(self.protected(), mx.inf, scores.astype(mx.float32))
        j = mx.argmin(scores, axis=-1, keepdims=True)  # [B, H, 1]: the one row to drop
        r = mx.arange(keep, dtype=mx.int32)
        self.keep_rows(r + (r >= j).astype(mx.int32))

    def keep_rows(self, idx):
        """The base's gather, with ``evict_slack + 1`` spare rows gathered along (their contents are
        never read), so the decode rows up to the next eviction append in place instead of
        re-allocating the buffers."""
        spare = self.evict_slack + 1
        pad = mx.zeros(idx.shape[:2] + (spare,), dtype=idx.dtype)
        super().keep_rows(mx.concatenate([idx, pad], axis=-1))
        self.rows = idx.shape[-1]
        self._unsettled = 0

    def settle(self) -> None:
        self._unsettled += 1
        if self._unsettled >= SETTLE_EVERY:
            mx.async_eval([getattr(self, n) for n in self.row_fields])
            self._unsettled = 0

    # ------------------------------------------------------------ telemetry (spec properties)
    @property
    def kept_bytes(self) -> int:
        return self.nbytes

    @property
    def compression_ratio(self) -> float:
        """fp16 bytes of every token seen / bytes held (> 1 means memory saved)."""
        return self.full_seq_bytes / self.nbytes if self.nbytes else 1.0


@register_with_mlx_lm
@register("h2o")
class H2OKVCache(BatchedEviction, EvictionKVCache):
    """Heavy-hitter eviction: keep the rows with the most accumulated attention, per KV head."""

    array_fields = EvictionKVCache.array_fields + ("acc",)
    row_fields = ("acc",)
    uses_attention_weights = True

    def _init_layout(self):
        c = self.config
        self.budget, self.n_sink, self.recent = c.h2o_budget, c.h2o_n_sink, c.h2o_grace
        self.decay = float(c.h2o_decay)
        self.rope_base = c.h2o_rope_base  # accepted, unused (see module docstring)
        check_budget("h2o_budget", self.budget, self.n_sink + self.recent, "h2o_n_sink + h2o_grace")
        self.evict_slack = default_slack(self.budget)

    def observe(self, weights):
        """weights [B, H, rep, N, rows]: add this call's attention mass, query by query with decay."""
        rows, n = self.rows, weights.shape[3]
        old = self.acc[:, :, :rows]
        if self.decay == 1.0:
            mass = weights.sum(axis=(2, 3))
        else:
            # query i of N is followed by N-1-i more decay steps within this call
            w = mx.power(mx.array(self.decay, mx.float32), mx.arange(n - 1, -1, -1, dtype=mx.float32))
            mass = (w[:, None] * weights).sum(axis=(2, 3))
            old = old * (self.decay**n)
        self.acc[:, :, :rows] = old + mass
        self.settle()

    def score(self, obs_queries, obs_positions, scale):
        return self.acc[:, :, : self.rows]

    @property
    def h2o_kept_bytes(self) -> int:
        return self.nbytes
