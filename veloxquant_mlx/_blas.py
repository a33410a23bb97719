"""Make MLX's CPU backend use OpenBLAS on Linux: the MLX Linux wheel links a reference BLAS (~5 GFLOP/s fp32
matmul on 2 x86_64 cores) and calls only ``cblas_sgemm``/``dgemm``/``cgemm`` through the global symbol scope, so
OpenBLAS loaded with ``RTLD_GLOBAL`` before ``mlx.core`` is imported replaces it (~180 GFLOP/s, same results).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["preload", "compute_dtype", "ENV_VAR", "DEFAULT_PATHS"]

#: A path to an OpenBLAS library to load first, or ``0``/``off``/``false``/``no``/``none`` to disable.
ENV_VAR = "VELOXQUANT_OPENBLAS"
#: Debian/Ubuntu ``libopenblas0-pthread`` locations, tried in order.
DEFAULT_PATHS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                 "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")
_loaded: tuple | None = None  # (path, CDLL): keeps the library referenced; repeated calls are cheap


def preload() -> str | None:
    """Load OpenBLAS globally (``$VELOXQUANT_OPENBLAS``, :data:`DEFAULT_PATHS`, then ``find_library``); the path
    loaded, or None when not Linux, disabled, nothing found, or ``mlx.core`` already imported. Never raises."""
    global _loaded
    if _loaded is not None:
        return _loaded[0]
    disabled = os.environ.get(ENV_VAR, "").strip().lower() in {"0", "off", "false", "no", "none"}
    if not sys.platform.startswith("linux") or disabled or "mlx.core" in sys.modules:
        return None
    try:
        found = ctypes.util.find_library("openblas")
    except Exception:  # find_library may shell out; never let it raise
        found = None
    for path in dict.fromkeys(p for p in (os.environ.get(ENV_VAR, "").strip(), *DEFAULT_PATHS, found) if p):
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - must export the symbol MLX needs
        except (OSError, AttributeError):
            continue
        _loaded = (path, lib)
        return path
    return None


def compute_dtype():
    """``mx.float32`` on the CPU (half precision never reaches BLAS there: ~40x slower), else ``mx.float16``."""
    import mlx.core as mx
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else mx.float16
