"""Progress on stderr for every ``veloxquant`` command: one helper, quiet under ``--json``.

:class:`Progress` shows three things: stage lines (``[  3.1s] loading model``), a bar over a command's
units of work (eval rows, bench runs) and, inside each unit, the prefill's chunks (``prefill 4096/8192
tok``), so a minutes-long prefill is never silent. On a terminal the bars are ``tqdm`` bars redrawn in
place; otherwise (a log file, a pipe, a test's captured stderr) every stage, unit and chunk is one plain
line, so a log shows what ran and no carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

__all__ = ["Progress"]


class Progress:
    """``progress(msg)`` starts the next of ``total`` units; ``chunk(done, of)`` reports prefill chunks;
    ``stage(msg)`` and ``note(msg)`` print lines. ``enabled=False`` prints nothing at all."""

    def __init__(self, total: Optional[int] = None, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.done = 0
        self.t0 = time.perf_counter()
        self._units = None
        self._chunks = None
        self._last_chunk = None
        if self.tty and total:
            from tqdm import tqdm

            self._units = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True, leave=True)

    # ------------------------------------------------------------------ lines
    def _line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm

            tqdm.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def stage(self, msg: str) -> None:
        """A step of the command, with the time since it started."""
        self._line(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}")

    def note(self, msg: str) -> None:
        """A line as given (warnings, skipped methods)."""
        self._line(msg)

    # ------------------------------------------------------------------ units
    def __call__(self, msg: str) -> None:
        """Start the next unit of work, described by ``msg``."""
        self._end_chunks()
        self.done += 1
        if self._units is not None:
            if self.done > 1:
                self._units.update(1)
            self._units.set_description_str(msg[:60])
        elif self.total:
            self.stage(f"{min(self.done, self.total)}/{self.total} {msg}")
        else:
            self.stage(msg)

    def close(self, msg: Optional[str] = None) -> None:
        """The last unit is finished."""
        self._end_chunks()
        if self._units is not None:
            self._units.update(self._units.total - self._units.n)
            self._units.close()
            self._units = None
        if msg:
            self.stage(msg)

    # ------------------------------------------------------------------ prefill chunks
    def chunk(self, done: int, total: int) -> None:
        """``done`` of ``total`` prompt tokens are in the cache (called per prefill chunk, from 0)."""
        if not self.enabled or total <= 0:
            return
        if self.tty:
            from tqdm import tqdm

            if self._chunks is None or self._chunks.total != total or done < self._chunks.n:
                self._end_chunks()
                self._chunks = tqdm(total=total, file=self.stream, unit="tok", desc="prefill", leave=False,
                                    dynamic_ncols=True, position=1 if self._units is not None else 0)
            self._chunks.update(done - self._chunks.n)
            if done >= total:
                self._end_chunks()
        elif 0 < done and (done, total) != self._last_chunk:  # mlx_lm reports the last chunk twice
            self._line(f"    prefill {done}/{total} tokens ({time.perf_counter() - self.t0:.1f}s)")
        self._last_chunk = (done, total)

    def _end_chunks(self) -> None:
        if self._chunks is not None:
            self._chunks.close()
            self._chunks = None
