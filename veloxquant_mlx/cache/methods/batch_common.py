"""What the batch forms of compressed caches share: mlx_lm's batch-cache protocol (right-padded
``prepare``/``finalize``, ``offset`` as an array, ``filter``/``extend``) and ragged layouts: regions
*left-aligned* per sequence (slots ``[0, n_i)``) or *right-aligned* (the newest float16 rows, the last ``n_i``
columns), with the mask showing each sequence its rows. Counts are host-side ints: no decode step syncs.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import mlx.core as mx

from ..contract import BatchingNotSupported, CompressedKVCache
from ..primitives.buffers import dtype_name


def borrows(src, *names):
    """Class decorator: take ``src``'s attributes ``names`` as they are (same buffers, a leading batch axis)."""
    def decorate(cls):
        for name in names:
            setattr(cls, name, inspect.getattr_static(src, name))
        return cls
    return decorate


def grow_slots(cap: int, need: int) -> int:
    """Slots to allocate for ``need`` (amortised growth, as ``buffers.grow_rows``)."""
    return cap if need <= cap else need + max(4, need // 8)


def pad_left(a: mx.array, width: int) -> mx.array:
    """``a`` [B, H, W, D] left-padded with zero columns on axis 2 up to ``width``."""
    pad = width - a.shape[2]
    return a if pad <= 0 else mx.pad(a, [(0, 0), (0, 0), (pad, 0), (0, 0)])


def keep_right(a: mx.array, width: int) -> mx.array:
    """The last ``width`` columns of ``a`` on axis 2."""
    return a if a.shape[2] == width else a[:, :, a.shape[2] - width:]


def rows_ending_at(a: mx.array, ends: Sequence[int], width: int, view: bool = True) -> mx.array:
    """Per sequence i, the ``width`` columns of ``a`` [B, H, W, D] ending at column ``ends[i]`` (exclusive):
    a view when all end alike and ``view``, else one gather (columns before 0 clipped)."""
    if view and all(e == ends[0] for e in ends):
        return a[:, :, ends[0] - width: ends[0]]
    idx = mx.clip(mx.array(ends, dtype=mx.int32)[:, None] - width + mx.arange(width, dtype=mx.int32)[None],
                  0, a.shape[2] - 1)
    return mx.take_along_axis(a, idx[:, None, :, None], axis=2)


def rows_from(a: mx.array, starts: Sequence[int], width: int) -> mx.array:
    """Per sequence i, the ``width`` columns of ``a`` [B, H, W, D] from column ``starts[i]`` (one gather;
    columns past the end clipped)."""
    return rows_ending_at(a, [s + width for s in starts], width, view=False)


def visible_mask(N: int, B: int, regions) -> mx.array:
    """Boolean [B, 1, N, sum(widths) + N]: the stored regions, in key order, then the call's N rows
    (causally). ``regions``: ``(width, counts, "left" | "right")``: sequence i sees the first (left)
    or last (right) ``counts[i]`` of the region's ``width`` columns."""
    parts = []
    for width, counts, align in regions:
        if not width:
            continue
        n = mx.array(list(counts), dtype=mx.int32)[:, None]
        cols = mx.arange(width)[None]
        parts.append(cols < n if align == "left" else cols >= width - n)
    causal = mx.arange(N)[:, None] >= mx.arange(N)[None]
    new = mx.broadcast_to(causal[None, None], (B, 1, N, N))
    if not parts:
        return new
    past = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    past = mx.broadcast_to(past[:, None, None, :], (B, 1, N, past.shape[-1]))
    return mx.concatenate([past, new], axis=-1)


_COUNTS_MEMO: list = [None, None]


def step_counts(rows: list) -> mx.array:
    """A decode kernel's per-sequence counts (int32 [B, 5], ``kernels._common.kernel_pair``) from host tuples;
    the layers of one step share one array (the latest is kept: one small copy to the device per step)."""
    if _COUNTS_MEMO[0] != rows:
        _COUNTS_MEMO[:] = rows, mx.array(rows, dtype=mx.int32)
    return _COUNTS_MEMO[1]


class RaggedBatchCache(CompressedKVCache):
    """Base of the batch forms: host-side counts (``count_fields``: ``lens`` tokens held, ``nq`` used slots
    of the left-aligned buffers; ``cap`` allocated), an optional right-aligned float16 region
    (``right_fields``, rows per sequence in ``right_count``), the batch protocol and the state. Subclasses
    give ``_settings()`` (what must match to share a batch), ``_region_dtype(compute_dtype)``, ``_alloc(B,
    dtype, cap=0)`` (empty arrays) and ``_slot_fields()`` (``{name: (slot axis, rows per slot)}``)."""

    count_fields: tuple[str, ...] = ("nq", "lens")
    right_fields: tuple[str, ...] = ()
    right_count: str = ""
    state_scalars: tuple[str, ...] = ("cap", "dtype_name")
    cap = 0

    _made_mask = None  # (the latest decode mask a batch form made, the counts it was made from)

    @staticmethod
    def _made(mask, counts: tuple):
        """Remember ``mask``, made by ``make_mask`` for one decode row from ``counts``: the model hands that object
        to every layer, so a layer whose step has the same counts may leave the mask to a kernel."""
        RaggedBatchCache._made_mask = (mask, counts)
        return mask

    @staticmethod
    def _mask_is_own(mask, counts: tuple) -> bool:
        """Whether ``mask`` restricts nothing beyond the visibility of ``counts`` (host-side: no sync): none, a
        string, or the mask ``_made`` remembered from equal counts."""
        made = RaggedBatchCache._made_mask
        return mask is None or isinstance(mask, str) or (made is not None and mask is made[0] and made[1] == counts)

    def __init__(self, config, batch_size: int = 0):
        super().__init__(config)
        self._init_counts(batch_size)

    def check_trim(self, n: int) -> None:
        """Raise ``ValueError`` where ``trim(n)`` would, changing nothing."""
        if int(n) > 0 and self.lens:
            self._check_trim_rows(int(n))

    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens of every sequence (``_trim_rows``: the rows, as each single cache would,
        once ``_check_trim_rows`` passed)."""
        n = int(n)
        if n <= 0 or not self.lens:
            return 0
        self._check_trim_rows(n)
        self._trim_rows(n)
        self._call = None
        self.lens = [x - n for x in self.lens]
        self._sync_offset()
        return n

    def _init_counts(self, batch_size: int) -> None:
        for name in self.count_fields:
            setattr(self, name, [0] * batch_size)
        self._pending = self._call = None  # _pending: prepare(lengths=)'s valid rows still to come per sequence
        self._sync_offset()

    @staticmethod
    def _check_mergeable(caches, settings, what: str) -> None:
        """Refuse caches with different ``settings(cache)`` (``what`` names them) or offset != stored rows."""
        first = settings(caches[0])
        for c in caches:
            if settings(c) != first:
                raise BatchingNotSupported(f"{c.method_name} caches with different {what} cannot share a batch: "
                                           f"{settings(c)} vs {first}")
            if c.stored_rows() != c.offset:
                raise BatchingNotSupported(f"{c.method_name} cache whose offset differs from its stored rows")

    def _stack(self, ones) -> "RaggedBatchCache":
        """Set each of ``array_fields`` to the batch of the per-request dicts ``ones``; returns ``self``."""
        for name in self.array_fields:
            setattr(self, name, mx.concatenate([one[name] for one in ones], axis=0))
        self._sync_offset()
        return self

    def _set_capacity(self, cap: int) -> None:
        """Reallocate the slot-indexed buffers to ``cap`` slots, keeping the used ones (a shrunk one made
        contiguous so it frees the larger one)."""
        if cap == self.cap:
            return
        keep = min(cap, self.cap)
        for name, (axis, width) in self._slot_fields().items():
            a = getattr(self, name)[(slice(None),) * axis + (slice(0, keep * width),)]
            if cap > keep:
                pad = [(0, 0)] * a.ndim
                pad[axis] = (0, (cap - keep) * width)
                a = mx.pad(a, pad)
            setattr(self, name, mx.contiguous(a) if cap < self.cap else a)
        self.cap = cap

    batch_size = property(lambda self: len(self.lens))

    def _lead(self):
        """The array that tells whether buffers are held, and their dtype."""
        return getattr(self, (self.right_fields or self.array_fields)[0])

    def _held(self) -> bool:
        return self._lead() is not None

    @property
    def right_width(self) -> int:
        return getattr(self, self.right_fields[0]).shape[2] if self.right_fields and self._held() else 0

    def _sync_offset(self):
        self.offset = mx.array(self.lens, dtype=mx.int32)
        self.left_padding = mx.zeros((len(self.lens),), dtype=mx.int32)

    def stored_rows(self) -> int:
        return max(self.lens, default=0)

    def empty(self) -> bool:
        return not self._held() and not any(self.lens)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and max(left_padding, default=0) > 0:
            raise ValueError(f"{type(self).__name__} takes right-padded prompts (prepare(lengths=...)), "
                             "not left padding")
        if lengths is not None:
            self._pending = [int(n) for n in lengths]

    def finalize(self):  # padded rows were never stored
        self._pending = None

    def _begin_call(self, keys, values) -> list[int]:
        """Check a call's rows, allocate on the first; returns each sequence's valid rows."""
        self._check_input(keys, values)
        N = keys.shape[2]
        if keys.shape[0] != self.batch_size:
            raise ValueError(f"{type(self).__name__} holds {self.batch_size} sequences, "
                             f"got a batch of {keys.shape[0]}")
        if not self._held():
            self.__dict__.update(self._alloc(self.batch_size, self._region_dtype(keys.dtype)), cap=0)
        self.dtype_name = dtype_name(keys.dtype)
        if self._pending is None:
            return [N] * self.batch_size
        valid = [min(N, p) for p in self._pending]
        self._pending = [p - v for p, v in zip(self._pending, valid)]
        return valid

    def filter(self, batch_indices):
        idx = [int(i) for i in batch_indices]
        for name in self.count_fields:
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        if self._pending is not None:
            self._pending = [self._pending[i] for i in idx]
        self._call = None
        if self._held():
            sel = mx.array(idx, dtype=mx.int32)
            for name in self.array_fields:
                setattr(self, name, getattr(self, name)[sel])
            width = max(getattr(self, self.right_count), default=0) if self.right_fields else 0
            if width < self.right_width:  # drop the common invalid prefix of the right-aligned region
                for name in self.right_fields:
                    setattr(self, name, mx.contiguous(keep_right(getattr(self, name), width)))
            need = max(self.nq, default=0)
            if self.cap > grow_slots(need, need + 1):  # a long request left: give its spare slots back
                self._set_capacity(need)
        self._sync_offset()

    def extend(self, other):
        if type(other) is not type(self) or other._settings() != self._settings():
            raise BatchingNotSupported(f"only {type(self).__name__}s with the same settings extend each other")
        held = [c for c in (self, other) if c._held()]
        if held:
            ref = held[0]
            layout = lambda c: (c._shape, c._lead().dtype)  # noqa: E731
            if len(held) == 2 and layout(self) != layout(other):
                raise BatchingNotSupported(f"head shapes / dtypes differ: {layout(self)} vs {layout(other)}")
            cap, width = max(self.cap, other.cap), max(self.right_width, other.right_width)
            for c in (self, other):
                if not c._held():
                    c._shape, c.dtype_name = ref._shape, ref.dtype_name
                    c.__dict__.update(c._alloc(c.batch_size, ref._lead().dtype), cap=0)
                c._set_capacity(cap)
                for name in c.right_fields:  # right-aligned: pad on the left
                    setattr(c, name, pad_left(getattr(c, name), width))
            for name in self.array_fields:
                setattr(self, name, mx.concatenate([getattr(self, name), getattr(other, name)], axis=0))
        n_self, n_other = self.batch_size, other.batch_size
        for name in self.count_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if self._pending is not None or other._pending is not None:
            self._pending = (self._pending or [0] * n_self) + (other._pending or [0] * n_other)
        self._call = None
        self._sync_offset()

    @property
    def full_seq_bytes(self) -> int:
        """What float16 rows of every sequence's tokens would take."""
        if getattr(self, "_shape", None) is None:
            return 0
        H, D, Dv = self._shape
        return sum(self.lens) * H * (D + Dv) * 2

    @property
    def state(self):  # the per-sequence counts ride as scalars (offset follows from lens)
        return self._state_of(0, self.count_fields + self.state_scalars)

    @state.setter
    def state(self, v):
        CompressedKVCache.state.fset(self, v)
        self._pending = self._call = None
        self._sync_offset()
