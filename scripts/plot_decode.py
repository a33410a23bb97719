"""Decode tokens/s against context length, one line per candidate, from ``veloxquant bench --json`` files: rows of
several runs pooled by (candidate, context) -- the median of their medians, bars from the lowest min to the highest max.

    python scripts/plot_decode.py docs/data/h200_decode_s8_2026-12-02/h200_bench_*.json --out docs/speed_decode_h200.png
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Decode speed, 8B-class Llama shape, NVIDIA H200 (MLX CUDA)")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for f in a.files:
        for r in json.load(open(f)):
            if r.get("available", True) and r.get("decode_tps"):
                runs.setdefault((r["label"], r["context"]), []).append(r["decode_tps"])
    rows = {k: {"median": statistics.median(d["median"] for d in v), "min": min(d["min"] for d in v),
                "max": max(d["max"] for d in v)} for k, v in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for label in sorted({k[0] for k in rows}, key=lambda s: (s != "none", s)):
        pts = sorted((c, d) for (lab, c), d in rows.items() if lab == label)
        xs = [c for c, _ in pts]
        med = [d["median"] for _, d in pts]
        err = [[d["median"] - d["min"] for _, d in pts], [d["max"] - d["median"] for _, d in pts]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="plain cache (mlx_lm)" if label == "none" else label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_title(a.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
