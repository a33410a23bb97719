"""Saved caches: a prefilled prompt cache written to disk and read back bit-identical.

A saved cache is a file in mlx_lm's prompt-cache layout (``mlx_lm.models.cache.save_prompt_cache``):
a safetensors file whose tensors are the caches' ``state`` and whose metadata lists their classes.
This library's caches carry their configuration in their ``state`` (see ``contract.py``) and are
registered in mlx_lm's cache module, so ``load_prompt_cache`` rebuilds them as they were; mlx_lm's own
``KVCache`` (``method="none"``) is saved the same way, which lets the two file sizes be compared.

On top of that layout the file carries, in its safetensors metadata:

* ``0.veloxquant`` (JSON): format name and version, library version, method, the config fields that
  differ from the defaults, model id, number of layers, each layer's cache class and head shape
  ``[H_kv, D_key, D_value]``, the prompt token ids the cache holds (a later generation continues after
  them), the logical offset, ``kv_bytes`` (the caches' measured ``nbytes`` when saved) and
  ``state_bytes`` (the bytes of their ``state`` arrays, which the file stores: a cache may hold spare
  rows beyond them, e.g. TurboQuant-RVQ's reserved capacity, which a loaded cache does not hold).
* ``0.veloxquant_checksum``: SHA-256 of the rest of the header (canonical JSON) and of every data
  byte, so a truncated, damaged or edited file is reported instead of loaded.

``load_cache`` checks, in order: the file exists, is a well-formed safetensors file whose tensors
exactly fill it, carries the veloxquant metadata, matches its checksum, has a known format version,
holds the expected method, and fits the given model (layer count, layer types, KV heads and head
dimensions). Every failure is a :class:`SavedCacheError` whose message names the file and the problem.
A file named ``*.safetensors`` also loads with mlx_lm's ``load_prompt_cache`` once ``veloxquant_mlx.cache``
is imported (mlx picks the format from the extension; ``load_cache`` reads any name).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any, Optional, Sequence

from mlx_lm.models import cache as mlx_cache

from .contract import CompressedKVCache, config_to_json
from .errors import SavedCacheError

__all__ = ["save_cache", "load_cache", "read_cache_info", "FORMAT_NAME", "FORMAT_VERSION",
           "SUPPORTED_VERSIONS", "NONE"]

FORMAT_NAME = "veloxquant-saved-cache"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
#: ``method="none"``: mlx_lm's own uncompressed caches.
NONE = "none"

_INFO_KEY = "0.veloxquant"  # mlx_lm flattens its metadata dict under "0."
_SUM_KEY = "0.veloxquant_checksum"
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 1 << 30
_CHUNK = 1 << 22


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _library_version() -> str:
    from .. import __version__

    return __version__


def normalize_model_id(model_id: Optional[str]) -> str:
    """The id recorded for a model: the embedded model's canonical name for ``None`` or its aliases,
    the real path for a local directory, else the string as given (an HF repo id)."""
    from ..model import DEFAULT_MODEL, EMBEDDED_MODELS

    if model_id is None or str(model_id).strip().lower() in EMBEDDED_MODELS:
        return DEFAULT_MODEL
    model_id = str(model_id)
    return os.path.realpath(model_id) if os.path.exists(model_id) else model_id


def _head_shape(cache) -> Optional[list[int]]:
    """``[H_kv, D_key, D_value]`` of what a layer's cache holds, or None (empty / no KV)."""
    if isinstance(cache, CompressedKVCache):
        shape = getattr(cache, "_shape", None)
        return [int(s) for s in shape] if shape else None
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if hasattr(keys, "shape") and hasattr(values, "shape") and keys.ndim == 4 and values.ndim == 4:
        return [int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])]
    return None


def _state_bytes(caches) -> int:
    """Bytes of the arrays in the caches' ``state`` (what the file stores; a cache may hold spare rows
    beyond it, counted in its ``nbytes``)."""
    from mlx.utils import tree_flatten

    return int(sum(v.nbytes for c in caches for _, v in tree_flatten(c.state) if hasattr(v, "nbytes")))


def _model_layout(model) -> tuple[list[type], list[Optional[tuple[int, int]]]]:
    """The model's default cache class per layer and ``(H_kv, head_dim)`` of its attention (or None)."""
    from ..measure import _kv_heads
    from .factory import _attention, _head_dim, _layers

    defaults = mlx_cache.make_prompt_cache(model)
    try:
        layers = _layers(model)
    except ValueError:
        layers = []
    shapes: list[Optional[tuple[int, int]]] = []
    for i in range(len(defaults)):
        attn = _attention(layers[i]) if i < len(layers) and len(layers) == len(defaults) else None
        shape = None
        if attn is not None:
            d = _head_dim(attn, fallback=0)
            if d > 0:
                try:
                    shape = (_kv_heads(attn, d), d)
                except ValueError:
                    shape = None
        shapes.append(shape)
    return [type(c) for c in defaults], shapes


def _canonical(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _read_header(path: str) -> tuple[dict, int, int]:
    """Parse and check the safetensors header: ``(header, data_start, file_size)``."""
    if not os.path.exists(path):
        raise SavedCacheError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise SavedCacheError(f"{path}: not a regular file")
    size = os.path.getsize(path)
    if size < 8:
        raise SavedCacheError(f"{path}: not a safetensors file ({size} bytes; a safetensors file starts "
                              "with an 8-byte header length)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise SavedCacheError(f"{path}: not a safetensors file, or truncated: its first 8 bytes give a "
                                  f"header of {n} bytes but the file has {size - 8} bytes after them")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SavedCacheError(f"{path}: corrupt or not a safetensors file: its header is not valid JSON "
                              f"({exc})") from None
    if not isinstance(header, dict):
        raise SavedCacheError(f"{path}: corrupt or not a safetensors file: its header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SavedCacheError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings")
    data_start = 8 + n
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for s in shape:
                if not isinstance(s, int) or s < 0:
                    raise ValueError
                count *= s
            width = _DTYPE_BYTES[dtype]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise SavedCacheError(f"{path}: corrupt safetensors header: bad entry for tensor {name!r}") from None
        if end - begin != count * width:
            raise SavedCacheError(f"{path}: corrupt safetensors header: tensor {name!r} of shape {shape} "
                                  f"{dtype} spans {end - begin} bytes")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SavedCacheError(f"{path}: corrupt safetensors header: tensor {name!r} starts at data byte "
                                  f"{begin}, expected {pos}")
        pos = end
    held = size - data_start
    if held < pos:
        raise SavedCacheError(f"{path}: truncated: the header describes {pos} data bytes but the file holds "
                              f"only {held} (an interrupted write or copy?)")
    if held > pos:
        raise SavedCacheError(f"{path}: corrupt: {held - pos} unexpected bytes after the {pos} data bytes "
                              "the header describes")
    return header, data_start, size


def _digest(path: str, header: dict, data_start: int) -> str:
    """SHA-256 over the header without the checksum entry, then every data byte."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != _SUM_KEY}
    h = hashlib.sha256(_canonical({**header, "__metadata__": meta}))
    with open(path, "rb") as f:
        f.seek(data_start)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_with_checksum(src: str, dst: str) -> None:
    """Copy the safetensors file ``src`` to ``dst`` with the checksum added to its metadata."""
    header, data_start, _ = _read_header(src)
    header.setdefault("__metadata__", {})[_SUM_KEY] = _digest(src, header, data_start)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned (allowed by the safetensors spec)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(struct.pack("<Q", len(raw)))
        fout.write(raw)
        fin.seek(data_start)
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)


# --------------------------------------------------------------------------- #
# save
# --------------------------------------------------------------------------- #


def _check_caches(caches, method: str) -> None:
    from .base import METHOD_NAMES

    if not isinstance(method, str) or (method != NONE and method not in METHOD_NAMES):
        raise SavedCacheError(f"method={method!r} is not a method name: expected {NONE!r} or one of the "
                              f"{len(METHOD_NAMES)} methods `veloxquant methods` lists")
    if not isinstance(caches, (list, tuple)) or not caches:
        raise SavedCacheError(f"caches must be a non-empty list with one cache per layer, got {type(caches).__name__}")
    compressed = 0
    for i, c in enumerate(caches):
        cls = type(c)
        if not isinstance(c, mlx_cache._BaseCache):
            protocol = " (a standalone-protocol cache)" if hasattr(c, "append_key") else ""
            raise SavedCacheError(
                f"layer {i}: {cls.__name__}{protocol} cannot be saved: only mlx_lm prompt caches (one per "
                "layer, as KVCacheBuilder.for_model or mlx_lm's make_prompt_cache make them) can")
        if getattr(mlx_cache, cls.__name__, None) is not cls:
            raise SavedCacheError(f"layer {i}: {cls.__name__} is not registered in mlx_lm.models.cache, so "
                                  "load_prompt_cache could not rebuild it")
        if isinstance(c, CompressedKVCache):
            compressed += 1
            if c.method_name != method:
                raise SavedCacheError(f"layer {i} holds a {c.method_name!r} cache but method={method!r}")
    if method == NONE and compressed:
        raise SavedCacheError(f"method={NONE!r} but {compressed} layer(s) hold compressed caches")
    if method != NONE and not compressed:
        raise SavedCacheError(f"method={method!r} but no layer holds a {method!r} cache")


def save_cache(path, caches: Sequence, *, model_id: Optional[str], tokens: Sequence[int], method: str) -> dict:
    """Write ``caches`` (one per layer, prefilled with ``tokens``) to the safetensors file ``path``.

    ``model_id`` names the model (``None`` = the embedded SmolLM2-135M); ``tokens`` are the prompt token
    ids the caches have seen, in order (their count must equal the caches' logical offset); ``method``
    is the caches' method, or ``"none"`` for mlx_lm's own caches. The file is written atomically.
    Returns the recorded metadata (plus ``path`` and ``file_bytes``). Raises :class:`SavedCacheError`.
    """
    from ..measure import cache_tokens, kv_bytes

    path = os.fspath(path)
    _check_caches(caches, method)
    if hasattr(tokens, "tolist"):  # an mx/numpy array: [T] or [1, T]
        tokens = tokens.tolist()
        if len(tokens) == 1 and isinstance(tokens[0], list):
            tokens = tokens[0]
    try:
        token_ids = [int(t) for t in tokens]
    except (TypeError, ValueError):
        raise SavedCacheError(f"tokens must be a flat sequence of token ids, got {type(tokens).__name__}") from None
    offset = cache_tokens(caches)
    if len(token_ids) != offset:
        raise SavedCacheError(f"tokens has {len(token_ids)} ids but the caches have seen {offset} tokens: "
                              "pass exactly the tokens that were prefilled")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SavedCacheError(f"{path}: directory {parent} does not exist")
    first = next((c for c in caches if isinstance(c, CompressedKVCache)), None)
    config = json.loads(config_to_json(first.config)) if first is not None else {}
    config.pop("method", None)  # recorded on its own
    config.pop("head_dim", None)  # set per layer by for_model: recorded in head_shapes
    info = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": _library_version(),
        "method": method,
        "config": config,
        "model_id": normalize_model_id(model_id),
        "n_layers": len(caches),
        "layer_classes": [type(c).__name__ for c in caches],
        "head_shapes": [_head_shape(c) for c in caches],
        "offset": offset,
        "n_tokens": len(token_ids),
        "tokens": token_ids,
        "kv_bytes": kv_bytes(caches),
        "state_bytes": _state_bytes(caches),
    }
    stem = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}")
    raw_tmp, final_tmp = stem + ".raw.safetensors", stem + ".tmp"
    try:
        mlx_cache.save_prompt_cache(raw_tmp, list(caches), metadata={"veloxquant": json.dumps(info)})
        _write_with_checksum(raw_tmp, final_tmp)
        os.replace(final_tmp, path)
    except SavedCacheError:
        raise
    except ValueError as exc:  # mlx_lm: a state it cannot serialize
        raise SavedCacheError(f"{path}: cannot save these caches: {exc}") from None
    finally:
        for tmp in (raw_tmp, final_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
    return {**info, "path": path, "file_bytes": os.path.getsize(path)}


# --------------------------------------------------------------------------- #
# load
# --------------------------------------------------------------------------- #


def read_cache_info(path) -> dict:
    """The metadata of the saved cache ``path`` (plus ``path`` and ``file_bytes``), after checking the
    file's structure, checksum and format version; no array is loaded. Raises :class:`SavedCacheError`."""
    path = os.fspath(path)
    header, data_start, size = _read_header(path)
    meta = header.get("__metadata__", {})
    if _INFO_KEY not in meta and _SUM_KEY in meta:
        raise SavedCacheError(f"{path}: corrupt veloxquant saved cache: its metadata entry is missing")
    if _INFO_KEY not in meta:
        raise SavedCacheError(
            f"{path}: not a veloxquant saved cache (no 'veloxquant' metadata); a file from mlx_lm's "
            "save_prompt_cache loads with mlx_lm.models.cache.load_prompt_cache")
    if _SUM_KEY not in meta:
        raise SavedCacheError(f"{path}: corrupt veloxquant saved cache: its checksum entry is missing")
    if _digest(path, header, data_start) != meta[_SUM_KEY]:
        raise SavedCacheError(f"{path}: corrupt: checksum mismatch (the file was damaged or edited after it "
                              "was saved)")
    try:
        info = json.loads(meta[_INFO_KEY])
        if not isinstance(info, dict):
            raise ValueError
    except ValueError:
        raise SavedCacheError(f"{path}: corrupt veloxquant metadata (not a JSON object)") from None
    if info.get("format") != FORMAT_NAME:
        raise SavedCacheError(f"{path}: not a veloxquant saved cache (format {info.get('format')!r}, expected "
                              f"{FORMAT_NAME!r})")
    version = info.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise SavedCacheError(
            f"{path}: unknown saved-cache format version {version!r} (written by veloxquant_mlx "
            f"{info.get('library_version', '?')}); veloxquant_mlx {_library_version()} reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    return {**info, "path": path, "file_bytes": size}


def _check_model(path: str, info: dict, model, expect_model_id: Optional[str]) -> None:
    if expect_model_id is not None:
        want = normalize_model_id(expect_model_id)
        if want != info["model_id"]:
            raise SavedCacheError(f"{path}: model mismatch: the cache was saved with model {info['model_id']!r}, "
                                  f"not {want!r}")
    if model is None:
        return
    classes, shapes = _model_layout(model)
    saved_id = info["model_id"]
    if len(classes) != info["n_layers"]:
        raise SavedCacheError(f"{path}: model mismatch: the cache has {info['n_layers']} layers (model "
                              f"{saved_id!r}), the given model has {len(classes)}")
    for i, (cls, shape) in enumerate(zip(classes, shapes)):
        saved_name = info["layer_classes"][i]
        saved_cls = getattr(mlx_cache, saved_name, None)
        # a plain-KVCache layer may hold mlx_lm's KVCache or one of ours; any other layer type its own class
        if cls is mlx_cache.KVCache:
            fits = saved_cls is cls or (isinstance(saved_cls, type) and issubclass(saved_cls, CompressedKVCache))
        else:
            fits = saved_name == cls.__name__
        if not fits:
            raise SavedCacheError(f"{path}: model mismatch: layer {i} of the cache holds a {saved_name}, the "
                                  f"given model's layer {i} uses a {cls.__name__}")
        saved = info["head_shapes"][i]
        if shape is None or saved is None:
            continue
        if (saved[0], saved[1]) != shape:
            raise SavedCacheError(
                f"{path}: model mismatch: layer {i} of the cache holds {saved[0]} KV heads of dimension "
                f"{saved[1]} (model {saved_id!r}); the given model's layer {i} has {shape[0]} KV heads of "
                f"dimension {shape[1]}")


def _rebuild(path: str) -> list:
    """mlx_lm's ``load_prompt_cache``, for any file name (mlx picks the format from the extension)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
    _, classes, scalars = tree_unflatten(list(meta.items()))
    for key, kind in scalars[1:]:
        if kind == "scalar":
            arrays[key] = arrays[key].item()
        elif kind == "string":
            arrays[key] = "".join(chr(c) for c in arrays[key].tolist())
        elif kind == "none":
            arrays[key] = None
        else:
            raise SavedCacheError(f"{path}: corrupt: unknown scalar kind {kind!r} for {key!r}")
    states = tree_unflatten(list(arrays.items()))
    caches = []
    for i, (name, state) in enumerate(zip(classes, states)):
        cls = getattr(mlx_cache, name, None)
        if not isinstance(cls, type) or not issubclass(cls, mlx_cache._BaseCache):
            raise SavedCacheError(f"{path}: layer {i}: cache class {name!r} is unknown to mlx_lm and "
                                  f"veloxquant_mlx {_library_version()}")
        caches.append(cls.from_state(state))
    return caches


def load_cache(path, *, model=None, expect_method: Optional[str] = None,
               expect_model_id: Optional[str] = None, install_dispatch: bool = True) -> tuple[list, dict]:
    """Read a cache written by :func:`save_cache`: ``(caches, info)``.

    ``caches`` is one cache per layer, bit-identical to the saved ones (same state arrays and offset),
    ready to pass as ``prompt_cache=`` after the tokens ``info["tokens"]``. ``info`` is the recorded
    metadata plus ``path`` and ``file_bytes``. With ``model`` the layer count, layer types and head
    shapes are checked against it; ``expect_method`` / ``expect_model_id`` check the method and the
    model id. The attention dispatch point is installed for compressed caches unless told not to.
    Raises :class:`SavedCacheError` naming the file and the problem.
    """
    from ..measure import cache_tokens

    path = os.fspath(path)
    info = read_cache_info(path)
    if expect_method is not None and expect_method != info["method"]:
        raise SavedCacheError(f"{path}: method mismatch: the file holds a {info['method']!r} cache, "
                              f"expected {expect_method!r}")
    _check_model(path, info, model, expect_model_id)
    try:
        caches = _rebuild(path)
    except SavedCacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything mlx or a cache's from_state raises
        raise SavedCacheError(f"{path}: could not rebuild the caches: {type(exc).__name__}: {exc}") from None
    classes = [type(c).__name__ for c in caches]
    if classes != info["layer_classes"]:
        raise SavedCacheError(f"{path}: corrupt: the file's cache classes {classes} differ from its "
                              "veloxquant metadata")
    held, seen = _state_bytes(caches), cache_tokens(caches)
    if (held, seen) != (info["state_bytes"], info["offset"]):
        raise SavedCacheError(f"{path}: corrupt: the loaded caches' state holds {held} bytes at offset {seen}, "
                              f"the file recorded {info['state_bytes']} bytes at offset {info['offset']}")
    if install_dispatch and any(isinstance(c, CompressedKVCache) for c in caches):
        from . import dispatch

        dispatch.install()
    return caches, info
