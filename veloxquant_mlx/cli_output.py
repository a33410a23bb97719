"""Terminal output of the ``veloxquant`` commands: progress on stderr, plain tables, byte rows."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

__all__ = ["Progress", "format_table", "fmt_bytes", "fmt_tps", "truncate", "print_generation", "at_least", "numbers",
           "POSITIVE", "MODEL_HELP", "SHORT_PROMPT_NOTE", "GENERATION_KEYS"]

GENERATION_KEYS = ("prompt_tokens", "generated_tokens", "prefill_s", "decode_tps")
MODEL_HELP = ("an mlx_lm model directory, a Hugging Face repo id, or a llama-architecture .gguf file "
              "(default: the embedded SmolLM2-135M-Instruct)")
#: Why a compressed cache can hold more than fp16 on a short prompt (README, "Reading the byte figures").
SHORT_PROMPT_NOTE = (
    "note: above 1 means this cache holds more than mlx_lm's fp16 cache would for these few tokens: below a "
    "method's budget, window or residual length nothing is compressed yet, and the rows it keeps at 16 bits "
    "come with fixed per-layer parts (codebooks, rotations, scales, preallocated rows); the fraction falls "
    "once the prompt is longer than that.")


class Progress:
    """Stage lines (``[  3.1s] loading model``), a bar over ``total`` units (``progress(msg)`` starts the next)
    and the prefill's chunks (``chunk(done, of)``), so a long prefill is never silent: ``tqdm`` bars on a
    terminal, plain lines elsewhere, nothing when ``enabled=False`` (``--json``)."""

    def __init__(self, total: Optional[int] = None, enabled: bool = True, stream=None):
        self.enabled, self.stream = enabled, stream if stream is not None else sys.stderr
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self._chunks = self._last_chunk = None
        self._units = self._bar(total=total, unit="step", leave=True) if self.tty and total else None

    def _bar(self, **kw):
        from tqdm import tqdm
        return tqdm(file=self.stream, dynamic_ncols=True, **kw)

    def _line(self, text: str) -> None:
        if self.tty:
            from tqdm import tqdm
            tqdm.write(text, file=self.stream)
        elif self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def stage(self, msg: str) -> None:  # a step, with the time since the start
        self._line(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}")

    note = _line  # a line as given (warnings, skipped methods)

    def __call__(self, msg: str) -> None:  # the next unit of work starts
        self._end_chunks()
        self.done += 1
        if self._units is not None:
            if self.done > 1:
                self._units.update(1)
            self._units.set_description_str(msg[:60])
        else:
            self.stage(f"{min(self.done, self.total)}/{self.total} {msg}" if self.total else msg)

    def close(self, msg: Optional[str] = None) -> None:  # the last unit is finished
        self._end_chunks()
        if self._units is not None:
            self._units.update(self._units.total - self._units.n)
            self._units.close()
            self._units = None
        if msg:
            self.stage(msg)

    def chunk(self, done: int, total: int) -> None:
        """``done`` of ``total`` prompt tokens are in the cache (called per prefill chunk, from 0)."""
        if not self.enabled or total <= 0:
            return
        if self.tty:
            if self._chunks is None or self._chunks.total != total or done < self._chunks.n:
                self._end_chunks()
                self._chunks = self._bar(total=total, unit="tok", desc="prefill", leave=False,
                                         position=1 if self._units is not None else 0)
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


def add_command(sub, name: str, func, *, model: bool = True, json: Optional[str] = "print one JSON object", **kw):
    """A subcommand calling ``func(args)``, with ``--model`` and ``--json`` (help ``json``) unless turned off."""
    p = sub.add_parser(name, **kw)
    if model:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    if json:
        p.add_argument("--json", action="store_true", help=json)
    p.set_defaults(func=func)
    return p


def at_least(low, kind=int):
    """An argparse ``type``: a ``kind`` number >= ``low`` (else exit 2 naming the flag, the value and the bound)."""
    def parse(text: str):
        value = kind(text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its 'invalid int value' message
    return parse


POSITIVE = at_least(1)


def numbers(low, kind=int, high=None):
    """An argparse ``type``: comma-separated ``kind`` numbers in ``[low, high]``, as a list."""
    one = at_least(low, kind)

    def parse(text: str) -> list:
        values = [one(x) for x in text.split(",") if x.strip()]
        if not values or (high is not None and max(values) > high):
            raise argparse.ArgumentTypeError(f"expects comma-separated numbers in [{low}, {high}], got {text!r}")
        return values
    parse.__name__ = kind.__name__
    return parse


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def fmt_tps(tps: Optional[float]) -> str:
    return f"{tps:.1f}" if tps else "n/a"


def truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the headers (every table of the CLI)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows])


def print_rows(rows: list[tuple], width: int = 19) -> None:
    for label, value in rows:
        print(f"{label:>{width}}: {value}")


def kv_rows(kv: dict) -> list[tuple]:
    """The byte rows of ``measure.kv_summary``'s figures."""
    from .measure import fraction_text
    return [("kv_bytes", f"{kv['kv_bytes']} ({fmt_bytes(kv['kv_bytes'])}, measured: sum of cache nbytes)"),
            ("kv_bytes_fp16", f"{kv['kv_bytes_fp16']} ({fmt_bytes(kv['kv_bytes_fp16'])}, "
                              f"{kv['kv_tokens']} tokens in mlx_lm's plain cache at fp16)"),
            ("kv_fraction_of_fp16", f"{fraction_text(kv['kv_fraction_of_fp16'])} = kv_bytes / kv_bytes_fp16")]


def short_prompt_note(rows: list) -> None:
    if any((r["kv_fraction_of_fp16"] or 0) > 1 and r["method"] != "none" for r in rows):
        print(SHORT_PROMPT_NOTE)


def print_generation(out: dict, head: list, as_json: bool) -> int:
    """One JSON object, or the text then ``head`` rows and the byte rows."""
    if as_json:
        print(json.dumps(out))
        return 0
    print(out["text"], "-" * 40, sep="\n")
    print_rows(head + [("generated tokens", out["generated_tokens"]), ("decode tok/s", fmt_tps(out["decode_tps"]))]
               + kv_rows(out))
    short_prompt_note([out])
    return 0
