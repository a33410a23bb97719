"""The attention dispatch point: a cache computes attention itself, seeing the real queries.

``install()`` replaces mlx_lm's ``scaled_dot_product_attention`` (in ``mlx_lm.models.base`` and every loaded
model module that imported it) by one handing the call to ``cache.attend(q, k, v, scale=, mask=, sinks=)``
when the cache has one: quantized caches attend on their codes (the lazy dense K/V of ``update_and_fetch``
are never evaluated), eviction caches score with the real queries. Without it every cache still works
(dense K/V, key proxies). ``KVCacheBuilder.for_model`` installs it; ``VELOXQUANT_DISPATCH=0`` leaves mlx_lm
untouched. ``report_io(module, method)`` does the same one level up, for caches that need the hidden states
around attention (SqueezeAttention): after each call of ``module`` the cache's ``method(x, out)`` gets its
input and output, and what it returns (not None: the same values, e.g. ``out`` tied with ``mx.depends`` to a
statistic of them) replaces the output.
"""

from __future__ import annotations

import inspect
import os
import sys

import mlx_lm.models.base as _base

_ORIGINAL = _base.scaled_dot_product_attention


def dispatched_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _swap(old, new) -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is old:
            module.scaled_dot_product_attention = new


def _disabled() -> bool:
    return os.environ.get("VELOXQUANT_DISPATCH", "1").lower() in ("0", "off", "false")


def install() -> bool:
    """Route mlx_lm attention through caches' ``attend``. Returns False if disabled by the env."""
    if _disabled():
        return False
    _swap(_ORIGINAL, dispatched_sdpa)
    return True


def uninstall() -> None:
    _swap(dispatched_sdpa, _ORIGINAL)


def installed() -> bool:
    return _base.scaled_dot_product_attention is dispatched_sdpa


_IO_CLASSES: dict = {}


def _io_class(cls, method: str):
    """``cls`` with a ``__call__`` that then hands (first argument, result) to ``cache.<method>`` (made once)."""
    key = (cls, method)
    if key not in _IO_CLASSES:
        names = list(inspect.signature(cls.__call__).parameters)[1:]  # after self
        at = names.index("cache") if "cache" in names else None

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            cache = kwargs.get("cache")
            if cache is None and at is not None and len(args) > at:
                cache = args[at]
            hook = getattr(cache, method, None)
            if hook is not None and args:
                tied = hook(args[0], out)
                out = out if tied is None else tied
            return out

        _IO_CLASSES[key] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__,
            "_io_methods": getattr(cls, "_io_methods", frozenset()) | {method}})
    return _IO_CLASSES[key]


def report_io(module, method: str) -> bool:
    """Make this ``module`` instance (only: its class becomes a subclass adding the report) report its input
    and output to its cache's ``method``. Idempotent; False, changing nothing, when ``VELOXQUANT_DISPATCH=0``."""
    if _disabled():
        return False
    if method not in getattr(type(module), "_io_methods", ()):
        module.__class__ = _io_class(type(module), method)
    return True
