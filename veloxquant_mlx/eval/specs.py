"""Which caches to measure: a method name plus its settings (``MethodSpec``), and the ``--set`` rules.

``--set FIELD=VALUE`` applies to every listed method that reads FIELD (``cache.options.method_fields``: e.g.
``snap_budget`` to snapkv, ``budget`` to every method with that option); a field no listed method reads is an
error. ``--set METHOD:FIELD=VALUE`` applies to that method only. ``--method "METHOD FIELD=VALUE ..."`` is one
configuration with its own settings (a run may hold several of a method); ``--sweep [METHOD:]FIELD=V1,V2``
runs each configuration it applies to once per value. A method string's settings and a sweep's values replace
``--set``'s; otherwise one setting given two values (``--set`` twice, an option and its flat alias, two sweeps of
it) is a ``UsageError`` (``cache.settings.parse_sets``), never the last one kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from ..cache.settings import NONE, UsageError, build_config, check_buildable, check_method_name, parse_set, parse_sets

__all__ = ["NONE", "MethodSpec", "resolve_methods", "implemented_mlx_lm_methods", "split_sets", "sweep_values"]


@dataclass(frozen=True)
class MethodSpec:
    """One cache configuration to measure: ``method`` (or ``"none"``) and the settings given to it."""

    method: str
    settings: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> tuple:
        return (self.method, tuple(sorted((k, repr(v)) for k, v in self.settings.items())))

    @property
    def label(self) -> str:
        return " ".join([self.method, *(f"{k}={v}" for k, v in self.settings.items())])

    def config(self):  # the KVCacheConfig (None for none)
        return None if self.method == NONE else build_config(self.method, dict(self.settings))

    @classmethod
    def coerce(cls, item: Any) -> "MethodSpec":
        """A ``MethodSpec`` from a spec, a name, or a ``(name, settings)`` pair."""
        if isinstance(item, (MethodSpec, str)):
            return cls(item) if isinstance(item, str) else item
        return cls(str(item[0]), dict(item[1] or {}))


def implemented_mlx_lm_methods() -> list[str]:  # in registry order
    from ..cache import all_methods
    from ..cache.base import MLX_LM
    return [i.name for i in all_methods() if i.implemented and i.protocol == MLX_LM]


def split_sets(items: Optional[Sequence[str]]) -> list[tuple[Optional[str], str]]:
    """``["snapkv:budget=256", "bit_width_inlier=4"]`` ->
    ``[("snapkv", "budget=256"), (None, "bit_width_inlier=4")]``."""
    out = []
    for item in items or ():
        head, eq, _ = item.partition("=")
        scope, colon, _ = head.partition(":")
        out.append((scope.strip(), item.split(":", 1)[1]) if colon and eq else (None, item))
    return out


def sweep_values(text: str) -> list:
    """``"256,512"`` -> ``[256, 512]``; ``"[8,4],[4,2]"`` -> two lists; ``"norm,attention"`` -> two strings."""
    try:
        values = json.loads(f"[{text}]")
    except ValueError:
        values = [v.strip() for v in text.split(",")]
    if not values or any(v == "" for v in values):
        raise UsageError(f"--sweep expects FIELD=V1,V2,..., got values {text!r}")
    return values


def resolve_methods(methods: Iterable[str], sets: Optional[Sequence[str]] = None,
                    include_none: bool = True, sweeps: Optional[Sequence[str]] = None) -> list[MethodSpec]:
    """Validated ``MethodSpec`` list (``none`` first when ``include_none``): a ``methods`` entry is a name or
    ``"NAME FIELD=VALUE ..."`` (applied after ``sets``); ``sweeps`` multiply the configurations they apply to.
    Configurations are built here, so bad values fail before any model is loaded."""
    from ..cache.base import STANDALONE_METHODS
    from ..cache.options import method_fields
    entries = [(e.split()[0], e.split()[1:]) for e in dict.fromkeys(m.strip() for m in methods if m and m.strip())]
    if include_none and all(m != NONE for m, _ in entries):
        entries.insert(0, (NONE, []))
    names = list(dict.fromkeys(m for m, _ in entries))
    for m in names:
        check_method_name(m)
        if m != NONE and m in STANDALONE_METHODS:
            raise UsageError(f"method {m!r} has the standalone protocol (no mlx_lm serving contract); "
                             "only mlx_lm-protocol methods can run in a model")

    def targets(scope, item, flag):
        if scope is not None:
            if scope not in names:
                raise UsageError(f"{flag} {scope}:{item}: {scope!r} is not one of the methods measured")
            if scope == NONE:
                raise UsageError(f"{flag} does not apply to {NONE!r} (mlx_lm's plain KVCache)")
            return [scope]
        fname, _ = parse_set(item)
        found = [m for m in names if m != NONE and fname in method_fields(m)]
        if not found:
            parse_sets([item])  # an unknown or unsettable field: its own message
            raise UsageError(f"{flag} {item}: {fname!r} applies to none of the methods measured "
                             f"({', '.join(names)}); `veloxquant methods NAME` lists a method's settings")
        return found
    items: dict[str, list] = {m: [] for m in names}
    for scope, item in split_sets(sets):
        for m in targets(scope, item, "--set"):
            items[m].append(item)
    # each method's items parsed together: one setting given two values (a repeat, an alias) is refused
    per_method = {m: parse_sets(items[m], method=m) for m in names if m != NONE}
    if any(own for m, own in entries if m == NONE):
        raise UsageError(f"--method {NONE!r} takes no settings")
    specs = [MethodSpec(m, {**per_method.get(m, {}), **parse_sets(own, method=m if m != NONE else None)})
             for m, own in entries]
    swept: dict[tuple, str] = {}  # (method, field) -> the --sweep that set it
    for scope, item in split_sets(sweeps):
        hit = targets(scope, item, "--sweep")
        fname, _ = parse_set(item)
        values = sweep_values(item.partition("=")[2])
        given = f"{scope}:{item}" if scope is not None else item
        for m in hit:
            flat = next(iter(parse_sets([f"{fname}={json.dumps(values[0])}"], method=m)))
            if (m, flat) in swept:
                raise UsageError(f"--sweep {given}: {flat!r} of {m} is swept twice (also by --sweep "
                                 f"{swept[m, flat]}): give its values in one --sweep")
            swept[m, flat] = given
        specs = [MethodSpec(s.method, {**s.settings, **parse_sets([f"{fname}={json.dumps(v)}"], method=s.method)})
                 if s.method in hit else s for s in specs for v in (values if s.method in hit else [None])]
    specs = list({s.key: s for s in specs}.values())
    for spec in specs:
        if spec.method != NONE:
            spec.config()  # validate now
            check_buildable(spec.method)
    return specs
