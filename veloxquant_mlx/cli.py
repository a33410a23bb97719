"""The ``veloxquant`` command line: ``methods``, ``generate`` and ``demo`` here, the other subcommands in the other
``cli_*`` modules (the top layer: no library module imports them). ``main(argv)`` returns the exit code (0 ok, 2 bad
usage or configuration, 1 runtime failure, 141 when stdout's reader went away)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from typing import Any, Optional, Sequence

# transformers (mlx_lm's tokenizer wrapper) warns that PyTorch is missing: never needed here
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from . import __version__, cli_cache, cli_measure, cli_serve
from .cache import QuantizerConfigError, SavedCacheError, all_methods, method_info
from .cache.base import STANDALONE_METHODS
from .cache.options import OPTIONS_BY_METHOD
from .cache.settings import NONE, UsageError, build_config, method_config, method_settings, parse_set, parse_sets
from .cache.settings import check_method_name as _check_method_name
from .cli_output import (GENERATION_KEYS, POSITIVE, Progress, add_command, at_least, fmt_bytes, fmt_tps, format_table,
                         print_generation, short_prompt_note, truncate)
from .eval.specs import MethodSpec
from .generate import encode_prompt, encode_turn, make_caches, run_generation  # noqa: F401
from .measure import fraction_text, kv_summary

__all__ = ["main", "parse_set", "parse_sets", "build_config", "method_config", "encode_prompt", "encode_turn",
           "run_generation", "DEMO_METHODS", "NONE", "UsageError"]

DEMO_METHODS = ("kivi", "snapkv", "streaming_llm", "turboquant_rvq")
DEMO_PRESETS: dict[str, dict[str, Any]] = {"kivi": {"bit_width_inlier": 4}}


def _cmd_methods(args) -> int:
    if args.name is not None:
        return _cmd_method_settings(args)
    rows = [{k: getattr(i, k) for k in ("name", "family", "protocol", "implemented", "paper")} for i in all_methods()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(format_table(["method", "family", "protocol", "implemented", "paper"],
                       [[*{**r, "implemented": "yes" if r["implemented"] else "no"}.values()] for r in rows]))
    print(f"\n{sum(r['implemented'] for r in rows)} of {len(rows)} methods implemented. "
          "`veloxquant methods NAME` lists a method's settings.")
    return 0


def _cmd_method_settings(args) -> int:
    _check_method_name(args.name)
    if args.name == NONE:
        raise UsageError(f"{NONE!r} (mlx_lm's plain KVCache) has no settings")
    info = method_info(args.name)
    rows = method_settings(args.name)
    if args.json:
        print(json.dumps({"method": info.name, "family": info.family, "protocol": info.protocol,
                          "paper": info.paper, "settings": rows}, indent=2, default=repr))
        return 0
    print(f"{info.name}: {info.family}, {info.protocol} protocol; {info.paper}")
    table = [[r["name"], r["flat"] if r["flat"] != r["name"] else "", r["type"], repr(r["default"]),
              r["allowed"]] for r in rows]
    print(format_table(["setting", "flat alias", "type", "default", "allowed"], table))
    example = next((r for r in rows if r["default"] is not None), None)
    print("\nSet with --set NAME=VALUE (the setting or its flat alias)"
          + (f", e.g. --set {example['name']}={json.dumps(example['default'], default=str)}." if example else "."))
    return 0


def _cmd_generate(args) -> int:
    if args.raw_prompt and args.prompt_cache is None:
        raise UsageError("--raw-prompt applies only with --prompt-cache")
    if args.prompt_cache is not None:
        return cli_cache.generate_from_saved(args)
    method = args.method
    if method is None:
        raise UsageError("the following argument is required: --method (it may be left out only with "
                         "--prompt-cache, whose file records it)")
    sets, config = method_config(method, args.set)
    from .distributed import init_group, shard_model
    from .model import load_model
    group = init_group()  # size 1 unless started by ``mlx.launch``
    rank0 = group.rank() == 0
    progress = Progress(enabled=not args.json and rank0)
    progress.stage("loading model")
    model, tokenizer = load_model(args.model)
    if group.size() > 1:  # each rank: its share of the heads, and the compressed cache of its own KV heads
        shard_model(model, group)
    caches = make_caches(model, method, config)
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    progress.stage(f"prefill {len(prompt_ids)} prompt tokens, then up to {args.max_tokens} new tokens")
    result = run_generation(model, tokenizer, prompt_ids, caches, args.max_tokens, on_prefill=progress.chunk)
    out = {"method": method, "settings": sets, "model": args.model or "smollm2-135m", "text": result["text"],
           **{k: result[k] for k in GENERATION_KEYS}, **kv_summary(model, caches)}
    head = [("method", MethodSpec(method, sets).label), ("prompt tokens", out["prompt_tokens"])]
    if group.size() > 1:
        out["ranks"] = group.size()  # the byte figures are rank 0's: its own KV heads
        head.append(("ranks", f"{group.size()} (mx.distributed; kv bytes below are rank 0's share)"))
    if not rank0:
        return 0  # every rank generates the same tokens; rank 0 alone prints them
    return print_generation(out, head, args.json)


ANSWER = "4817"  # the demo's passcode, planted at half depth


def _demo_settings(method: str, config) -> str:
    if config is None:
        return "uncompressed"
    fields = getattr(OPTIONS_BY_METHOD.get(method), "FIELDS", {})
    shown = {**DEMO_PRESETS.get(method, {}), **{opt: getattr(config, flat) for opt, flat in fields.items() if opt
                                                 in ("budget", "window_size", "n_sink", "bits", "residual_length")}}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults"


def _cmd_demo(args) -> int:
    wanted = [m.strip() for m in (args.methods.split(",") if args.methods else DEMO_METHODS) if m.strip()]
    for m in wanted:
        _check_method_name(m)
    progress = Progress(enabled=not args.json)
    runs: list[tuple[str, Any]] = [(NONE, None)]
    skipped: list[str] = []
    for m in [m for m in dict.fromkeys(wanted) if m != NONE]:
        if not method_info(m).implemented:
            skipped.append(f"{m}: not implemented yet")
        elif m in STANDALONE_METHODS:
            skipped.append(f"{m}: standalone protocol (no mlx_lm serving contract)")
        else:
            runs.append((m, build_config(m, DEMO_PRESETS.get(m, {}))))
    for note in skipped:
        progress.note(f"note: skipping {note}")
    from .eval.tasks import build_niah_prompt
    from .model import load_model
    progress.stage("loading model (first use downloads it)")
    model, tokenizer = load_model(args.model)
    progress.stage("building the needle prompt (first use downloads the essays)")
    try:
        niah = build_niah_prompt(tokenizer, args.context, 0.5, passcode=ANSWER)
    except ValueError as exc:
        raise UsageError(f"--context {args.context}: {exc}") from None
    prompt_ids = niah.context_ids + niah.question_ids
    rows, reference = [], None
    for i, (method, config) in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] {method}"
        progress.stage(f"{tag}: prefill {len(prompt_ids)} tokens, then up to {args.max_tokens} new tokens")
        caches = make_caches(model, method, config)
        result = run_generation(model, tokenizer, prompt_ids, caches, args.max_tokens, on_prefill=progress.chunk)
        reference = result["tokens"] if reference is None else reference
        kv, text, n = kv_summary(model, caches), result["text"], max(len(reference), len(result["tokens"]))
        del caches
        rows.append({"method": method, "settings": _demo_settings(method, config), "answer": text.strip(),
                     "correct": ANSWER in re.sub(r"[\s,.'\"]", "", text), **{k: result[k] for k in GENERATION_KEYS},
                     "agreement": sum(a == b for a, b in zip(reference, result["tokens"])) / n if n else 1.0, **kv})
        progress.stage(f"{tag}: done ({result['prefill_s']:.1f}s prefill, {result['generated_tokens']} tokens)")
    if args.json:
        print(json.dumps({"prompt_tokens": len(prompt_ids), "answer": ANSWER, "skipped": skipped, "rows": rows}))
        return 0
    print(f"Needle in a haystack: {len(prompt_ids)} prompt tokens of Paul Graham essays, passcode sentence at "
          f"50% depth, expected answer {ANSWER}; model {args.model or 'SmolLM2-135M-Instruct (embedded)'}, "
          f"greedy, <= {args.max_tokens} new tokens.")
    table = [[r["method"], r["settings"], truncate(r["answer"], 50), "yes" if r["correct"] else "no",
              fmt_bytes(r["kv_bytes"]), fraction_text(r["kv_fraction_of_fp16"]),
              fmt_tps(r["decode_tps"]), f"{r['agreement']:.2f}"] for r in rows]
    print(format_table(["method", "settings", "answer", "correct", "KV bytes", "kv_fraction_of_fp16",
                         "decode tok/s", "agreement"], table))
    print(f"KV bytes: measured (sum of the caches' nbytes) after the run; kv_fraction_of_fp16 = KV bytes / the "
          f"same {rows[0]['kv_tokens']} tokens in mlx_lm's plain cache at fp16 without slack (lower = smaller).")
    print("The uncompressed run ('none') stores the model's compute dtype (float32 on the MLX CPU backend) "
          "and counts mlx_lm's 256-row allocation steps, so its fraction is above 1.")
    print("agreement = fraction of generated tokens identical to the uncompressed run, position by position.")
    short_prompt_note(rows)
    for note in skipped:
        print(f"skipped {note}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="veloxquant", description="Compressed KV caches for mlx_lm.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{methods,generate,demo,eval,bench,cache,serve}")
    m = add_command(sub, "methods", _cmd_methods, model=False, json="print JSON (a list of methods, or one method's "
                    "settings)", help="list the 44 methods (the spec's 43 + waterfill), or one method's settings")
    m.add_argument("name", nargs="?", default=None,
                   help="a method name: list its --set settings (type, default, allowed values, flat alias)")
    g = add_command(sub, "generate", _cmd_generate, help="generate with a compressed KV cache and report its bytes")
    g.add_argument("--method", default=None,
                   help=f"a method name from `veloxquant methods`, or {NONE!r} (required unless --prompt-cache)")
    g.add_argument("--set", action="append", metavar="FIELD=VALUE", default=[],
                   help="a setting of --method (repeatable): option name (budget=256) or flat field (snap_budget=256) "
                        "as `veloxquant methods NAME` lists them; VALUE is parsed as JSON when possible")
    g.add_argument("--prompt", required=True, help="the user message (in the model's chat template, if any)")
    g.add_argument("--max-tokens", type=POSITIVE, default=64,
                   help="most new tokens to generate, greedily (default 64)")
    d = add_command(sub, "demo", _cmd_demo, json="print the results as one JSON object",
                    help="needle-in-a-haystack answers: uncompressed vs compressed caches")
    d.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: {','.join(DEMO_METHODS)}; unimplemented ones are skipped)")
    d.add_argument("--context", type=at_least(64), default=2000,
                   help="approximate prompt length in tokens (default 2000)")
    d.add_argument("--max-tokens", type=POSITIVE, default=24, help="new tokens at most (24)")
    cli_measure.add_subcommands(sub)
    cli_cache.add_parsers(sub, g)
    cli_serve.add_subcommand(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    from .model import UnsupportedModelError
    try:
        args = _parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for the outputs that record it
    except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that went away is reported here, not at exit
        return code
    except BrokenPipeError:  # `veloxquant methods --json | head`: the reader has all it wanted
        with contextlib.suppress(OSError, ValueError):  # stdout to /dev/null: the final flush must not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a program stopped by a closed pipe
    except (UsageError, QuantizerConfigError, SavedCacheError, UnsupportedModelError, NotImplementedError) as exc:
        kind = "invalid configuration: " if isinstance(exc, QuantizerConfigError) else ""
        print(f"error: {kind}{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
