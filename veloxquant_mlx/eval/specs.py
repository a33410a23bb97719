"""Which caches to measure: a method name plus its settings (``MethodSpec``), and the ``--set`` rules.

``--set FIELD=VALUE`` applies to every listed method it belongs to: a method-specific flat field
(``snap_budget``) only to the method whose options own it, a general field (``bit_width_inlier``) to every
method except ``none``. ``--set METHOD:FIELD=VALUE`` applies to that method only, and there FIELD may also
be the option's short name (``snapkv:budget=256``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

__all__ = ["NONE", "MethodSpec", "resolve_methods", "implemented_mlx_lm_methods", "split_sets"]

NONE = "none"


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
        if not self.settings:
            return self.method
        return self.method + " " + " ".join(f"{k}={v}" for k, v in self.settings.items())

    def config(self):
        """The ``KVCacheConfig`` (None for ``none``)."""
        if self.method == NONE:
            return None
        from ..cli import build_config

        return build_config(self.method, dict(self.settings))

    @classmethod
    def coerce(cls, item: Any) -> "MethodSpec":
        """A ``MethodSpec`` from a spec, a name, or a ``(name, settings)`` pair."""
        if isinstance(item, MethodSpec):
            return item
        if isinstance(item, str):
            return cls(item, {})
        name, settings = item
        return cls(str(name), dict(settings or {}))


def implemented_mlx_lm_methods() -> list[str]:
    """Every implemented method with the mlx_lm serving protocol, in registry order."""
    from ..cache import all_methods
    from ..cache.base import MLX_LM

    return [i.name for i in all_methods() if i.implemented and i.protocol == MLX_LM]


def split_sets(items: Optional[Sequence[str]]) -> list[tuple[Optional[str], str]]:
    """``["snapkv:budget=256", "bit_width_inlier=4"]`` ->
    ``[("snapkv", "budget=256"), (None, "bit_width_inlier=4")]``."""
    out = []
    for item in items or ():
        head, eq, _ = item.partition("=")
        scope, colon, rest = head.partition(":")
        if colon and eq:
            out.append((scope.strip(), item.split(":", 1)[1]))
        else:
            out.append((None, item))
    return out


def resolve_methods(methods: Iterable[str], sets: Optional[Sequence[str]] = None,
                    include_none: bool = True) -> list[MethodSpec]:
    """Validated ``MethodSpec`` list (``none`` first when ``include_none``), ``--set`` items distributed.

    Raises ``cli.UsageError`` for unknown methods or fields, fields that apply to none of the methods,
    and ``NotImplementedError`` for registered but unbuilt methods; configurations are built once here
    so invalid values fail (``QuantizerConfigError``) before any model is loaded.
    """
    from ..cache.base import STANDALONE_METHODS
    from ..cache.options import FLAT_FIELD_OPTIONS, OPTIONS_BY_METHOD
    from ..cli import UsageError, _check_buildable, _check_method_name, parse_sets

    names = list(dict.fromkeys(m.strip() for m in methods if m and m.strip()))
    if include_none and NONE not in names:
        names.insert(0, NONE)
    for m in names:
        _check_method_name(m)
        if m != NONE and m in STANDALONE_METHODS:
            raise UsageError(f"method {m!r} has the standalone protocol (no mlx_lm serving contract); "
                             "only mlx_lm-protocol methods can run in a model")
    per_method: dict[str, dict] = {m: {} for m in names}
    for scope, item in split_sets(sets):
        if scope is not None:
            if scope not in per_method:
                raise UsageError(f"--set {scope}:{item}: {scope!r} is not one of the methods measured")
            if scope == NONE:
                raise UsageError(f"--set does not apply to {NONE!r} (mlx_lm's plain KVCache)")
            opts = OPTIONS_BY_METHOD.get(scope)
            fname, eq, value = item.partition("=")
            if opts is not None and fname.strip() in opts.FIELDS:  # short option name
                item = f"{opts.FIELDS[fname.strip()]}{eq}{value}"
            per_method[scope].update(parse_sets([item]))
            continue
        (fname, value), = parse_sets([item]).items()
        def owns(m, fname=fname):
            opts = OPTIONS_BY_METHOD.get(m)
            return opts is not None and fname in opts.FIELDS.values()

        targets = [m for m in names if m != NONE and (fname not in FLAT_FIELD_OPTIONS or owns(m))]
        if not targets:
            raise UsageError(f"--set {item}: {fname!r} applies to none of the methods measured "
                             f"({', '.join(names)})")
        for m in targets:
            per_method[m][fname] = value
    specs = []
    for m in names:
        spec = MethodSpec(m, per_method[m])
        if m != NONE:
            spec.config()  # validate now
            _check_buildable(m)
        specs.append(spec)
    return specs
