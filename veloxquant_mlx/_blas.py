"""Make MLX's CPU backend use OpenBLAS on Linux.

The MLX Linux CPU wheel links a reference (netlib) BLAS: an fp32 matmul runs
at ~5 GFLOP/s on a 2-core x86_64 machine.  MLX only calls ``cblas_sgemm`` /
``dgemm`` / ``cgemm``, and those symbols are resolved through the global
symbol scope, so loading OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core``
is first imported makes MLX use it (~180 GFLOP/s, same results).

Nothing here is required for correctness: if no OpenBLAS is found, or if
``mlx.core`` has already been imported, :func:`preload` simply returns
``None`` and MLX keeps its (slower) bundled BLAS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["preload", "loaded_path", "compute_dtype", "ENV_VAR", "DEFAULT_PATHS"]

#: Environment variable: a path to an OpenBLAS shared library to load first,
#: or ``0`` / ``off`` (also ``false`` / ``no`` / ``none``) to disable preloading.
ENV_VAR = "VELOXQUANT_OPENBLAS"

#: Debian/Ubuntu ``libopenblas0-pthread`` locations, tried in order.
DEFAULT_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

_DISABLED_VALUES = {"0", "off", "false", "no", "none"}

# Keep a reference to the loaded library (and remember its path) so repeated
# calls are cheap and report what was loaded.
_loaded_path: str | None = None
_loaded_lib: ctypes.CDLL | None = None


def _candidates() -> list[str]:
    out: list[str] = []
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        out.append(env)
    out.extend(DEFAULT_PATHS)
    try:
        found = ctypes.util.find_library("openblas")
    except Exception:  # find_library may shell out; never let it raise
        found = None
    if found:
        out.append(found)
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def preload() -> str | None:
    """Load OpenBLAS globally so that MLX's ``cblas_*`` calls resolve to it.

    Search order: ``$VELOXQUANT_OPENBLAS`` (``0``/``off`` disables), the
    Debian/Ubuntu ``openblas-pthread`` paths for x86_64 and aarch64, then
    ``ctypes.util.find_library("openblas")``.

    Returns the path (or library name) that was loaded, or ``None`` when
    nothing was loaded: not Linux, disabled, no library found, or
    ``mlx.core`` already imported (too late to matter).  Never raises.
    Idempotent: later calls return the first successful result.
    """
    global _loaded_path, _loaded_lib
    try:
        if _loaded_path is not None:
            return _loaded_path
        if not sys.platform.startswith("linux"):
            return None
        if os.environ.get(ENV_VAR, "").strip().lower() in _DISABLED_VALUES:
            return None
        if "mlx.core" in sys.modules:
            # MLX has already bound its BLAS symbols; loading now is useless.
            return None
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                continue
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            try:
                lib.cblas_sgemm  # noqa: B018 - must export the symbol MLX needs
            except AttributeError:
                continue
            _loaded_lib = lib
            _loaded_path = path
            return path
        return None
    except Exception:  # pragma: no cover - defensive: a missing BLAS only means slower
        return None


def loaded_path() -> str | None:
    """The OpenBLAS path loaded by :func:`preload` in this process, if any."""
    return _loaded_path


def compute_dtype():
    """Preferred compute dtype for the current default device.

    ``mx.float32`` on the CPU (half precision never reaches BLAS there and is
    ~40x slower), ``mx.float16`` on GPU backends (Metal / CUDA).
    """
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return mx.float16
