"""Cache settings from strings (CLI, server requests, ``veloxquant eval``): ``FIELD=VALUE`` items into a checked
``KVCacheConfig``. A setting is an option name (``budget``) or its flat field (``snap_budget``); one the method
does not read is refused. ``"none"`` (:data:`NONE`) is mlx_lm's plain ``KVCache``: it takes no settings.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

from .base import METHOD_NAMES, STANDALONE_METHODS, implemented_class
from .config import _DEFAULTS, _FIELD_TYPES, DTYPE_NAMES, KVCacheConfig, _quiet_flat_fields, allowed_values
from .options import COMMON_FIELDS, DERIVED_FIELDS, OPTIONS_BY_METHOD, method_fields, quantizer_methods

__all__ = ["NONE", "UsageError", "parse_set", "parse_sets", "build_config", "method_config", "method_settings",
           "settings_summary", "check_method_name", "check_buildable"]

NONE = "none"  # mlx_lm's own uncompressed ``KVCache``, accepted wherever a method name is
_NOT_SETTABLE = {"method": "use --method", "options": "set the flat fields instead",
                 "store": "an ArtifactStore object", "observers": "observer objects",
                 **{f: "an array: pass it through the Python API" for f in (
                     "smooth_factors", "key_codebook", "value_codebook", "a2ats_query_h", "a2ats_codebook")}}


class UsageError(Exception):
    """Bad settings text: the CLI reports it as ``error: ...`` (exit code 2), the server as HTTP 400."""


def parse_set(item: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` -> ``(FIELD, value)``: JSON if it parses, ``true``/``false``/``none`` in any case, else
    the string."""
    field, sep, raw = item.partition("=")
    field = field.strip()
    if not sep or not field:
        raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
    text = raw.strip()
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in words:
        return field, words[text.lower()]
    try:
        return field, json.loads(text)
    except ValueError:
        return field, raw


def parse_sets(items: Optional[Sequence[str]], method: Optional[str] = None) -> dict[str, Any]:
    """``FIELD=VALUE`` items -> ``{flat field: value}`` (``UsageError`` for unknown or unsettable ones); with
    ``method`` also its option names, and fields it does not read refused."""
    known = {f.name for f in dataclasses.fields(KVCacheConfig)}
    accepted = method_fields(method) if method is not None and method != NONE else None
    out: dict[str, Any] = {}
    # an eviction method storing its kept rows quantized takes its quantizer's settings too: bare names when
    # the same items set ``quantize``, else in the explicit form ``QUANTIZER:NAME`` (eval's scoped --set)
    composing = accepted is not None and "quantize" in accepted and any(
        i.partition("=")[0].strip() == "quantize" for i in items or ())
    for item in items or ():
        field, value = parse_set(item)
        if field in _NOT_SETTABLE:
            raise UsageError(f"field {field!r} cannot be set with --set: {_NOT_SETTABLE[field]}")
        if field in DERIVED_FIELDS:
            raise UsageError(f"field {field!r} cannot be set with --set: the library derives it per layer")
        if accepted is not None:
            quantizer = "quantize" in accepted and _quantizer_field(field)
            # a setting of the quantizer that stores the kept rows passes: build_config resolves it
            if field not in accepted and not (quantizer and (composing or ":" in field)):
                also = " (with quantize=METHOD, a quantizer's setting)" if quantizer else ""
                raise UsageError(f"method {method!r} has no setting {field!r}{_owner_hint(field)}{also}: it does not "
                                 f"read it; its settings: {settings_summary(method)} (`veloxquant methods {method}`)")
            field = accepted.get(field, field)
        elif field not in known:
            close = sorted(n for n in known if field.lower() in n or n in field.lower())[:5]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise UsageError(f"unknown KVCacheConfig field {field!r}{hint}")
        _put(out, field, value)  # an option and its flat alias, or a repeated name
    return out


def _put(out: dict, field: str, value: Any) -> None:
    """``out[field] = value``, or ``UsageError`` naming both values when ``field`` already holds another one."""
    if field in out and out[field] is not value and out[field] != value:
        raise UsageError(f"{field!r} is set twice ({out[field]!r} and {value!r}): give it once")
    out[field] = value


def _quantizer_field(field: str) -> bool:
    """``QUANTIZER:NAME`` or a bare ``NAME`` that some quantizer reads (an eviction method's ``quantize``)."""
    q, colon, name = field.rpartition(":")
    return name not in COMMON_FIELDS and any(name in method_fields(m) for m in ([q] if colon else quantizer_methods())
                                             if m in quantizer_methods())


def _split_quantizer(method: str, flat: dict, own_fields) -> None:
    """Move the quantizer's own settings out of an eviction method's ``flat`` into ``flat["quantize"]`` (its
    options object); the shared flat fields it reads stay in ``flat``."""
    q = flat.get("quantize")
    extra = [k for k in flat if k not in own_fields]
    if q is None:
        extra = [k for k in extra if ":" in k]  # other flat fields go to KVCacheConfig as they are
        if extra:
            raise UsageError(f"{extra[0]!r} is a setting of a quantizer, not of {method!r}: add quantize=METHOD "
                             f"({', '.join(quantizer_methods()[:4])}, ...) to store the kept rows quantized")
        return
    if not isinstance(q, str) or q not in quantizer_methods():
        return  # KVCacheConfig reports the invalid value
    qfields, picked = method_fields(q), {}
    for k in extra:
        scope, _, name = k.rpartition(":")
        if scope not in ("", q) or name not in qfields:
            raise UsageError(f"quantizer {q!r} has no setting {name!r}; its settings: {settings_summary(q)}")
        _put(picked, qfields[name], flat.pop(k))  # bare and ``QUANTIZER:NAME`` may both be given
    opts = _pop_options(q, picked)
    for k, v in picked.items():
        _put(flat, k, v)
    flat["quantize"] = q if opts is None else opts


def _pop_options(method: str, flat: dict):
    """``method``'s options object from the fields of ``flat`` it owns (popped), or None."""
    cls = OPTIONS_BY_METHOD.get(method)
    by_flat = {f: o for o, f in cls.FIELDS.items()} | {o: o for o in cls.OPTION_ONLY} if cls else {}
    picked = {by_flat[k]: flat.pop(k) for k in list(flat) if k in by_flat}
    return cls(**picked) if picked else None


def _owner_hint(field: str) -> str:
    """`` (a setting of snapkv, ...)`` for a field other methods read, else ``""``."""
    owners = [m for m in METHOD_NAMES if field in method_fields(m)]
    if not owners:
        return " (no method has a setting of that name)"
    more = f", ... ({len(owners)} methods)" if len(owners) > 4 else ""
    return f" (a setting of {', '.join(owners[:4])}{more})"


def method_settings(method: str) -> list[dict]:
    """One row per settable name of ``method``: name, flat alias, kind (option or shared), type, default,
    allowed."""
    opts, names = OPTIONS_BY_METHOD.get(method), method_fields(method)
    by_flat = {f: o for o, f in opts.FIELDS.items()} if opts else {}
    rows = []
    for name, flat in names.items():
        opt = by_flat.get(flat)
        if flat in _NOT_SETTABLE or (name == flat != opt and names.get(opt) == flat):
            continue  # the flat alias of an option: shown on the option's row
        if opts is not None and name in opts.OPTION_ONLY:  # no flat field: described by the options class
            f = next(f for f in dataclasses.fields(opts) if f.name == name)
            typ, default, allowed, opt = f.type, f.default, opts.RULES[name].allowed, name
        else:  # an option's flat field (its own name if a shared field took that: snapkv's dtype) or a shared one
            typ, default, allowed = _FIELD_TYPES[flat], _DEFAULTS[flat], allowed_values(flat)
        rows.append({"name": name, "flat": flat, "kind": "option" if opt else "shared",
                     "type": str(typ).replace("typing.", ""), "default": default, "allowed": allowed})
    return rows


def settings_summary(method: str) -> str:
    """``budget (snap_budget), n_sink (snap_n_sink), dtype``: the names ``--set`` takes for ``method``."""
    parts = [f"{r['name']} ({r['flat']})" if r["name"] != r["flat"] else r["name"] for r in method_settings(method)]
    return ", ".join(parts) or "none"


def build_config(method: str, sets: dict[str, Any]):
    """``KVCacheConfig(method=method, **sets)``, ``sets`` by flat field or option name (the options through the
    options dataclass); a ``dtype`` string names an mlx dtype."""
    aliases, flat = method_fields(method), {}
    for k, v in sets.items():
        _put(flat, aliases.get(k, k), v)  # an option and its flat alias: one value
    if "quantize" in aliases:  # an eviction method: its kept rows may be stored by a quantizer
        _split_quantizer(method, flat, set(aliases.values()))
    if isinstance(flat.get("dtype"), str):
        import mlx.core as mx
        name = flat["dtype"]
        if name not in DTYPE_NAMES:
            raise UsageError(f"dtype={name!r} is not allowed; allowed: {', '.join(DTYPE_NAMES)}")
        flat["dtype"] = getattr(mx, name)
    options = _pop_options(method, flat)
    unknown = next((k for k in flat if k not in _FIELD_TYPES), None)  # a KVCacheConfig TypeError otherwise
    if unknown is not None:
        raise UsageError(f"method {method!r} has no setting {unknown!r}; its settings: {settings_summary(method)}")
    with _quiet_flat_fields():  # a shared field other options own (vecinfer's key_sub_dim) does not warn
        return KVCacheConfig(method=method, options=options, **flat)


def method_config(method: str, set_items, *, standalone_ok: bool = True):
    """Check ``method`` and its ``FIELD=VALUE`` items: ``(sets, config)``, ``config`` None for ``none``."""
    check_method_name(method)
    sets = parse_sets(set_items, method=method)
    if method == NONE:
        if sets:
            raise UsageError(f"--set does not apply to --method {NONE} (mlx_lm's plain KVCache)")
        return sets, None
    if not standalone_ok and method in STANDALONE_METHODS:
        raise UsageError(f"method {method!r} has the standalone protocol (append_key/append_value): it makes no "
                         "mlx_lm prompt cache; `veloxquant methods` lists the mlx_lm-protocol ones")
    config = build_config(method, sets)
    implemented_class(method)
    return sets, config


def check_method_name(method: str) -> None:
    """``UsageError`` unless ``method`` is a registered method or ``none``."""
    if method != NONE and method not in METHOD_NAMES:
        raise UsageError(f"unknown method {method!r}; `veloxquant methods` lists the {len(METHOD_NAMES)} "
                         f"methods (or use {NONE!r} for mlx_lm's uncompressed cache)")


check_buildable = implemented_class  # ``NotImplementedError`` for a registered but unbuilt method, before a model loads
