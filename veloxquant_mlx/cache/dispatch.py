"""The attention dispatch point: lets a cache compute attention itself, seeing the real queries.

mlx_lm's model files call ``mlx_lm.models.base.scaled_dot_product_attention(q, k, v, cache=cache,
scale=..., mask=...)`` right after ``cache.update_and_fetch``. ``install()`` replaces that function (in
``mlx_lm.models.base`` and in every loaded model module that imported it) by one that hands the call to
``cache.attend(q, k, v, scale=, mask=, sinks=)`` when the cache has an ``attend`` method (all caches
of this library do), and to mlx_lm's original function otherwise. So:

* quantized caches compute attention on their codes; the dense K/V that ``update_and_fetch`` returned
  are lazy MLX arrays that are then never evaluated;
* eviction caches score tokens with the model's real queries instead of keys used as stand-ins.

Without ``install()`` every cache still works: ``update_and_fetch`` returns correct dense K/V and
eviction falls back to key proxies. ``KVCacheBuilder.for_model`` installs it (idempotent); set the
environment variable ``VELOXQUANT_DISPATCH=0`` to keep mlx_lm untouched.

``report_io(module, method)`` is the same idea one level up, for caches that need the hidden states
around attention (SqueezeAttention): after each call of that module (an attention module or a decoder
layer) with a cache that has ``method``, the cache's ``method(x, out)`` gets the module's input and output.
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


def _modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models."))]


def _disabled() -> bool:
    return os.environ.get("VELOXQUANT_DISPATCH", "1").lower() in ("0", "off", "false")


def install() -> bool:
    """Route mlx_lm attention through caches' ``attend``. Returns False if disabled by the env."""
    if _disabled():
        return False
    for module in _modules():
        if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = dispatched_sdpa
    return True


def uninstall() -> None:
    for module in _modules():
        if getattr(module, "scaled_dot_product_attention", None) is dispatched_sdpa:
            module.scaled_dot_product_attention = _ORIGINAL


def installed() -> bool:
    return _base.scaled_dot_product_attention is dispatched_sdpa


_IO_CLASSES: dict = {}


def _io_class(cls, method: str):
    """``cls`` with a ``__call__`` that, after the original, hands (first argument, result) to
    ``cache.<method>`` when the call's ``cache`` argument has that method (made once per pair)."""
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
                hook(args[0], out)
            return out

        _IO_CLASSES[key] = type(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__,
            "_io_methods": getattr(cls, "_io_methods", frozenset()) | {method}})
    return _IO_CLASSES[key]


def report_io(module, method: str) -> bool:
    """Make this one ``module`` instance report its input and output to its cache's ``method`` (see the
    module docstring); its parameters and other instances of its class are untouched (the instance's
    class becomes a subclass that only adds the report). Idempotent. Returns False, changing nothing,
    when ``VELOXQUANT_DISPATCH=0``."""
    if _disabled():
        return False
    if method not in getattr(type(module), "_io_methods", ()):
        module.__class__ = _io_class(type(module), method)
    return True
