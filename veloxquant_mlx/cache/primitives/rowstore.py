"""Per-token row storage for the standalone (single-head, per-vector) caches."""

from __future__ import annotations

import mlx.core as mx


class RowStore:
    """Named per-token arrays ``(capacity, *row_shape)``, created on the first write, grown by doubling up to
    ``limit`` rows (None: unbounded; an append past it raises ``ValueError`` and stores nothing); rows ``[0, n)``
    are valid, the rest is held capacity (counted in ``nbytes``)."""

    def __init__(self, specs: dict, initial_capacity: int, limit: int | None = None):
        self.specs, self.initial_capacity, self.limit = specs, initial_capacity, limit  # specs: name -> (shape, dtype)
        self.clear()

    def append(self, rows: dict) -> None:
        k = next(iter(rows.values())).shape[0]
        if k == 0:
            return
        need = self.n + k
        if self.limit is not None and need > self.limit:
            raise ValueError(f"capacity={self.limit} tokens: {self.n} stored, {k} more refused (nothing was stored)")
        if need > self.capacity:
            self.capacity = max(self.initial_capacity, 2 * self.capacity, need)
            if self.limit is not None:
                self.capacity = min(self.capacity, self.limit)
            old, self.arrays = self.arrays, {name: mx.zeros((self.capacity, *shape), dtype=dtype)
                                             for name, (shape, dtype) in self.specs.items()}
            for name, buf in old.items():
                self.arrays[name][: self.n] = buf[: self.n]
        for name, val in rows.items():
            self.arrays[name][self.n : need] = val
        self.n = need
        mx.eval(list(self.arrays.values()))

    def view(self, name: str) -> mx.array:
        """Rows ``[0, n)`` of ``name``; an empty ``(0, *row)`` array before its first write (an empty cache)."""
        if name not in self.arrays:
            shape, dtype = self.specs[name]
            return mx.zeros((0, *shape), dtype=dtype)
        return self.arrays[name][: self.n]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def clear(self) -> None:
        self.arrays, self.capacity, self.n = {}, 0, 0  # arrays: name -> [capacity, *row shape]

    def drop_oldest(self, k: int) -> None:
        """Remove rows [0, k) in place (the rest shifts down; capacity is kept)."""
        k = min(k, self.n)
        for name, buf in self.arrays.items():
            buf[: self.n - k] = buf[k : self.n]
        self.n -= k
