"""The KV-bytes-vs-KLD Pareto plot (kv_fraction_of_fp16 against KLD), and ``results.md``.

:func:`plot_pareto` draws with matplotlib when it is importable, else with a small built-in
rasterizer (:class:`Canvas`: points, lines, a 3x5 pixel font) and PNG writer (:func:`write_png`, zlib),
so the plot needs no extra dependency.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["pareto_front", "pareto_points", "plot_pareto", "write_png", "Canvas", "results_markdown"]

KLD_FLOOR = 1e-6  # KL divergences below this are drawn at it (log axis)


# --------------------------------------------------------------------------- #
# data
# --------------------------------------------------------------------------- #


def pareto_points(rows: Sequence[dict]) -> list[dict]:
    """One point per method label: from its ``kld`` row (else its ``ppl`` row), if it has a KLD."""
    by_label: dict[str, dict] = {}
    for task in ("ppl", "kld"):  # kld overrides ppl
        for r in rows:
            if r.get("task") == task and r.get("kld") is not None and r.get("kv_fraction_of_fp16"):
                by_label[r["label"]] = {"label": r["label"], "method": r["method"],
                                        "kv_fraction_of_fp16": float(r["kv_fraction_of_fp16"]),
                                        "kld": float(r["kld"])}
    return list(by_label.values())


def pareto_front(points: Sequence[dict]) -> list[dict]:
    """The points no other point beats on both axes (smaller kv_fraction_of_fp16, lower KLD), smallest first."""
    f = "kv_fraction_of_fp16"
    front = []
    for p in points:
        dominated = any(q is not p and q[f] <= p[f] and q["kld"] <= p["kld"] and (q[f] < p[f] or q["kld"] < p["kld"])
                        for q in points)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p[f])


# --------------------------------------------------------------------------- #
# a minimal raster canvas and PNG writer
# --------------------------------------------------------------------------- #

# 3x5 glyphs, rows top to bottom, 3 bits each (MSB = left column).
_FONT = {
    "0": "7,5,5,5,7", "1": "2,6,2,2,7", "2": "7,1,7,4,7", "3": "7,1,3,1,7", "4": "5,5,7,1,1",
    "5": "7,4,7,1,7", "6": "7,4,7,5,7", "7": "7,1,1,2,2", "8": "7,5,7,5,7", "9": "7,5,7,1,7",
    "A": "2,5,7,5,5", "B": "6,5,6,5,6", "C": "3,4,4,4,3", "D": "6,5,5,5,6", "E": "7,4,6,4,7",
    "F": "7,4,6,4,4", "G": "3,4,5,5,3", "H": "5,5,7,5,5", "I": "7,2,2,2,7", "J": "1,1,1,5,2",
    "K": "5,5,6,5,5", "L": "4,4,4,4,7", "M": "5,7,7,5,5", "N": "6,5,5,5,5", "O": "2,5,5,5,2",
    "P": "6,5,6,4,4", "Q": "2,5,5,6,3", "R": "6,5,6,5,5", "S": "3,4,2,1,6", "T": "7,2,2,2,2",
    "U": "5,5,5,5,7", "V": "5,5,5,5,2", "W": "5,5,7,7,5", "X": "5,5,2,5,5", "Y": "5,5,2,2,2",
    "Z": "7,1,2,4,7", ".": "0,0,0,0,2", "-": "0,0,7,0,0", "_": "0,0,0,0,7", "=": "0,7,0,7,0",
    "(": "1,2,2,2,1", ")": "4,2,2,2,4", ",": "0,0,0,2,4", ":": "0,2,0,2,0", "/": "1,1,2,4,4",
    "+": "0,2,7,2,0", "^": "2,5,0,0,0", " ": "0,0,0,0,0",
}


class Canvas:
    """An RGB raster (white background) with pixels, lines, discs and 3x5-font text."""

    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, rgb: tuple) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, dash: int = 0) -> None:
        n = max(abs(int(x1) - int(x0)), abs(int(y1) - int(y0)), 1)
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            self.set(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), rgb)

    def disc(self, cx, cy, r: int, rgb) -> None:
        for dy in range(-r, r + 1):
            for dx in range(-r, r + 1):
                if dx * dx + dy * dy <= r * r + r:
                    self.set(int(cx) + dx, int(cy) + dy, rgb)

    def text(self, x: int, y: int, s: str, rgb=(0, 0, 0), scale: int = 2) -> None:
        for k, ch in enumerate(s.upper()):
            rows = _FONT.get(ch, _FONT["-"]).split(",")
            for r, bits in enumerate(rows):
                for c in range(3):
                    if int(bits) >> (2 - c) & 1:
                        for sy in range(scale):
                            for sx in range(scale):
                                self.set(x + (k * 4 + c) * scale + sx, y + r * scale + sy, rgb)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return len(s) * 4 * scale

    def save(self, path) -> None:
        write_png(path, self.w, self.h, bytes(self.px))


def write_png(path, width: int, height: int, rgb: bytes) -> None:
    """Write 8-bit RGB pixels (row-major, ``width*height*3`` bytes) as a PNG file."""
    if len(rgb) != width * height * 3:
        raise ValueError("pixel buffer size does not match width*height*3")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


# --------------------------------------------------------------------------- #
# the plot
# --------------------------------------------------------------------------- #


def _log_range(values: Sequence[float]) -> tuple[int, int]:
    lo = math.floor(math.log10(max(min(values), KLD_FLOOR)))
    hi = math.ceil(math.log10(max(max(values), KLD_FLOOR)))
    return lo, max(hi, lo + 1)


def _plot_matplotlib(points, front, path, title) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    on_front = {p["label"] for p in front}
    for p in points:
        y = max(p["kld"], KLD_FLOOR)
        ax.scatter(p["kv_fraction_of_fp16"], y, color="tab:red" if p["label"] in on_front else "tab:blue", zorder=3)
        ax.annotate(p["label"], (p["kv_fraction_of_fp16"], y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if len(front) > 1:
        ax.plot([p["kv_fraction_of_fp16"] for p in front], [max(p["kld"], KLD_FLOOR) for p in front], "r--", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("kv_fraction_of_fp16 (KV bytes / fp16 KV bytes, lower = smaller cache)")
    ax.set_ylabel("mean next-token KL divergence (nats, lower = better)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_builtin(points, front, path, title) -> None:
    W, H, L, R, T, B = 760, 480, 70, 30, 56, 50
    cv = Canvas(W, H)
    grey, black, blue, red = (200, 200, 200), (0, 0, 0), (31, 119, 180), (214, 39, 40)
    xmax = max(p["kv_fraction_of_fp16"] for p in points) * 1.15 or 1.0
    lo, hi = _log_range([p["kld"] for p in points])

    def X(c):
        return L + (W - L - R) * c / xmax

    def Y(k):
        return T + (H - T - B) * (hi - math.log10(max(k, KLD_FLOOR))) / (hi - lo)

    for e in range(lo, hi + 1):  # horizontal grid at each decade
        y = Y(10.0 ** e)
        cv.line(L, y, W - R, y, grey, dash=3)
        label = f"1E{e}"
        cv.text(L - 6 - Canvas.text_width(label), int(y) - 5, label)
    step = 10 ** math.floor(math.log10(xmax / 2)) if xmax > 0 else 1
    if xmax / step > 8:
        step *= 2
    x = 0.0
    while x <= xmax:
        cv.line(X(x), T, X(x), H - B, grey, dash=3)
        label = f"{x:g}"
        cv.text(int(X(x)) - Canvas.text_width(label) // 2, H - B + 8, label)
        x += step
    cv.line(L, T, L, H - B, black)
    cv.line(L, H - B, W - R, H - B, black)
    cv.text(L, 10, title[:80])
    cv.text(L + 120, H - 20, "KV BYTES / FP16 BYTES (LOWER = SMALLER)")
    cv.text(6, T - 22, "KLD (NATS, LOG SCALE)")
    for a, b in zip(front, front[1:]):
        cv.line(X(a["kv_fraction_of_fp16"]), Y(a["kld"]), X(b["kv_fraction_of_fp16"]), Y(b["kld"]), red, dash=4)
    on_front = {p["label"] for p in front}
    for p in points:
        px, py = X(p["kv_fraction_of_fp16"]), Y(p["kld"])
        cv.disc(px, py, 4, red if p["label"] in on_front else blue)
        label = p["label"][:40]
        tx = int(px) + 7
        if tx + Canvas.text_width(label) > W - 2:  # keep labels inside the image
            tx = max(2, int(px) - 7 - Canvas.text_width(label))
        cv.text(tx, int(py) - 12, label)
    cv.save(path)


def plot_pareto(rows: Sequence[dict], path, title: str = "KV cache methods: KV bytes vs KLD",
                prefer_matplotlib: bool = True) -> Optional[str]:
    """Write the Pareto plot PNG; returns the backend used ("matplotlib"/"builtin"), None if no KLD rows."""
    points = pareto_points(rows)
    if not points:
        return None
    front = pareto_front(points)
    if prefer_matplotlib and _plot_matplotlib(points, front, path, title):
        return "matplotlib"
    _plot_builtin(points, front, path, title)
    return "builtin"


# --------------------------------------------------------------------------- #
# results.md
# --------------------------------------------------------------------------- #


def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def _fraction(v) -> str:
    from ..measure import fraction_text

    return "–" if v is None else fraction_text(v)


def results_markdown(rows: Sequence[dict], meta: dict, plot_file: Optional[str] = None) -> str:
    """The ``results.md`` text: settings, a table of every row, the Pareto front, definitions."""
    lines = ["# VeloxQuant-MLX quality results", ""]
    for k, v in meta.items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "| method | settings | task | context | ppl | Δppl | KLD (nats) | top-1 | NIAH | KV bytes | "
                  "fp16 KV bytes | kv_fraction_of_fp16 |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "defaults"
        if r.get("error"):
            lines.append(f"| {r['method']} | {settings} | {r['task']} | {r['context']} | error: "
                         f"{r['error'][:80]} | | | | | | | |")
            continue
        niah = None if r.get("niah_acc") is None else f"{r['niah_hits']}/{r['niah_trials']}"
        lines.append(
            f"| {r['method']} | {settings} | {r['task']} | {r['context']} | {_f(r['ppl'], '.3f')} | "
            f"{_f(r['ppl_delta'], '+.3f')} | {_f(r['kld'], '.4g')} | {_f(r['top1_agree'], '.3f')} | "
            f"{niah or '–'} | {_f(r['kv_bytes'], 'd')} | {_f(r['kv_bytes_fp16'], 'd')} | "
            f"{_fraction(r['kv_fraction_of_fp16'])} |")
    points = pareto_points(rows)
    if points:
        front = pareto_front(points)
        lines += ["", "## Pareto front (kv_fraction_of_fp16 vs KLD)", "",
                  "Not beaten on both axes by another method: " + ", ".join(
                      f"{p['label']} ({_fraction(p['kv_fraction_of_fp16'])}, KLD {p['kld']:.4g})" for p in front) + "."]
        if plot_file:
            lines += ["", f"![kv_fraction_of_fp16 vs KLD]({plot_file})"]
    lines += ["", "## Definitions", "",
              "- ppl: perplexity of the scored real-text tokens after the context was prefilled through the "
              "cache (one decode step per token); Δppl = ppl − the uncompressed model's on the same tokens.",
              "- KLD: mean KL(P_uncompressed ‖ P_compressed) of the next-token distributions over the same "
              "steps (nats); top-1: fraction of steps whose argmax agrees.",
              "- NIAH: passcodes planted at several depths; the context is compressed without the question "
              "(query-agnostic, as kvpress), the question is fed afterwards; greedy answer, exact match.",
              "- KV bytes: measured (sum of the caches' `nbytes`) after the run; fp16 KV bytes: the same tokens "
              "in mlx_lm's plain cache at fp16 without slack; kv_fraction_of_fp16 = KV bytes / fp16 KV bytes "
              "(lower = smaller; 0.25 is 4.0x smaller). `none` (mlx_lm's KVCache) stores the compute dtype "
              "(float32 on the CPU) with 256-row slack, so its fraction is above 1."]
    return "\n".join(lines) + "\n"
