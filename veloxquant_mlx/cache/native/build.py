"""Builds the CPU kernels' extension (``SOURCES``: MLX primitives bound with nanobind) on first use, into
the package's cache (``$VELOXQUANT_CACHE/native/<key>``, default ``~/.cache/veloxquant_mlx``) keyed by everything the
binary depends on, and loads it.

Needs a C++17 compiler, CMake >= 3.24 and nanobind (the ``cpu`` extra: ``pip install 'veloxquant-mlx[cpu]'``). The
binary is built for the machine that builds it (``-march=native``; ``VELOXQUANT_CPU_ARCH`` names another target, e.g.
``x86-64-v3`` for any AVX2 machine), so the key includes the CPU's identity and that setting; builds
by concurrent processes (test workers) are serialized by a file lock. A failed build leaves a ``failed.txt`` beside
the key (no retry in later processes: remove the directory to try again). A new build removes the directories no
process has loaded for ``STALE_DAYS`` (``prune_stale``: one per package version would pile up)."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MODULE = "_veloxquant_cpu"
SOURCES = ("common.h", "module.cpp", "waterfill_cpu.cpp", "kivi_cpu.cpp", "turboquant_rvq_cpu.cpp",
           "turboquant_rvq_encode_cpu.cpp", "joint_finish_cpu.cpp", "softmax_cpu.cpp", "latent_cpu.cpp",
           "drop_row_cpu.cpp", "kvquant_cpu.cpp", "CMakeLists.txt")


def target_arch() -> str:
    """The ``-march`` / ``-mcpu`` target: ``VELOXQUANT_CPU_ARCH`` (read at each build), else ``native``."""
    arch = os.environ.get("VELOXQUANT_CPU_ARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", arch):
        raise BuildError(f"VELOXQUANT_CPU_ARCH={arch!r} is not a compiler target name (letters, digits, '._+-')")
    return arch
_HERE = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """The extension could not be built or loaded here (the message says why)."""


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else the platform's processor name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def build_key() -> str:
    """Hash of the sources, MLX's and nanobind's versions, the Python ABI and the CPU."""
    import mlx.core as mx
    import nanobind

    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_HERE / name).read_bytes())
    for part in (mx.__version__, nanobind.__version__, sysconfig.get_config_var("EXT_SUFFIX") or "",
                 sys.version, platform.machine(), _cpu_identity(), target_arch()):
        h.update(str(part).encode())
    return h.hexdigest()[:20]


def _cmake() -> str:
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not found:
        raise BuildError("no cmake found (pip install cmake, or the 'cpu' extra)")
    return found


def _build(out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix="build-") as tmp:
        cmd = [_cmake(), "-S", str(_HERE), "-B", tmp, f"-DPython_EXECUTABLE={sys.executable}",
               "-DCMAKE_BUILD_TYPE=Release", "-DVELOXQUANT_NATIVE_ARCH=ON", f"-DVELOXQUANT_ARCH={target_arch()}"]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        for step in (cmd, [_cmake(), "--build", tmp, "--parallel", str(os.cpu_count() or 1)]):
            run = subprocess.run(step, capture_output=True, text=True)
            if run.returncode != 0:
                raise BuildError(f"{' '.join(step[:2])} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        built = [p for p in Path(tmp).iterdir() if p.name.startswith(MODULE + ".") and p.suffix in (".so", ".pyd")]
        if not built:
            raise BuildError(f"the build made no {MODULE} module")
        target = out_dir / built[0].name
        shutil.copy2(built[0], str(target) + ".tmp")
        os.replace(str(target) + ".tmp", target)
        return target


STALE_DAYS = 30  # a build directory no process has loaded for this long is removed after the next new build


def prune_stale(native_dir: Path, keep: Path, days: float = STALE_DAYS) -> list[Path]:
    """Remove the build directories under ``native_dir`` (other package versions, CPUs, targets) whose module no
    process has loaded for ``days`` (``load`` touches it; a directory without one, older than that), other than
    ``keep``; returns those removed. Run after a new build, so an upgraded package does not leave one per version."""
    cutoff, removed = time.time() - days * 86400, []
    for d in native_dir.iterdir():
        if not d.is_dir() or d == keep or d.name.startswith("build-"):
            continue
        stamps = [p.stat().st_mtime for p in d.iterdir()] or [d.stat().st_mtime]
        if max(stamps) < cutoff:
            shutil.rmtree(d, ignore_errors=True)
            Path(str(d) + ".lock").unlink(missing_ok=True)
            removed.append(d)
    return removed


def built_module_path() -> Path:
    """The extension's path for this machine, building it first if needed (raises :class:`BuildError`)."""
    try:
        import nanobind  # noqa: F401
    except ImportError as err:
        raise BuildError("nanobind is not installed (the 'cpu' extra: pip install 'veloxquant-mlx[cpu]')") from err
    from ...assets import cache_dir  # the package's per-user cache ($VELOXQUANT_CACHE)

    out_dir = cache_dir() / "native" / build_key()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / (out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others then find its result
        failed = out_dir / "failed.txt"
        if failed.exists():
            raise BuildError(f"an earlier build here failed (see {failed}; remove {out_dir} to retry)")
        for p in out_dir.iterdir():
            if p.name.startswith(MODULE + ".") and not p.name.endswith(".tmp"):
                os.utime(p)  # loaded now: not stale (prune_stale)
                return p
        try:
            built = _build(out_dir)
        except BuildError as err:
            failed.write_text(str(err))
            raise
        prune_stale(out_dir.parent, out_dir)
        return built


def load():
    """The built extension module (raises :class:`BuildError`)."""
    path = built_module_path()
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as err:
        raise BuildError(f"{path} does not load: {err}") from err
    return module
