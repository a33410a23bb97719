"""``results.md`` and the Pareto plot of kv_fraction_of_fp16 against KLD (matplotlib, the optional extra
``veloxquant-mlx[plot]``; without it the outputs are written without the plot and one line names the extra)."""

from __future__ import annotations

from typing import Optional, Sequence

from ..measure import fraction_text

__all__ = ["pareto_front", "pareto_points", "plot_pareto", "results_markdown", "row_cells", "HEADERS",
           "PLOT_EXTRA_HINT", "DEFINITIONS"]

KLD_FLOOR = 1e-6  # KL divergences below this are drawn at it (log axis)
PLOT_EXTRA_HINT = "the Pareto plot needs matplotlib: pip install 'veloxquant-mlx[plot]'"
#: What the figures of ``veloxquant eval`` mean (results.md and the command's own output).
DEFINITIONS = (
    "ppl: perplexity of the scored real-text tokens after the context was prefilled through the cache (one decode "
    "step per token); Δppl = ppl − the uncompressed model's on the same tokens.",
    "KLD: mean KL(P_uncompressed ‖ P_compressed) of the next-token distributions over the same steps (nats); "
    "top-1: fraction of steps whose argmax agrees.",
    "NIAH: passcodes planted at several depths; the context is compressed without the question (query-agnostic, "
    "as kvpress), the question is fed afterwards; greedy answer, exact match.",
    "recall: fraction of a repeated passage's tokens copied greedily after compression.",
    "KV bytes: measured (sum of the caches' `nbytes`) after the run; fp16 KV bytes: the same tokens in mlx_lm's "
    "plain cache at fp16 without slack; kv_fraction_of_fp16 = KV bytes / fp16 KV bytes (lower = smaller; 0.25 is "
    "4.0x smaller). `none` (mlx_lm's KVCache) stores the compute dtype (float32 on the CPU) with 256-row slack, "
    "so its fraction is above 1.")


def pareto_points(rows: Sequence[dict]) -> list[dict]:
    """One point per method label: from its ``kld`` row (else its ``ppl`` row), if it has a KLD."""
    by_label = {r["label"]: {"label": r["label"], "method": r["method"],
                             "kv_fraction_of_fp16": float(r["kv_fraction_of_fp16"]), "kld": float(r["kld"])}
                for task in ("ppl", "kld") for r in rows  # kld overrides ppl
                if r.get("task") == task and r.get("kld") is not None and r.get("kv_fraction_of_fp16")}
    return list(by_label.values())


def pareto_front(points: Sequence[dict]) -> list[dict]:
    """The points no other point beats on both axes (smaller kv_fraction_of_fp16, lower KLD), smallest first."""
    f = "kv_fraction_of_fp16"
    front = [p for p in points if not any(q is not p and q[f] <= p[f] and q["kld"] <= p["kld"]
                                          and (q[f] < p[f] or q["kld"] < p["kld"]) for q in points)]
    return sorted(front, key=lambda p: p[f])


def plot_pareto(rows: Sequence[dict], path, title: str = "KV cache methods: KV bytes vs KLD") -> bool:
    """Write the Pareto plot PNG; False when no row has a KLD; ``ImportError`` (:data:`PLOT_EXTRA_HINT`) without
    matplotlib."""
    points = pareto_points(rows)
    if not points:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(PLOT_EXTRA_HINT) from exc
    front = pareto_front(points)
    on_front = {p["label"] for p in front}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
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


def _f(v, fmt=None):  # fmt None: a kv_fraction_of_fp16 with its words
    return "–" if v is None else fraction_text(v) if fmt is None else format(v, fmt)


HEADERS = ("method", "settings", "task", "context", "ppl", "Δppl", "KLD (nats)", "top-1", "NIAH/recall", "KV bytes",
           "fp16 KV bytes", "kv_fraction_of_fp16")


def row_cells(r: dict) -> list[str]:
    """A row's cells under :data:`HEADERS` (results.md and the ``eval`` table); an error row: its message."""
    head = [r["method"], ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "defaults", r["task"],
            str(r["context"])]
    if r.get("error"):
        return head + ["error: " + r["error"][:80]] + [""] * 7
    hits = None if r.get("niah_acc") is None else f"{r['niah_hits']}/{r['niah_trials']}"
    hits = hits if r.get("copy_acc") is None else f"copy {r['copy_acc']:.3f}"
    kld = None if r["kld"] is None else max(r["kld"], 0.0)  # float noise can make the none row -1e-8
    return head + [_f(r["ppl"], ".3f"), _f(r["ppl_delta"], "+.3f"), _f(kld, ".4g"), _f(r["top1_agree"], ".3f"),
                   hits or "–", _f(r["kv_bytes"], "d"), _f(r["kv_bytes_fp16"], "d"), _f(r["kv_fraction_of_fp16"])]


def results_markdown(rows: Sequence[dict], meta: dict, plot_file: Optional[str] = None) -> str:
    """The ``results.md`` text: settings, a table of every row, the Pareto front, definitions."""
    lines = ["# VeloxQuant-MLX quality results", "", *(f"- **{k}**: {v}" for k, v in meta.items()), "",
             "| " + " | ".join(HEADERS) + " |", "|---|---|---|" + "---:|" * 9]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    points = pareto_points(rows)
    if points:
        front = pareto_front(points)
        lines += ["", "## Pareto front (kv_fraction_of_fp16 vs KLD)", "",
                  "Not beaten on both axes by another method: " + ", ".join(
                      f"{p['label']} ({_f(p['kv_fraction_of_fp16'])}, KLD {p['kld']:.4g})" for p in front) + "."]
        if plot_file:
            lines += ["", f"![kv_fraction_of_fp16 vs KLD]({plot_file})"]
    return "\n".join(lines + ["", "## Definitions", "", *(f"- {d}" for d in DEFINITIONS)]) + "\n"
