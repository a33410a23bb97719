"""Position-tracked eviction storage, the base of every eviction method (a method is a scoring function).

``EvictionKVCache`` keeps each head's rows (``keys``/``values`` [B, H, capacity, D]) with their ``positions``,
appends in place, protects sinks and a recent window and keeps each head's top-scoring rows (all heads the
same count, so one mask fits). What every method shares, documented once here:

* **Real queries.** With the dispatch point installed, eviction waits for ``attend`` and scores with the
  call's last ``obs_window`` queries; without it the newest keys stand in for them. Either way it runs
  after the call's rows were returned, so mlx_lm's mask fits.
* **Decode-time budget** (``decode_evict``): whether one-row calls evict too: the cache's own setting (from
  the options, in ``state``), else ``config.decode_evict``, else ``decode_evict_default`` (the paper's).
  Prefill calls always cut to the budget.
* **Slack** (``evict_slack``): decoding grows the cache by that many rows (``default_slack``:
  ``max(8, budget // 8)``; 0: one row per step, by ``BatchedEviction``'s argmin) before one top-k cuts it back; at most
  ``budget + slack`` rows are held; a decode-time observation window is the queries since the last eviction.
* **Spare rows.** An eviction gathers ``budget - kept + slack + 1`` spare rows along so decode rows append in
  place; ``nbytes`` counts them.
* **Trim.** ``trim(n)`` drops the ``n`` newest rows if every head still holds them, else ``ValueError``
  (``_check_trim_rows``, which ``check_trim`` runs alone); what their queries added to other rows stays (most
  methods: ``exact_trim = False``).
* **Settle.** Lazily accumulated per-row state (``row_fields``) is scheduled (``mx.async_eval``, no host
  sync) every ``SETTLE_EVERY`` calls, so its graph stays bounded.
* **Decode steps on a GPU** are bound by the host's kernel launches: there one query row's output is MLX's fused
  attention (``attention.attention_with_weights``), an observing cache's step is one CUDA launch
  (``kernels.observed_decode``, checked once against the op path), and the one-row drop (TOVA, MorphKV) is one
  launch too (``kernels.drop_row``; the op path reads shared index constants, ``index_constant``).
* **Votes** (``VotingEviction``: PyramidKV, SqueezeAttention, ChunkKV, CaM): rows accumulate the attention
  mass from each call's last ``obs_window`` queries (SnapKV-style, reset after each eviction) or from every
  query (H2O-style, never reset).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import dispatch
from .attention import attention_logits, attention_with_weights, observed_attention
from .contract import CompressedKVCache
from .errors import QuantizerConfigError
from .kernels import drop_row, observed_decode
from .options import SnapKVOptions
from .primitives.buffers import fp16_row_bytes, grow_rows

_check_decode_evict = SnapKVOptions.RULES["decode_evict"].check


def causal_weights(queries: mx.array, keys: mx.array, scale: float, q_positions: mx.array,
                   key_positions: mx.array) -> mx.array:
    """[B, H, rep, W, M] attention probabilities of ``queries`` [B, Hq, W, D] over ``keys`` [B, H, M, D], causal
    by positions [W] and [B, H, M] (NaN for a query that sees no row)."""
    logits = attention_logits(queries, keys, scale)
    visible = key_positions[:, :, None, None, :] <= q_positions[None, None, None, :, None]
    return mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)


def observation_scores(obs_queries: mx.array, keys: mx.array, scale: float, obs_positions: mx.array,
                       key_positions: mx.array) -> mx.array:
    """[B, H, M] float32 attention mass each key row gets from the queries [B, Hq, W, D] (summed over them
    and each KV head's query heads), causal by the positions [W] and [B, H, M]."""
    weights = causal_weights(obs_queries, keys, scale, obs_positions, key_positions)
    visible = key_positions[:, :, None, None, :] <= obs_positions[None, None, None, :, None]
    # a query that sees no stored row (an empty slot of a query ring, position -1) votes nothing
    return mx.where(visible, weights, 0.0).sum(axis=(2, 3))


class EvictionKVCache(CompressedKVCache):
    """Base of eviction methods. Subclasses set ``budget``/``n_sink``/``recent``/``obs_window`` in
    ``_init_layout`` (or let the base's read them) and implement ``score`` or name a ``score_field`` (optionally
    ``observe`` and ``wants_eviction``)."""

    array_fields = ("keys", "values", "positions")
    scalar_fields = ("rows", "_decode_evict")
    budget: int = 512
    n_sink: int = 4
    recent: int = 0
    obs_window: int = 32

    # per-row float32 arrays [B, H, capacity] (scores, counters): grown with zeros, gathered on eviction;
    # a subclass lists them here *and* in ``array_fields``
    row_fields: tuple[str, ...] = ()
    observed_fields: tuple[str, ...] = ()  # what ``observe`` sets besides ``row_fields`` (``_observed_with``)
    score_field = ""  # the row field ``score`` returns (when not overridden)
    recent_option = ""  # the option ``_init_layout`` reads ``recent`` from ("": the class's ``recent``)
    evict_slack = 0  # decode rows allowed over ``budget`` before an eviction
    argmin_decode = False  # ``_init_layout``: evict_slack 0 (one row per decode step, ``BatchedEviction``'s argmin)
    slack = property(lambda self: self.evict_slack)
    uses_attention_weights = False  # hand every call's attention probabilities to ``observe`` (H2O, TOVA)
    decode_evict_default = True  # the paper's: does the budget hold while decoding
    _decode_evict = None  # the cache's own setting (None: the config's, then the default)
    rows = 0
    _pending = False  # eviction deferred to this call's ``attend`` (real queries)
    _n_new = 0
    layer_field = ""  # a scalar field ``build_layers`` sets to each layer's index (per-layer seeds)

    def __init__(self, config):
        super().__init__(config)
        _check_decode_evict("decode_evict", getattr(config, "decode_evict", None))  # fail at construction
        self._decode_evict = getattr(config.options, "decode_evict", None)  # checked by the options

    @classmethod
    def build_layers(cls, layer_configs):
        caches = [cls(c) for c in layer_configs]
        for i, c in enumerate(caches if cls.layer_field else ()):
            setattr(c, cls.layer_field, i)
        return caches

    def _init_layout(self):
        """``budget``, ``n_sink`` and ``recent`` from the options (checked) and the default slack."""
        o, f = self.config.options, type(self.config.options).FIELDS
        self.budget, self.n_sink = o.budget, o.n_sink
        if self.recent_option:
            self.recent = getattr(o, self.recent_option)
        what = " + ".join(f[name] for name in ("n_sink", self.recent_option) if name)
        check_min(f["budget"], self.budget, self.n_sink + self.recent + 1, what + " + 1")  # one evictable row
        self.evict_slack = 0 if self.argmin_decode else default_slack(self.budget)

    def wants_eviction(self, n_new: int) -> bool:
        """Whether to evict after a call that added ``n_new`` rows (decoding: past the slack)."""
        return self.rows > self.budget + (self.evict_slack if n_new == 1 else 0)

    def score(self, obs_queries: mx.array, obs_positions: mx.array, scale: float) -> mx.array:
        """[B, H, rows] importance of each stored row (higher = keep); by default the row field ``score_field``."""
        return getattr(self, self.score_field)[:, :, : self.rows]

    def observe(self, weights: mx.array, first: int = 0, total: int | None = None) -> None:
        """Called with attention probabilities [B, H, rep, n, rows] (float32) when ``uses_attention_weights``: the
        query rows [first, first + n) of a call of ``total`` (default n) rows, in order, from ``observed_from`` on
        (a long call comes in tiles); real queries with the dispatch point, key proxies without."""

    def observed_from(self, total: int) -> int:
        """The first query row of a ``total``-row call whose probabilities ``observe`` reads (0: every row)."""
        return 0

    @property
    def decode_evict(self) -> bool:
        """Whether one-row (decode) calls evict too (see the module docstring)."""
        v = self._decode_evict if self._decode_evict is not None else getattr(self.config, "decode_evict", None)
        _check_decode_evict("decode_evict", v)
        return self.decode_evict_default if v is None else v

    @decode_evict.setter
    def decode_evict(self, value) -> None:
        _check_decode_evict("decode_evict", value)
        self._decode_evict = value

    def _evicts_after(self, n_new: int) -> bool:
        return (n_new > 1 or self.decode_evict) and self.wants_eviction(n_new)

    def _store(self, keys, values):
        B, H, N, _ = keys.shape
        if self._pending:  # the previous call's attention never reached ``attend``: fall back
            self._evict_with_proxy()
        self.compute_dtype = keys.dtype
        keys, values = keys.astype(self.storage_dtype(keys.dtype)), values.astype(self.storage_dtype(keys.dtype))
        # a decode row's position and zero row fields come from the host: no kernels (a GPU's step is the host's)
        pos = mx.arange(self.offset, self.offset + N, dtype=mx.int32) if N > 1 else mx.array([self.offset], mx.int32)
        self.keys = grow_rows(self.keys, self.rows, keys)
        self.values = grow_rows(self.values, self.rows, values)
        self.positions = grow_rows(self.positions, self.rows, mx.broadcast_to(pos, (B, H, N)))
        zeros = mx.zeros((B, H, N), mx.float32) if N > 1 else mx.array(0.0, mx.float32)
        for name in self.row_fields:
            setattr(self, name, grow_rows(getattr(self, name), self.rows, mx.broadcast_to(zeros, (B, H, N))))
        self.rows += N
        self._n_new = N

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        via_dispatch = dispatch.installed()
        if self.uses_attention_weights and not via_dispatch:
            self.observe(self._proxy_weights())
        if self._evicts_after(keys.shape[2]):
            if via_dispatch:
                self._pending = True
            else:
                self._evict_with_proxy()
        return out

    def _proxy_weights(self):
        """Attention probabilities with this call's new keys standing in for its queries."""
        n = self._n_new
        obs = self.keys[:, :, self.rows - n : self.rows]
        _, w = attention_with_weights(obs, self.keys[:, :, : self.rows], self.values[:, :, : self.rows],
                                      scale=obs.shape[-1] ** -0.5, mask="causal" if n > 1 else None)
        return w

    def storage_dtype(self, compute_dtype):
        """``config.dtype``, else 16 bits (float16 for float32 compute) so bytes compare with mlx_lm's cache."""
        if self.config.dtype is not None:
            return self.config.dtype
        return mx.float16 if compute_dtype == mx.float32 else compute_dtype

    def _dense(self):
        dt = getattr(self, "compute_dtype", self.keys.dtype)
        return self.keys[:, :, : self.rows].astype(dt), self.values[:, :, : self.rows].astype(dt)

    def stored_rows(self) -> int:
        return self.rows

    def _check_trim_rows(self, n: int) -> None:
        """Refuse unless every head's last ``n`` rows (``_trim_order``) are the ``n`` newest tokens."""
        self._check_stored(n, self.rows)
        want = mx.arange(self.offset - n, self.offset, dtype=mx.int32)
        if not bool(mx.all(self._trim_order()[:, :, -n:] == want)):
            raise ValueError(f"{type(self).__name__}: the last {n} tokens were evicted, so they cannot be trimmed "
                             "exactly")

    def _trim_order(self) -> mx.array:
        """[B, H, rows] positions in the order ``_trim_rows`` drops rows from the end (as stored)."""
        return self.positions[:, :, : self.rows]

    def _trim_rows(self, n: int) -> int:
        self.rows -= n
        self._trimmed(n)
        return n

    def _trimmed(self, n: int) -> None:
        """Hook: the ``n`` newest rows were just trimmed."""

    def _evict_with_proxy(self):
        """Score with the newest keys (a decode step: the window's) standing in for queries (no dispatch)."""
        w = min(self.obs_window, self._n_new if self._n_new > 1 else self.rows)
        obs = self.keys[:, :, self.rows - w : self.rows]
        self._evict_observed(obs, obs.shape[-1] ** -0.5)

    def _evict_observed(self, obs: mx.array, scale: float) -> None:
        """Evict by ``score`` with ``obs`` [B, Hq, w, D] as the queries of the ``w`` newest positions."""
        self.evict(self.score(obs, mx.arange(self.offset - obs.shape[2], self.offset, dtype=mx.int32), scale))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self.uses_attention_weights and sinks is None and dispatch.installed():
            out = self._observed_decode(queries, mask, scale)
            if out is None:
                out = observed_attention(queries, keys, values, scale=scale, mask=self._own_mask(mask, queries, keys),
                                         observe=self.observe, held=self._observed_state,
                                         first_observed=self.observed_from(queries.shape[2]))
            out = self._observed_with(out)
        else:
            out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if self._pending:
            self._evict_observed(queries[:, :, -min(self.obs_window, queries.shape[2]) :], scale)
        return out

    def _observed_decode(self, queries, mask, scale):
        """A decode step's output, its probabilities handed to ``observe``, from one kernel launch over the held
        buffers (``kernels.observed_decode``: CUDA); None where it does not apply (the op path then)."""
        if (mask is not None and not isinstance(mask, str)) or not observed_decode.supported(
                queries, self.keys, self.values, self.rows):
            return None
        rows, dt = self.rows, queries.dtype
        op = lambda: attention_with_weights(queries, self.keys[:, :, :rows].astype(dt),  # noqa: E731
                                            self.values[:, :, :rows].astype(dt), scale=scale, mask=None)
        out, w = observed_decode.attend(queries, self.keys, self.values, rows, scale, op)
        self.observe(w, 0, 1)
        return out

    def _observed_with(self, out: mx.array) -> mx.array:
        """``out`` tied (``mx.depends``) to the row state ``observe`` just updated, so the observation is reduced
        with the layer's attention: left to the state's evaluation it kept every layer's [N, rows] probabilities
        alive to the end of a prefill chunk (CaM, KVzip: 9x the plain cache's peak at 1023 tokens of SmolLM2)."""
        held = self._observed_state()
        return mx.depends(out, held) if held else out

    def _observed_state(self) -> list:
        """The arrays ``observe`` updates (``row_fields`` and ``observed_fields``)."""
        return [a for a in (getattr(self, n, None) for n in self.row_fields + self.observed_fields) if a is not None]

    def _recent_start(self) -> int:
        """First position of the protected recent window."""
        return self.offset - self.recent

    def protected(self) -> mx.array:
        """[B, H, rows] rows that are never evicted: sinks and the recent window."""
        pos = self.positions[:, :, : self.rows]
        start = self._recent_start()
        return pos < self.n_sink if start >= self.offset else (pos < self.n_sink) | (pos >= start)

    def evict(self, scores: mx.array, keep: int | None = None) -> None:
        """Keep the ``keep`` (default ``budget``) best rows of each head, in position order."""
        self._pending = False
        keep = self.budget if keep is None else keep
        if self.rows > keep:
            self._drop(scores, keep)

    def _drop(self, scores: mx.array, keep: int) -> None:
        """``evict`` past its checks: keep the top ``keep`` of ``scores`` (protected rows first)."""
        idx = mx.argpartition(-self._guarded(scores), kth=keep - 1, axis=-1)[..., :keep]
        self.keep_rows(mx.sort(idx, axis=-1))

    def _guarded(self, scores: mx.array) -> mx.array:
        """``scores`` in float32 with the protected rows at +inf."""
        return mx.where(self.protected(), mx.inf, scores.astype(mx.float32))

    def keep_rows(self, idx: mx.array, spare: int = 0) -> None:
        """Keep the rows ``idx`` [B, H, K] (ascending per head) and drop the rest, gathering ``spare`` rows (never
        read) along so decode rows append in place."""
        if spare:
            idx = mx.concatenate([idx, index_constant("zeros", idx.shape[:2] + (spare,), idx.dtype)], axis=-1)
        for name in ("keys", "values", "positions", *self.row_fields):  # rows [B, H, rows, D] or [B, H, rows]
            a = getattr(self, name)[:, :, : self.rows]
            setattr(self, name, mx.take_along_axis(a, idx[..., None] if a.ndim == 4 else idx, axis=2))
        self.rows = idx.shape[-1] - spare
        mx.async_eval(self.positions)  # so a cache that never reads them (chunkkv follower) stacks no gathers

    # telemetry (the spec's names; compression_ratio: CompressedKVCache's)
    tokens_kept = property(lambda self: self.rows, doc="Rows held per head.")
    tokens_seen = property(lambda self: self.offset, doc="Tokens seen (the logical position).")
    keep_rate = property(lambda self: self.rows / self.offset if self.offset else 1.0,
                         doc="Fraction of the tokens seen that each head still holds.")
    kept_bytes = property(lambda self: self.nbytes, doc="Bytes held (``nbytes``).")
    full_seq_bytes = property(lambda self: fp16_row_bytes(self.keys, self.values, self.offset),
                              doc="What mlx_lm's plain cache would hold for the same tokens (fp16, no spare rows).")


SETTLE_EVERY = 32
OBS_WINDOW = 32  # VotingEviction: queries that vote after each call, and the protected recent window


@functools.lru_cache(maxsize=64)
def index_constant(kind: str, shape: tuple, dtype) -> mx.array:
    """An evaluated index array shared by every cache (``"zeros"``, ``"arange"``, ``"arange+1"`` along the last
    axis): built once, not per eviction (TOVA and MorphKV evict a row every decode step; on a GPU each kernel a
    step builds costs host time)."""
    if kind == "zeros":
        a = mx.zeros(shape, dtype=dtype)
    else:
        a = mx.broadcast_to(mx.arange(shape[-1], dtype=dtype) + (kind == "arange+1"), shape)
    mx.eval(a)
    return a


def default_slack(budget: int) -> int:
    """Decode-time growth allowed before a batched eviction: 1/8 of the budget, at least 8 rows."""
    return max(8, budget // 8)


def check_min(field: str, value: int, minimum: int, what: str) -> None:
    if value < minimum:
        raise QuantizerConfigError(field, value, f"an int >= {what} = {minimum}")


class BatchedEviction:
    """Mixin before ``EvictionKVCache``: the spare rows and ``settle`` of the module docstring; evicting one
    row is an argmin."""

    _unsettled = 0

    def _drop(self, scores, keep):
        if self.rows != keep + 1:
            return super()._drop(scores, keep)
        if self._drops_in_one_launch():
            return self._drop_one_row(scores, keep)
        self.keep_rows(self._one_row_kept(scores, keep))

    def _one_row_kept(self, scores, keep):
        """[B, H, keep] rows kept when each head drops its least unprotected row (the rows past it shift down one;
        TOVA, MorphKV: every decode step)."""
        j = mx.argmin(self._guarded(scores), axis=-1, keepdims=True)  # [B, H, 1]: the one row to drop
        r, r1 = (index_constant(kind, (keep,), j.dtype) for kind in ("arange", "arange+1"))
        return mx.where(r >= j, r1, r)

    def _drops_in_one_launch(self) -> bool:
        """The one-row drop as one CUDA launch (``kernels.drop_row``): for caches with no per-row state of their own
        to carry and the shared ``keep_rows`` (TOVA, MorphKV)."""
        return (not self.row_fields and type(self).keep_rows is BatchedEviction.keep_rows
                and drop_row.supported(self.keys, self.values, self.positions, self.rows))

    def _drop_one_row(self, scores, keep):
        rows, spare = self.rows, self._spare(keep)
        n, start = self.n_sink, self._recent_start()

        def op():  # the op path's drop, the spare rows repeating the last held row (as the kernel's)
            kept = self._one_row_kept(scores, keep)
            idx = mx.concatenate([kept, index_constant("zeros", kept.shape[:2] + (spare,), kept.dtype) + (rows - 1)],
                                 axis=-1)
            return tuple(mx.take_along_axis(a[:, :, :rows], idx[..., None] if a.ndim == 4 else idx, axis=2)
                         for a in (self.keys, self.values, self.positions))

        self.keys, self.values, self.positions = drop_row.drop(self.keys, self.values, self.positions, scores, rows,
                                                               spare, n, start, op)
        self.rows, self._unsettled = keep, 0
        mx.async_eval(self.positions)

    def _spare(self, kept: int) -> int:
        """Rows gathered beyond ``kept`` kept ones: room for the decode rows until the next eviction."""
        return max(self.budget - kept, 0) + self.evict_slack + 1

    def keep_rows(self, idx):
        super().keep_rows(idx, self._spare(idx.shape[-1]))
        self._unsettled = 0

    def settle(self) -> None:
        self._unsettled += 1
        if self._unsettled >= SETTLE_EVERY:
            mx.async_eval([getattr(self, n) for n in self.row_fields])
            self._unsettled = 0


class VotingEviction(BatchedEviction, EvictionKVCache):
    """Eviction by ``votes`` (module docstring) with the default slack. ``h2o_votes``: H2O-style, the newest half
    of the budget protected (else the window). ``budget`` (argument): this layer's own (``build_layers``'
    schedule), kept in ``state``."""

    array_fields = EvictionKVCache.array_fields + ("votes",)
    scalar_fields = EvictionKVCache.scalar_fields + ("budget",)
    row_fields = ("votes",)
    score_field = "votes"
    uses_attention_weights = True
    obs_window = OBS_WINDOW
    h2o_votes = False
    resolved_margin = 1  # rows a resolved budget must hold beyond the sinks and the window

    def __init__(self, config, budget: int | None = None):
        super().__init__(config)
        if budget is not None:
            check_min("budget", budget, self.n_sink + self.obs_window, "n_sink + the observation window")
            self.budget = int(budget)

    def _init_layout(self):
        """``n_sink`` and ``budget`` (the config's ``<prefix>_resolved_budget`` when set) from the options: above
        the rows always kept (the sinks and the window; ``h2o_votes``: the sinks and the newest half)."""
        o, f = self.config.options, type(self.config.options).FIELDS
        self.n_sink, protected, what = o.n_sink, o.n_sink + self.obs_window, f"{f['n_sink']} + {self.obs_window}"
        check_min(f["budget"], o.budget, protected + 1, what + " + 1")
        field = f["budget"].replace("budget", "resolved_budget")
        resolved = getattr(self.config, field, None)
        if resolved is not None:
            check_min(field, resolved, protected + self.resolved_margin, what + " + 1" * self.resolved_margin)
        self.budget = o.budget if resolved is None else resolved
        if self.h2o_votes and self.n_sink + self.recent >= self.budget:  # the newest half is kept too
            b = f["budget"] if resolved is None else field
            raise QuantizerConfigError(f["n_sink"], self.n_sink, f"an int < {b} - {b} // 2 = "
                                       f"{self.budget - self.recent} (the sinks and the newest half of the budget "
                                       "are always kept)")

    recent = property(lambda self: max(self.obs_window, self.budget // 2) if self.h2o_votes else self.obs_window)
    evict_slack = property(lambda self: default_slack(self.budget))
    layer_budget = property(lambda self: self.budget)

    def observed_from(self, total):
        return 0 if self.h2o_votes else max(0, total - self.obs_window)

    def observe(self, weights, first=0, total=None):
        w = weights if self.h2o_votes else weights[..., -self.obs_window :, :]  # (tiles: from observed_from only)
        n = self.rows
        self.votes[:, :, :n] = self.votes[:, :, :n] + w.sum(axis=(2, 3))
        self.settle()

    def keep_rows(self, idx):
        super().keep_rows(idx)
        if not self.h2o_votes:
            self.votes = mx.zeros_like(self.votes)
