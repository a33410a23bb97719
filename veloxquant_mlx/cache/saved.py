"""Saved caches: a prefilled prompt cache written to disk and read back bit-identical.

The file is mlx_lm's ``save_prompt_cache`` layout (safetensors of the caches' ``state``, which carries the
config), so mlx_lm's ``load_prompt_cache`` reads it too; ``method="none"`` saves mlx_lm's ``KVCache`` alike.
Its metadata adds ``0.veloxquant`` (JSON: versions, method, config, model id, per layer the class and head
shape ``[H_kv, D_key, D_value]``, token ids, offset, ``kv_bytes``, ``state_bytes``) and
``0.veloxquant_checksum`` (SHA-256 of the canonical header and every data byte).

``load_cache`` checks the file (well-formed safetensors filled exactly, checksum, version), the method and
the model; since a checksum only catches accidents, every field is also validated against the class that
will hold it (layer classes from a fixed list, never looked up freely; only declared scalars and arrays;
rows and shapes once rebuilt). Nothing in a file names code to run; failures are :class:`SavedCacheError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from .. import __version__
from . import dispatch
from .base import EVICTION, METHOD_NAMES, method_info
from .composed import composed_class
from .config import DTYPE_NAMES
from .contract import CompressedKVCache, config_from_json, config_to_json
from .errors import SavedCacheError
from .factory import _attention, _head_dim, _layers
from .options import _is_int
from .rotating import RING_CLASSES
from .settings import NONE

__all__ = ["save_cache", "load_cache", "read_cache_info", "FORMAT_NAME", "FORMAT_VERSION",
           "SUPPORTED_VERSIONS", "NONE"]

FORMAT_NAME = "veloxquant-saved-cache"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)

_INFO_KEY = "0.veloxquant"  # mlx_lm flattens its metadata dict under "0."
_SUM_KEY = "0.veloxquant_checksum"
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 1 << 30
_CHUNK = 1 << 22
_PLAIN_CLASSES = ("KVCache", "RotatingKVCache", "ChunkedKVCache", "ArraysCache", "MambaCache")
_KV_CLASSES = ("KVCache", "RotatingKVCache", "ChunkedKVCache")  # (keys, values, offset, ...) states
_MAX_LAYERS = 4096
_MAX_HEAD = 1 << 16  # bound of H_kv and head dimensions
_MAX_TOKEN_ID = (1 << 31) - 1
_SCALAR_KINDS = {"scalar": lambda a: a.item(), "string": lambda a: "".join(map(chr, a.tolist())),
                 "none": lambda a: None}


def normalize_model_id(model_id: Optional[str]) -> str:
    """The embedded model's name for ``None`` or its aliases, a local directory's real path, else as given."""
    from ..model import DEFAULT_MODEL, EMBEDDED_MODELS
    if model_id is None or str(model_id).strip().lower() in EMBEDDED_MODELS:
        return DEFAULT_MODEL
    model_id = str(model_id)
    return os.path.realpath(model_id) if os.path.exists(model_id) else model_id


def _head_shape(cache) -> Optional[list[int]]:
    """``[H_kv, D_key, D_value]`` of a layer's cache, or None (empty / no KV)."""
    if isinstance(cache, CompressedKVCache):
        shape = getattr(cache, "_shape", None)
        return [int(s) for s in shape] if shape else None
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if hasattr(keys, "shape") and hasattr(values, "shape") and keys.ndim == 4 and values.ndim == 4:
        return [int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])]
    return None


def _state_bytes(caches) -> int:
    return int(sum(v.nbytes for c in caches for _, v in tree_flatten(c.state) if hasattr(v, "nbytes")))


def _model_layout(model) -> tuple[list[type], list[Optional[tuple[int, int]]]]:
    """The model's default cache class per layer and ``(H_kv, head_dim)`` of its attention or None."""
    from ..measure import _kv_heads

    def shape(layer):
        attn = _attention(layer)
        d = _head_dim(attn, 0)
        try:
            return (_kv_heads(attn, d), d) if d > 0 else None
        except ValueError:
            return None

    defaults = mlx_cache.make_prompt_cache(model)
    try:
        layers = _layers(model)
    except ValueError:
        layers = []
    if len(layers) != len(defaults):
        layers = [None] * len(defaults)
    return [type(c) for c in defaults], [shape(layer) for layer in layers]


def _read_header(path: str) -> tuple[dict, int, int]:
    """Parse and check the safetensors header: ``(header, data_start, file_size)``."""
    if not os.path.isfile(path):
        raise SavedCacheError(f"{path}: {'not a regular file' if os.path.exists(path) else 'no such file'}")
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
            width = _DTYPE_BYTES[dtype]
            if not (all(isinstance(s, int) and s >= 0 for s in shape) and isinstance(begin, int)
                    and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError
            count = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise SavedCacheError(f"{path}: corrupt safetensors header: bad entry for tensor {name!r}") from None
        if end - begin != count * width:
            raise SavedCacheError(f"{path}: corrupt safetensors header: tensor {name!r} of shape {shape} "
                                  f"{dtype} spans {end - begin} bytes")
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
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
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    h = hashlib.sha256(canonical.encode())
    _copy_data(path, data_start, h.update)
    return h.hexdigest()


def _copy_data(path: str, data_start: int, write) -> None:
    with open(path, "rb") as f:
        f.seek(data_start)
        while chunk := f.read(_CHUNK):
            write(chunk)


def _write_with_checksum(src: str, dst: str) -> None:
    """Copy the safetensors file ``src`` to ``dst`` with the checksum added to its metadata."""
    header, data_start, _ = _read_header(src)
    header.setdefault("__metadata__", {})[_SUM_KEY] = _digest(src, header, data_start)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned (allowed by the safetensors spec)
    with open(dst, "wb") as fout:
        fout.write(struct.pack("<Q", len(raw)) + raw)
        _copy_data(src, data_start, fout.write)


def _check_caches(caches, method: str) -> None:
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
    """Write ``caches`` (one per layer) to ``path`` atomically; returns the metadata plus ``path`` and
    ``file_bytes``. ``model_id`` None: the embedded SmolLM2-135M; ``tokens``: the ids the caches have seen."""
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
    config = {k: v for k, v in config.items() if k not in ("method", "head_dim")}  # head_dim: in head_shapes
    info = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "library_version": __version__,
            "method": method, "config": config, "model_id": normalize_model_id(model_id), "n_layers": len(caches),
            "layer_classes": [type(c).__name__ for c in caches], "head_shapes": [_head_shape(c) for c in caches],
            "offset": offset, "n_tokens": len(token_ids), "tokens": token_ids, "kv_bytes": kv_bytes(caches),
            "state_bytes": _state_bytes(caches)}
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


def read_cache_info(path) -> dict:
    """The checked metadata of the saved cache ``path`` (plus ``path`` and ``file_bytes``); loads no array."""
    path = os.fspath(path)
    header, data_start, size = _read_header(path)
    meta = header.get("__metadata__", {})
    if _INFO_KEY not in meta and _SUM_KEY not in meta:
        raise SavedCacheError(
            f"{path}: not a veloxquant saved cache (no 'veloxquant' metadata); a file from mlx_lm's "
            "save_prompt_cache loads with mlx_lm.models.cache.load_prompt_cache")
    if _INFO_KEY not in meta or _SUM_KEY not in meta:
        entry = "metadata" if _SUM_KEY in meta else "checksum"
        raise SavedCacheError(f"{path}: corrupt veloxquant saved cache: its {entry} entry is missing")
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
            f"{info.get('library_version', '?')}); veloxquant_mlx {__version__} reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    _check_info(path, info, size)
    return {**info, "path": path, "file_bytes": size}


def _check_info(path: str, info: dict, file_bytes: int) -> None:
    """Every metadata field present, of its type and within bounds; layer classes from the allowed list."""

    def bad(field, why):
        raise SavedCacheError(f"{path}: corrupt veloxquant metadata: {field} {why}")

    required = {"library_version": str, "method": str, "config": dict, "model_id": str, "n_layers": int,
                "layer_classes": list, "head_shapes": list, "offset": int, "n_tokens": int, "tokens": list,
                "kv_bytes": int, "state_bytes": int}
    for field, kind in required.items():
        if field not in info:
            bad(f"'{field}'", "is missing")
        if not isinstance(info[field], kind) or isinstance(info[field], bool):
            bad(f"'{field}'", f"must be {kind.__name__}, got {type(info[field]).__name__}")
    method, n = info["method"], info["n_layers"]
    if method != NONE and method not in METHOD_NAMES:
        bad("'method'", f"{method[:80]!r} is not a method name")
    if not 1 <= n <= _MAX_LAYERS:
        bad("'n_layers'", f"= {n} is outside 1..{_MAX_LAYERS}")
    for field in ("layer_classes", "head_shapes"):
        if len(info[field]) != n:
            bad(f"'{field}'", f"has {len(info[field])} entries for {n} layers")
    offset, tokens = info["offset"], info["tokens"]
    if not (offset >= 0 and info["n_tokens"] == offset == len(tokens)):
        bad("'offset'", f"= {offset} does not equal 'n_tokens' ({info['n_tokens']}) and the {len(tokens)} "
                        "token ids recorded")
    if not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in tokens):
        bad("'tokens'", f"must be token ids in 0..{_MAX_TOKEN_ID}")
    for field in ("kv_bytes", "state_bytes"):
        if info[field] < 0:
            bad(f"'{field}'", f"= {info[field]} is negative")
    if info["state_bytes"] > file_bytes:
        bad("'state_bytes'", f"= {info['state_bytes']} is more than the file's {file_bytes} bytes")
    for i, shape in enumerate(info["head_shapes"]):
        if shape is not None and not (isinstance(shape, list) and len(shape) == 3
                                      and all(_is_int(d) and 1 <= d <= _MAX_HEAD for d in shape)):
            bad(f"'head_shapes[{i}]'", f"must be null or [H_kv, D_key, D_value] with each in 1..{_MAX_HEAD}, "
                                       f"got {json.dumps(shape)[:80]}")
    allowed = _allowed_classes(method)
    for i, name in enumerate(info["layer_classes"]):
        if not isinstance(name, str) or name not in allowed:  # a list or object is unhashable
            held = getattr(getattr(mlx_cache, name, None), "method_name", None) if isinstance(name, str) else None
            why = (f"holds a {held!r} cache but the file says method {method!r}" if held and held != method
                   else f"is {str(name)[:80]!r}; a {method!r} file may hold only {', '.join(sorted(allowed))}")
            raise SavedCacheError(f"{path}: corrupt or forged: layer {i} {why}")


def _allowed_classes(method: str) -> dict:
    """Name -> class of the caches a file of ``method`` may hold: mlx_lm's plain caches and the method's own."""
    allowed = {name: getattr(mlx_cache, name) for name in _PLAIN_CLASSES if hasattr(mlx_cache, name)}
    if method != NONE:
        info = method_info(method)
        cls = info.cls
        registered = getattr(mlx_cache, getattr(cls, "__name__", ""), None) is cls
        if isinstance(cls, type) and issubclass(cls, CompressedKVCache) and registered:
            allowed[cls.__name__] = cls
            if info.family == EVICTION:  # its quantized form (cache/composed.py)
                allowed[composed_class(cls).__name__] = composed_class(cls)
                allowed.update((ring.__name__, ring) for ring in RING_CLASSES.values())  # its quantizer's ring
        if method in RING_CLASSES:  # its sliding-window layers
            allowed[RING_CLASSES[method].__name__] = RING_CLASSES[method]
    return allowed


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
    for i, (cls, shape, saved) in enumerate(zip(classes, shapes, info["head_shapes"])):
        saved_name = info["layer_classes"][i]
        saved_cls = getattr(mlx_cache, saved_name, None)
        if cls is mlx_cache.KVCache:  # mlx_lm's KVCache or one of ours
            fits = saved_cls is cls or (isinstance(saved_cls, type) and issubclass(saved_cls, CompressedKVCache)
                                        and saved_cls not in RING_CLASSES.values())
        else:  # a sliding-window layer may hold a compressed ring (rotating.py)
            fits = saved_name == cls.__name__ or (cls is mlx_cache.RotatingKVCache
                                                  and saved_cls in RING_CLASSES.values())
        if not fits:
            raise SavedCacheError(f"{path}: model mismatch: layer {i} of the cache holds a {saved_name}, the "
                                  f"given model's layer {i} uses a {cls.__name__}")
        if shape is not None and saved is not None and (saved[0], saved[1]) != shape:
            raise SavedCacheError(
                f"{path}: model mismatch: layer {i} of the cache holds {saved[0]} KV heads of dimension "
                f"{saved[1]} (model {saved_id!r}); the given model's layer {i} has {shape[0]} KV heads of "
                f"dimension {shape[1]}")


def _rebuild(path: str, info: dict) -> list:
    """mlx_lm's ``load_prompt_cache`` for any file name, each layer's state checked before ``from_state``."""
    arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
    _, classes, scalars = tree_unflatten(list(meta.items()))
    if classes != info["layer_classes"]:
        raise SavedCacheError(f"{path}: corrupt: the file's cache classes {str(classes)[:200]} differ from its "
                              "veloxquant metadata")
    for key, kind in scalars[1:]:
        if kind not in _SCALAR_KINDS:
            raise SavedCacheError(f"{path}: corrupt: unknown scalar kind {kind!r} for {key!r}")
        arrays[key] = _SCALAR_KINDS[kind](arrays[key])
    states = tree_unflatten(list(arrays.items()))
    if not isinstance(states, list) or len(states) != len(classes):
        raise SavedCacheError(f"{path}: corrupt: the file holds states for {len(states)} layers, its metadata "
                              f"lists {len(classes)}")
    allowed = _allowed_classes(info["method"])
    caches = []
    for i, (name, state) in enumerate(zip(classes, states)):
        cls = allowed[name]  # read_cache_info checked every name against this list
        if issubclass(cls, CompressedKVCache):
            _check_layer_state(path, i, cls, state, info)
        caches.append(cls.from_state(state))
    return caches


def _check_layer_state(path: str, i: int, cls: type, state, info: dict) -> None:
    """A compressed layer's ``state``: config of the file's method, offset, declared scalars and arrays only,
    the recorded head shape."""

    def bad(why):
        raise SavedCacheError(f"{path}: corrupt or forged: layer {i} ({cls.__name__}): {why}")

    if not isinstance(state, dict) or not isinstance(state.get("meta"), str):
        bad("its state is not {meta, arrays}")
    if hasattr(cls, "part_classes"):  # an eviction cache + a quantizer cache: each checked as its method's
        try:
            parts = cls.part_classes(state)
            rows = json.loads(state["evict"]["meta"])["scalars"]["rows"]
        except Exception as exc:  # noqa: BLE001 - a malformed part: whatever parsing it raised
            bad(f"its parts do not parse: {type(exc).__name__}: {str(exc)[:200]}")
        for name, (part_cls, method) in parts.items():
            offset = info["offset"] if name == "evict" else rows  # the quantizer counts the rows it holds
            _check_layer_state(path, i, part_cls, state[name], {**info, "method": method, "offset": offset})
        state = {k: v for k, v in state.items() if k not in parts}
    if extra := set(state) - {"meta", *cls.array_fields}:
        bad(f"arrays {sorted(extra)} are not among the class's {list(cls.array_fields)}")
    if not all(state[k] is None or isinstance(state[k], mx.array) for k in cls.array_fields if k in state):
        bad("an array field holds a non-array value")
    try:
        meta = json.loads(state["meta"])
    except ValueError:
        bad("its meta is not JSON")
    if not isinstance(meta, dict) or set(meta) != {"config", "offset", "scalars", "shape"}:
        bad("its meta must have exactly config, offset, scalars and shape")
    if not _is_int(meta["offset"]) or meta["offset"] != info["offset"]:
        bad(f"offset {str(meta['offset'])[:40]} differs from the file's {info['offset']} tokens")
    scalars = meta["scalars"]
    if not isinstance(scalars, dict):
        bad("its scalars are not an object")
    if foreign := sorted(set(scalars) - set(cls.scalar_fields)):
        bad(f"scalars {str(foreign)[:200]} are not attributes {cls.__name__} declares "
            f"(its scalar_fields: {', '.join(cls.scalar_fields) or 'none'})")
    for k, v in scalars.items():
        objects = k in cls.object_scalar_fields
        if not _plain_value(v, objects):
            bad(f"scalar {k!r} must be a number, string, boolean, null or a list of them"
                + (" (or an object of them)" if objects else ""))
    recorded = info["head_shapes"][i]
    if meta["shape"] != (recorded or []):
        bad(f"head shape {str(meta['shape'])[:80]} differs from the recorded {recorded}")
    config = meta["config"]
    try:
        fields = json.loads(config) if isinstance(config, str) else None
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        if fields.get("dtype", "float16") not in DTYPE_NAMES:
            raise ValueError(f"dtype {str(fields['dtype'])[:40]!r} is not one of {', '.join(DTYPE_NAMES)}")
        if never := sorted(set(fields) & {"store", "observers", "options"}):
            raise ValueError(f"fields {never} are never saved")
        parsed = config_from_json(config)
    except Exception as exc:  # noqa: BLE001 - whatever the config's own validation raises
        bad(f"its config does not parse: {type(exc).__name__}: {str(exc)[:200]}")
    if parsed.method != info["method"] or cls.method_name != info["method"]:
        bad(f"it holds a {cls.method_name!r} cache configured for {parsed.method!r}, but the file says method "
            f"{info['method']!r}")


def _plain_value(v, objects: bool = False) -> bool:
    """A number, string, boolean, null or a list of them (with ``objects`` also string-keyed objects)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if objects and isinstance(v, dict):
        return all(isinstance(k, str) and _plain_value(x, objects) for k, x in v.items())
    return isinstance(v, list) and all(_plain_value(x, objects) for x in v)


def _check_rebuilt(path: str, caches: list, info: dict) -> None:
    """After ``from_state``: offsets, rows and shapes agree with the recorded head shapes (MLX infers shapes
    without computing)."""
    for i, (c, recorded) in enumerate(zip(caches, info["head_shapes"])):
        name = type(c).__name__
        try:
            if isinstance(c, CompressedKVCache):
                rows = int(c.stored_rows())
                if not 0 <= rows <= info["offset"] or c.offset != info["offset"]:
                    raise ValueError(f"{rows} stored rows at offset {c.offset} for {info['offset']} tokens")
                keys, values = c._dense() if rows else (None, None)
            elif name in _KV_CLASSES:
                keys, values = c.keys, c.values
                if not _is_int(c.offset) or c.offset != info["offset"]:
                    raise ValueError(f"offset {c.offset} for {info['offset']} tokens")
                if name == "KVCache" and keys is not None and keys.shape[2] < c.offset:
                    raise ValueError(f"{keys.shape[2]} rows for offset {c.offset}")
            else:
                continue
            if keys is None or recorded is None:
                continue
            h, dk, dv = recorded
            if (keys.ndim, values.ndim) != (4, 4) or (keys.shape[1], keys.shape[3]) != (h, dk) \
                    or (values.shape[1], values.shape[3]) != (h, dv) or keys.shape[2] != values.shape[2]:
                raise ValueError(f"keys {keys.shape} and values {values.shape} do not hold {h} heads of "
                                 f"dimensions {dk}/{dv}")
            if isinstance(c, CompressedKVCache) and keys.shape[2] != rows:
                raise ValueError(f"{keys.shape[2]} rows where the cache says it stores {rows}")
            if not (mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(values.dtype, mx.floating)):
                raise ValueError(f"keys/values of dtype {keys.dtype}/{values.dtype}")
        except Exception as exc:  # noqa: BLE001 - inconsistent arrays raise whatever MLX raises
            raise SavedCacheError(f"{path}: corrupt or forged: layer {i} ({name}) is inconsistent with its "
                                  f"recorded head shape {recorded}: {type(exc).__name__}: {str(exc)[:200]}") from None


def load_cache(path, *, model=None, expect_method: Optional[str] = None,
               expect_model_id: Optional[str] = None, install_dispatch: bool = True) -> tuple[list, dict]:
    """``(caches, info)`` of a file :func:`save_cache` wrote, the caches bit-identical (pass as
    ``prompt_cache=`` after ``info["tokens"]``); ``model``, ``expect_method`` and ``expect_model_id`` are
    checked when given; the dispatch point is installed for compressed caches unless ``install_dispatch=False``."""
    from ..measure import cache_tokens
    path = os.fspath(path)
    info = read_cache_info(path)
    if expect_method is not None and expect_method != info["method"]:
        raise SavedCacheError(f"{path}: method mismatch: the file holds a {info['method']!r} cache, "
                              f"expected {expect_method!r}")
    _check_model(path, info, model, expect_model_id)
    try:
        caches = _rebuild(path, info)
    except SavedCacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything mlx or a cache's from_state raises
        raise SavedCacheError(f"{path}: could not rebuild the caches: {type(exc).__name__}: {exc}") from None
    with mx.stream(mx.cpu):  # the op path's shape checks: a GPU kernel would read inconsistent arrays unchecked
        _check_rebuilt(path, caches, info)
    held, seen = _state_bytes(caches), cache_tokens(caches)
    if (held, seen) != (info["state_bytes"], info["offset"]):
        raise SavedCacheError(f"{path}: corrupt: the loaded caches' state holds {held} bytes at offset {seen}, "
                              f"the file recorded {info['state_bytes']} bytes at offset {info['offset']}")
    if install_dispatch and any(isinstance(c, CompressedKVCache) for c in caches):
        dispatch.install()
    return caches, info
