"""Decode speed against context length from ``veloxquant bench --json`` files, one line per candidate: tokens/s
(left) and, where the candidates ran interleaved in one process, the per-repeat ratio to the plain cache (right).
Rows of several runs are pooled by (candidate, context): the median of their medians, bars from the lowest min to
the highest max. The rate is ``steady_tps`` (one over the median step: a long generation's rate) where every row
has it, else ``decode_tps`` (tokens over the decode's time, which the first step after the prompt dominates in
short runs).

    python scripts/plot_decode.py docs/data/h200_s29_2026-12-04/h200_bench_paired_*.json \
        --out docs/speed_decode_h200.png
"""

from __future__ import annotations

import argparse
import json
import statistics


def pooled(rows: list[dict]) -> dict:
    """Median of the medians, lowest min, highest max."""
    return {"median": statistics.median(d["median"] for d in rows), "min": min(d["min"] for d in rows),
            "max": max(d["max"] for d in rows)}


def collect(files: list[str], rate: str | None = None):
    """(rate field, {(label, context): pooled tok/s}, {(label, context): pooled paired ratio to plain})."""
    rows = [r for f in files for r in json.load(open(f)) if r.get("available", True) and r.get("decode_tps")]
    rate = rate or ("steady_tps" if all(r.get("steady_tps") for r in rows) else "decode_tps")
    tps, ratio = {}, {}
    for r in rows:
        key = (r["label"], r["context"])
        tps.setdefault(key, []).append(r[rate])
        paired = ((r.get("paired_ratios") or {}).get("none") or {}).get(rate)
        if paired and r["label"] != "none":
            ratio.setdefault(key, []).append(paired)
    return rate, {k: pooled(v) for k, v in tps.items()}, {k: pooled(v) for k, v in ratio.items()}


def draw(ax, rows: dict, name, colors: dict):
    for label in sorted({k[0] for k in rows}, key=lambda s: (s != "none", s)):
        pts = sorted((c, d) for (lab, c), d in rows.items() if lab == label)
        med = [d["median"] for _, d in pts]
        err = [[d["median"] - d["min"] for _, d in pts], [d["max"] - d["median"] for _, d in pts]]
        ax.errorbar([c for c, _ in pts], med, yerr=err, marker="o", capsize=3, label=name(label), color=colors[label])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rate", choices=("steady_tps", "decode_tps"), help="default: steady_tps where every row has it")
    ap.add_argument("--title", default="Decode speed, 8B-class Llama shape, NVIDIA H200 (MLX CUDA)")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate, tps, ratio = collect(a.files, a.rate)
    labels = sorted({k[0] for k in tps}, key=lambda s: (s != "none", s))
    colors = {lab: f"C{i}" for i, lab in enumerate(labels)}  # one colour per candidate in both panels
    fig, axes = plt.subplots(1, 2 if ratio else 1, figsize=(12 if ratio else 7, 4.5), dpi=100, squeeze=False)
    draw(axes[0][0], tps, lambda s: "plain cache (mlx_lm)" if s == "none" else s, colors)
    axes[0][0].set_ylabel(f"{rate} (median, min-max)")
    if ratio:
        draw(axes[0][1], ratio, str, colors)
        axes[0][1].axhline(1.0, color="grey", lw=1)
        axes[0][1].set_ylabel("ratio to the plain cache, per repeat (median, min-max)")
    fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out} ({rate})")


if __name__ == "__main__":
    main()
