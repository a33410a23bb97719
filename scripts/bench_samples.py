"""Print a ``veloxquant bench --json`` file's rows: ratios vs the plain cache, each repeat's values in run order and
(candidates interleaved in one process) the per-repeat ratios.

    python scripts/bench_samples.py bench.json [more.json ...]
"""
import json
import sys


def main(paths):
    for path in paths:
        print(path)
        for r in json.load(open(path)):
            ratios = {k: round(v, 3) for k, v in (r.get("ratios", {}).get("none") or {}).items()}
            s = r.get("samples") or {}
            pre = [round(v, 3) for v in s.get("prefill_s", [])]
            dec = [round(v, 1) for v in s.get("decode_tps", []) if v]
            steady = [round(v, 1) for v in s.get("steady_tps", []) if v]
            peak = [round(v / 2**30, 2) for v in s.get("peak_delta_bytes", [])]
            print(f"  {r['label']:<45} {r['context']:>6}  prefill_s {pre}  decode_tps {dec}  steady_tps {steady}  "
                  f"peak_GB {peak}")
            if ratios:
                print(f"  {'':<45} {'':>6}  ratios {ratios}")
            paired = (r.get("paired_ratios") or {}).get("none") or {}
            if paired and r.get("repeats", 0) > 1:
                print(f"  {'':<45} {'':>6}  per repeat " + "  ".join(
                    f"{k} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]" for k, v in paired.items() if v))


if __name__ == "__main__":
    main(sys.argv[1:])
