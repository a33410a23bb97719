"""``ArtifactStore``: precomputed artifacts (rotations, codebooks, JL matrices) shared in memory or across
processes (a ``.npy`` directory), via ``store.get_or_create(key, make)``."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")


class ArtifactStore:
    """Interface: a mapping from string keys to arrays."""

    def get(self, key: str):
        raise NotImplementedError

    def put(self, key: str, value: mx.array) -> None:
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get_or_create(self, key: str, make: Callable[[], mx.array]) -> mx.array:
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"artifact key {key!r} is invalid: use letters, digits, '_', '-', '.'")


class InMemoryArtifactStore(ArtifactStore):
    def __init__(self):
        self._items: dict[str, mx.array] = {}

    def get(self, key):
        self._check_key(key)
        return self._items.get(key)

    def put(self, key, value):
        self._check_key(key)
        self._items[key] = mx.array(value)


class NpyDirectoryArtifactStore(ArtifactStore):
    """One ``<key>.npy`` file per artifact in ``directory`` (written atomically)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, key):
        self._check_key(key)
        path = self.directory / f"{key}.npy"
        return mx.array(np.load(path)) if path.exists() else None

    def put(self, key, value):
        self._check_key(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".npy")
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.array(value))
        os.replace(tmp, self.directory / f"{key}.npy")
