"""Saved caches on the command line: ``cache save``, ``cache info`` and ``generate --prompt-cache``. A missing,
corrupt or mismatched file exits 2 naming the file and the problem."""

from __future__ import annotations

import json
import os
from collections import Counter
from itertools import groupby

from .cache import SavedCacheError, load_cache, read_cache_info, save_cache
from .cache.saved import normalize_model_id
from .cache.settings import NONE, UsageError, check_method_name, method_config
from .cli_output import (GENERATION_KEYS, Progress, add_command, fmt_bytes, kv_rows, print_generation, print_rows,
                         short_prompt_note)
from .eval.specs import MethodSpec
from .generate import encode_turn, make_caches, run_generation
from .measure import kv_summary

__all__ = ["add_parsers", "cmd_cache_save", "cmd_cache_info", "generate_from_saved"]

_PLAIN_TEXT = "tokenized as plain text with tokenizer.encode: no chat template is applied"


def cmd_cache_save(args) -> int:
    method = args.method
    sets, config = method_config(method, args.set, standalone_ok=False)
    if not os.path.isfile(args.prompt_file):
        raise UsageError(f"--prompt-file {args.prompt_file!r}: no such file")
    with open(args.prompt_file, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise UsageError(f"--prompt-file {args.prompt_file!r} is empty: there is nothing to cache")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {args.out!r}: directory {out_dir} does not exist")
    from .eval.fidelity import prefill
    from .model import load_model
    progress = Progress(enabled=not args.json)
    progress.stage("loading model")
    model, tokenizer = load_model(args.model)
    caches = make_caches(model, method, config)
    tokens = [int(t) for t in tokenizer.encode(text)]
    progress.stage(f"prefill {len(tokens)} tokens")
    prefill(model, tokens, caches, on_chunk=progress.chunk)
    info = save_cache(args.out, caches, model_id=args.model, tokens=tokens, method=method)
    kv = kv_summary(model, caches)
    out = {"path": args.out, "method": method, "settings": sets, "model": info["model_id"],
           "tokens": len(tokens), "file_bytes": info["file_bytes"], **kv}
    if args.json:
        print(json.dumps(out))
        return 0
    measured, *reference = kv_rows(kv)
    print_rows([("saved", args.out), ("method", MethodSpec(method, sets).label), ("model", info["model_id"]),
                ("tokens", len(tokens)), measured,
                ("file_bytes", f"{info['file_bytes']} ({fmt_bytes(info['file_bytes'])})"), *reference])
    short_prompt_note([out])
    return 0


def cmd_cache_info(args) -> int:
    info = read_cache_info(args.path)
    if args.json:
        print(json.dumps(info))
        return 0
    kv, size = info["kv_bytes"], info["file_bytes"]
    classes = ", ".join(f"{n} x {c}" for c, n in Counter(info["layer_classes"]).items())
    shapes = ", ".join(f"{len(list(run))} x {'none' if s is None else s}" for s, run in groupby(info["head_shapes"]))
    preview = info["tokens"][:8]
    print_rows([
        ("file", info["path"]),
        ("format", f"{info['format']} v{info['format_version']} (veloxquant_mlx {info['library_version']})"),
        ("method", info["method"]), ("config", json.dumps(info["config"]) if info["config"] else "defaults"),
        ("model", info["model_id"]), ("layers", f"{info['n_layers']} ({classes})"),
        ("head shapes", shapes + "  [KV heads, key dim, value dim]"),
        ("tokens", f"{info['n_tokens']} (first: {preview}{' ...' if info['n_tokens'] > len(preview) else ''})"),
        ("kv_bytes", f"{kv} ({fmt_bytes(kv)}, sum of cache nbytes when saved)"),
        ("file_bytes", f"{size} ({fmt_bytes(size)})"),
    ], width=12)
    return 0


def generate_from_saved(args) -> int:
    """``generate --prompt-cache PATH``: load the saved cache (checked against ``--model`` and ``--method`` when
    given), append the prompt's tokens after the cached ones, generate."""
    if args.method is not None:
        check_method_name(args.method)
    if args.set:
        raise UsageError("--set does not apply with --prompt-cache: the saved cache keeps the configuration "
                         "it was made with")
    if not args.prompt:
        raise UsageError("--prompt must not be empty with --prompt-cache (its tokens follow the cached ones)")
    info = read_cache_info(args.prompt_cache)  # file problems before loading any model
    if args.method is not None and args.method != info["method"]:
        raise SavedCacheError(f"{args.prompt_cache}: method mismatch: the file holds a {info['method']!r} "
                              f"cache, --method is {args.method!r}")
    if args.model is not None and normalize_model_id(args.model) != info["model_id"]:
        raise SavedCacheError(f"{args.prompt_cache}: model mismatch: the cache was saved with model "
                              f"{info['model_id']!r}, --model is {args.model!r}")
    from .model import load_model
    progress = Progress(enabled=not args.json)
    progress.stage("loading model and saved cache")
    model, tokenizer = load_model(args.model if args.model is not None else info["model_id"])
    caches, info = load_cache(args.prompt_cache, model=model, expect_method=args.method,
                              expect_model_id=args.model)
    prompt_ids = ([int(t) for t in tokenizer.encode(args.prompt, add_special_tokens=False)] if args.raw_prompt
                  else encode_turn(tokenizer, args.prompt))
    if not prompt_ids:
        raise UsageError("--prompt encodes to no tokens")
    progress.stage(f"prefill {len(prompt_ids)} prompt tokens after the {info['n_tokens']} cached ones")
    result = run_generation(model, tokenizer, prompt_ids, caches, args.max_tokens, on_prefill=progress.chunk)
    out = {"method": info["method"], "settings": info["config"], "model": info["model_id"], "text": result["text"],
           **{k: result[k] for k in GENERATION_KEYS}, "prompt_cache": args.prompt_cache,
           "cached_tokens": info["n_tokens"], "tokens": result["tokens"], **kv_summary(model, caches)}
    return print_generation(out, [
        ("prompt cache", f"{args.prompt_cache} ({info['n_tokens']} cached tokens)"),
        ("method", MethodSpec(info["method"], info["config"]).label),
        ("prompt tokens", f"{out['prompt_tokens']} (after the cached ones)"),
    ], args.json)


def add_parsers(sub, g) -> None:
    """``cache save``/``cache info``, and ``--prompt-cache``/``--raw-prompt`` on the ``generate`` parser ``g``."""
    g.add_argument("--prompt-cache", default=None, metavar="PATH",
                   help="continue after a cache saved by `veloxquant cache save` (--method and --model default to "
                        "the file's); the prompt follows as a new user turn (no BOS, no default system message)")
    g.add_argument("--raw-prompt", action="store_true",
                   help=f"with --prompt-cache: append the prompt {_PLAIN_TEXT} (to continue the text itself)")
    c = sub.add_parser("cache", help="save a prefilled compressed cache to a file, or show a saved one")
    csub = c.add_subparsers(dest="cache_command", required=True, metavar="{save,info}")
    s = add_command(
        csub, "save", cmd_cache_save, help="prefill a text file into compressed caches and save them",
        description="Prefill the text of --prompt-file into caches made as `generate` makes them and save "
                    f"them to --out (a safetensors file). The text is {_PLAIN_TEXT}. Continue after it with "
                    "`veloxquant generate --prompt-cache PATH --prompt TEXT`.")
    s.add_argument("--method", required=True, help=f"a method name from `veloxquant methods`, or {NONE!r}")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE", default=[],
                   help="a setting of --method (repeatable), as for generate")
    s.add_argument("--prompt-file", required=True, metavar="F", help=f"UTF-8 text to prefill, {_PLAIN_TEXT}")
    s.add_argument("--out", required=True, metavar="PATH", help="the file to write (e.g. doc.safetensors)")
    i = add_command(csub, "info", cmd_cache_info, model=False, help="print the metadata of a saved cache (no model "
                    "is loaded)", json="print the metadata as one JSON object (with token ids)")
    i.add_argument("path", metavar="PATH", help="a file written by `veloxquant cache save`")
