"""The ``veloxquant`` command line (also ``python -m veloxquant_mlx``).

Subcommands:

* ``veloxquant methods [NAME] [--json]`` — the method registry: name, family, protocol, implemented, paper;
  with NAME, that method's settings (type, default, allowed values, flat alias).
* ``veloxquant generate --method M [--set FIELD=VALUE ...] [--model PATH] --prompt TEXT
  [--max-tokens N] [--json]`` — one generation with a compressed cache (``--method none``: mlx_lm's
  plain ``KVCache``), with the measured KV bytes next to the fp16 reference.
* ``veloxquant generate --prompt-cache PATH --prompt TEXT [--method M] [--model PATH]`` — continue after a
  cache saved by ``veloxquant cache save`` (:mod:`.cli_cache`, which also has ``cache info``).
* ``veloxquant demo [--methods a,b,...] [--context N] [--model PATH]`` — a needle-in-a-haystack
  question over ~N tokens of real text, answered with the uncompressed cache and with each
  implemented method side by side.

``--set`` takes a method's option names (``budget``) or flat ``KVCacheConfig`` fields (``snap_budget``) and
refuses a field the method does not read (:func:`parse_sets`). Byte figures use one convention,
``kv_fraction_of_fp16`` = held / fp16 bytes (:mod:`.measure`). ``eval`` and ``bench`` live in
:mod:`.cli_measure`, ``cache`` in :mod:`.cli_cache`, progress in :mod:`.cli_progress`.

``main(argv)`` returns the exit code (0 ok, 2 bad usage or configuration, 1 runtime failure, 141 when
stdout's reader went away), so it can be called in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence

from . import _blas

_blas.preload()  # before mlx.core is first imported (no-op if already done or too late)

# transformers (imported by mlx_lm for its tokenizer wrapper) warns that PyTorch is missing; we never
# need torch, so keep its logger quiet unless the user asked for something else.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__all__ = ["main", "parse_set", "parse_sets", "build_config", "encode_prompt", "encode_turn", "run_generation",
           "build_needle_prompt", "DEMO_METHODS", "NONE"]

#: ``--model`` help, shared by the subcommands.
MODEL_HELP = ("an mlx_lm model directory, a Hugging Face repo id, or a llama-architecture .gguf file "
              "(default: the embedded SmolLM2-135M-Instruct)")

#: ``--method none``: mlx_lm's own uncompressed ``KVCache``.
NONE = "none"

#: The demo's default methods, and their settings beyond the config defaults.
DEMO_METHODS = ("kivi", "snapkv", "streaming_llm", "turboquant_rvq")
DEMO_PRESETS: dict[str, dict[str, Any]] = {"kivi": {"bit_width_inlier": 4}}
DEMO_MAX_TOKENS = 24

#: Fields that cannot come from the command line (objects, not values) or come from elsewhere.
_NOT_SETTABLE = {"method": "use --method", "options": "set the flat fields instead",
                 "store": "an ArtifactStore object", "observers": "observer objects",
                 **{f: "an array: pass it through the Python API" for f in (
                     "smooth_factors", "key_codebook", "value_codebook", "a2ats_query_h", "a2ats_codebook")}}


class UsageError(Exception):
    """A bad command line: reported as ``error: ...`` with exit code 2."""


# --------------------------------------------------------------------------- #
# --set parsing and configuration
# --------------------------------------------------------------------------- #


def parse_set(item: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` -> ``(FIELD, value)``; VALUE is JSON when it parses (ints, floats, bools, lists,
    null), ``true``/``false``/``none`` in any case, else the string itself."""
    field, sep, raw = item.partition("=")
    field = field.strip()
    if not sep or not field:
        raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
    text = raw.strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return field, lowered == "true"
    if lowered in ("none", "null"):
        return field, None
    try:
        return field, json.loads(text)
    except ValueError:
        return field, raw


def parse_sets(items: Optional[Sequence[str]], method: Optional[str] = None) -> dict[str, Any]:
    """Parse every ``--set`` item into ``{flat KVCacheConfig field: value}``.

    Unknown or unsettable fields are a ``UsageError``. With ``method``, a field is also accepted under its
    options name (``budget`` for ``snapkv``'s ``snap_budget``) and refused, naming the method and listing
    its settings, when ``method`` does not read it (``cache.options.method_fields``).
    """
    from .cache import KVCacheConfig
    from .cache.options import DERIVED_FIELDS, method_fields

    known = {f.name for f in dataclasses.fields(KVCacheConfig)}
    accepted = method_fields(method) if method is not None and method != NONE else None
    out: dict[str, Any] = {}
    for item in items or ():
        field, value = parse_set(item)
        if field in _NOT_SETTABLE:
            raise UsageError(f"field {field!r} cannot be set with --set: {_NOT_SETTABLE[field]}")
        if field in DERIVED_FIELDS:
            raise UsageError(f"field {field!r} cannot be set with --set: the library derives it per layer")
        if accepted is not None:
            if field not in accepted:
                raise UsageError(f"method {method!r} has no setting {field!r}{_owner_hint(field)}: it does not "
                                 f"read it; its settings: {settings_summary(method)} (`veloxquant methods {method}`)")
            field = accepted[field]
        elif field not in known:
            close = sorted(n for n in known if field.lower() in n or n in field.lower())[:5]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise UsageError(f"unknown KVCacheConfig field {field!r}{hint}")
        out[field] = value
    return out


def _owner_hint(field: str) -> str:
    """`` (a setting of snapkv, ...)`` for a field other methods read, else ``""``."""
    from .cache import METHOD_NAMES
    from .cache.options import method_fields

    owners = [m for m in METHOD_NAMES if field in method_fields(m)]
    if not owners:
        return " (no method has a setting of that name)"
    more = f", ... ({len(owners)} methods)" if len(owners) > 4 else ""
    return f" (a setting of {', '.join(owners[:4])}{more})"


def settings_summary(method: str) -> str:
    """``budget (snap_budget), n_sink (snap_n_sink), dtype``: the names ``--set`` takes for ``method``."""
    parts = [f"{r['name']} ({r['flat']})" if r["name"] != r["flat"] else r["name"] for r in method_settings(method)]
    return ", ".join(parts) or "none"


def build_config(method: str, sets: dict[str, Any]):
    """``KVCacheConfig(method=method, **sets)``.

    ``sets`` keys are flat fields or ``method``'s option names. Fields that belong to ``method``'s options
    dataclass are passed through it (the non-deprecated path; the config copies them to the same flat fields
    and validates them under their flat names); the shared fields it reads go in as flat fields. A ``dtype``
    string names an mlx dtype. Raises ``QuantizerConfigError`` for invalid values.
    """
    from .cache import KVCacheConfig
    from .cache.config import DTYPE_NAMES, _quiet_flat_fields
    from .cache.options import OPTIONS_BY_METHOD, method_fields

    aliases = method_fields(method)
    flat = {aliases.get(k, k): v for k, v in sets.items()}
    if isinstance(flat.get("dtype"), str):
        import mlx.core as mx

        name = flat["dtype"]
        if name not in DTYPE_NAMES:
            raise UsageError(f"dtype={name!r} is not allowed; allowed: {', '.join(DTYPE_NAMES)}")
        flat["dtype"] = getattr(mx, name)
    options = None
    opts_cls = OPTIONS_BY_METHOD.get(method)
    if opts_cls is not None:
        by_flat = {f: o for o, f in opts_cls.FIELDS.items()} | {o: o for o in opts_cls.OPTION_ONLY}
        picked = {by_flat[k]: flat.pop(k) for k in list(flat) if k in by_flat}
        if picked:
            options = opts_cls(**picked)
    with _quiet_flat_fields():  # a shared field another method's options also own (vecinfer's key_sub_dim)
        return KVCacheConfig(method=method, options=options, **flat)


def method_config(method: str, set_items, *, standalone_ok: bool = True):
    """Validate ``--method`` and its ``--set`` items: ``(sets, config)``, ``config`` None for ``none``."""
    _check_method_name(method)
    sets = parse_sets(set_items, method=method)
    if method == NONE:
        if sets:
            raise UsageError(f"--set does not apply to --method {NONE} (mlx_lm's plain KVCache)")
        return sets, None
    from .cache import STANDALONE_METHODS

    if not standalone_ok and method in STANDALONE_METHODS:
        raise UsageError(f"method {method!r} has the standalone protocol (append_key/append_value): it makes no "
                         "mlx_lm prompt cache; `veloxquant methods` lists the mlx_lm-protocol ones")
    config = build_config(method, sets)
    _check_buildable(method)
    return sets, config


def _check_method_name(method: str) -> None:
    from .cache import METHOD_NAMES

    if method != NONE and method not in METHOD_NAMES:
        raise UsageError(f"unknown method {method!r}; `veloxquant methods` lists the {len(METHOD_NAMES)} methods "
                         f"(or use {NONE!r} for mlx_lm's uncompressed cache)")


def _check_buildable(method: str) -> None:
    """Raise ``NotImplementedError`` for a registered but unbuilt method, before any model is loaded."""
    from .cache.factory import _implemented_class

    _implemented_class(method)


def make_caches(model, method: str, config=None) -> list:
    """One cache per layer: mlx_lm's plain caches for ``none``, else ``KVCacheBuilder.for_model``."""
    from mlx_lm.models.cache import make_prompt_cache

    if method == NONE:
        return make_prompt_cache(model)
    from .cache import KVCacheBuilder

    return KVCacheBuilder.for_model(model, config)


# --------------------------------------------------------------------------- #
# generation
# --------------------------------------------------------------------------- #


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user turn of the chat template when the tokenizer has one."""
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if hasattr(ids, "keys"):  # a BatchEncoding from some transformers versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(text)]


def encode_turn(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one more user turn of the chat template, to follow tokens already in a cache:
    the turn and the assistant prompt only, without the BOS or default system message the template puts
    at the start of a conversation. Plain ``tokenizer.encode`` when there is no template (or when the
    template does not render a system message and the turn one after the other)."""
    plain = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if not (getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)):
        return plain
    system = [{"role": "system", "content": "-"}]
    try:
        head = tokenizer.apply_chat_template(system, tokenize=False)
        full = tokenizer.apply_chat_template(system + [{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that refuses a system message
        return plain
    if not full.startswith(head):
        return plain
    return [int(i) for i in tokenizer.encode(full[len(head):], add_special_tokens=False)]


def run_generation(model, tokenizer, prompt_ids: list[int], caches: list, max_tokens: int,
                   on_token: Optional[Callable[[int], None]] = None,
                   on_prefill: Optional[Callable[[int, int], None]] = None) -> dict:
    """Greedy ``mlx_lm.stream_generate`` into ``caches``; tokens, text and timings (EOS excluded).

    ``on_prefill(done, total)`` follows the prompt's prefill chunk by chunk (mlx_lm's
    ``prompt_progress_callback``); ``on_token(n)`` each generated token."""
    import mlx_lm

    tokens: list[int] = []
    text: list[str] = []
    t0 = time.perf_counter()
    t_first = t_last = None
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens,
                                       prompt_cache=caches, prompt_progress_callback=on_prefill):
        now = time.perf_counter()
        text.append(resp.text)
        if resp.finish_reason == "stop":  # this response carries the EOS token
            break
        tokens.append(int(resp.token))
        if t_first is None:
            t_first = now
        t_last = now
        if on_token is not None:
            on_token(len(tokens))
    end = time.perf_counter()
    decode_tps = None
    if len(tokens) >= 2 and t_last > t_first:
        decode_tps = (len(tokens) - 1) / (t_last - t_first)
    return {
        "text": "".join(text),
        "tokens": tokens,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(tokens),
        "prefill_s": (t_first if t_first is not None else end) - t0,
        "decode_tps": decode_tps,
    }


def _kv_summary(model, caches) -> dict:
    from .measure import cache_tokens, fp16_kv_bytes, kv_bytes, kv_fraction_of_fp16

    n = cache_tokens(caches)
    measured = kv_bytes(caches)
    reference = fp16_kv_bytes(model, n)
    return {
        "kv_tokens": n,
        "kv_bytes": measured,
        "kv_bytes_fp16": reference,
        "kv_fraction_of_fp16": kv_fraction_of_fp16(measured, reference),
    }


# --------------------------------------------------------------------------- #
# subcommands
# --------------------------------------------------------------------------- #


def _cmd_methods(args) -> int:
    from .cache import all_methods

    if args.name is not None:
        return _cmd_method_settings(args)
    rows = [{"name": i.name, "family": i.family, "protocol": i.protocol,
             "implemented": i.implemented, "paper": i.paper} for i in all_methods()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [[r["name"], r["family"], r["protocol"], "yes" if r["implemented"] else "no", r["paper"]]
             for r in rows]
    print(_format_table(["method", "family", "protocol", "implemented", "paper"], table))
    built = sum(r["implemented"] for r in rows)
    print(f"\n{built} of {len(rows)} methods implemented. `veloxquant methods NAME` lists a method's settings.")
    return 0


def method_settings(method: str) -> list[dict]:
    """One row per ``--set`` name of ``method``: name, flat alias, type, default, allowed values, and
    whether it is the method's own option or a shared field it reads."""
    from .cache.config import _DEFAULTS, _FIELD_TYPES, allowed_values
    from .cache.options import OPTION_CHECKS, OPTIONS_BY_METHOD, method_fields

    opts = OPTIONS_BY_METHOD.get(method)
    names = method_fields(method)
    rows = []
    for name, flat in names.items():
        if flat in _NOT_SETTABLE:
            continue
        if opts is not None and name in opts.OPTION_ONLY:  # no flat field: described by the options class
            f = next(f for f in dataclasses.fields(opts) if f.name == name)
            rows.append({"name": name, "flat": name, "kind": "option", "type": str(f.type).replace("typing.", ""),
                         "default": f.default, "allowed": OPTION_CHECKS[name][1]})
            continue
        option = opts is not None and opts.FIELDS.get(name) == flat
        if not option and name == flat and opts is not None and flat in opts.FIELDS.values():
            opt_name = next(o for o, f in opts.FIELDS.items() if f == flat)
            if names.get(opt_name) == flat:
                continue  # the flat alias of an option: shown on the option's row
            option = True  # the option's own name is taken by a shared field (snapkv's dtype): use the flat one
        rows.append({"name": name, "flat": flat, "kind": "option" if option else "shared",
                     "type": str(_FIELD_TYPES[flat]).replace("typing.", ""),
                     "default": _DEFAULTS[flat], "allowed": allowed_values(flat)})
    return rows


def _cmd_method_settings(args) -> int:
    from .cache import method_info

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
    print(_format_table(["setting", "flat alias", "type", "default", "allowed"], table))
    example = next((r for r in rows if r["default"] is not None), None)
    print("\nSet with --set NAME=VALUE (the setting or its flat alias)"
          + (f", e.g. --set {example['name']}={json.dumps(example['default'], default=str)}." if example else "."))
    return 0


def _cmd_generate(args) -> int:
    if args.raw_prompt and args.prompt_cache is None:
        raise UsageError("--raw-prompt applies only with --prompt-cache")
    if args.prompt_cache is not None:
        from .cli_cache import generate_from_saved

        return generate_from_saved(args)
    method = args.method
    if method is None:
        raise UsageError("the following argument is required: --method (it may be left out only with "
                         "--prompt-cache, whose file records it)")
    sets, config = method_config(method, args.set)
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")

    from .cli_progress import Progress
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
           "prompt_tokens": result["prompt_tokens"], "generated_tokens": result["generated_tokens"],
           "prefill_s": result["prefill_s"], "decode_tps": result["decode_tps"], **_kv_summary(model, caches)}
    method_label = method + (" " + " ".join(f"{k}={v}" for k, v in sets.items()) if sets else "")
    head = [("method", method_label), ("prompt tokens", out["prompt_tokens"])]
    if group.size() > 1:
        out["ranks"] = group.size()  # the byte figures are rank 0's: its own KV heads
        head.append(("ranks", f"{group.size()} (mx.distributed; kv bytes below are rank 0's share)"))
    if not rank0:
        return 0  # every rank generates the same tokens; rank 0 alone prints them
    return print_generation(out, head, args.json)


#: Why a compressed cache can hold more than fp16 on a short prompt (README, "Reading the byte figures").
SHORT_PROMPT_NOTE = (
    "note: above 1 means this cache holds more than mlx_lm's fp16 cache would for these few tokens: below a "
    "method's budget, window or residual length nothing is compressed yet, and the rows it keeps at 16 bits "
    "come with fixed per-layer parts (codebooks, rotations, scales, preallocated rows); the fraction falls "
    "once the prompt is longer than that.")


def print_generation(out: dict, head: list, as_json: bool) -> int:
    """Print a generation: one JSON object, or its text then ``head`` rows and the measured byte rows."""
    if as_json:
        print(json.dumps(out))
        return 0
    from .measure import fraction_text

    print(out["text"])
    print("-" * 40)
    for label, value in head + [
        ("generated tokens", out["generated_tokens"]),
        ("decode tok/s", _fmt_tps(out["decode_tps"])),
        ("kv_bytes", f"{out['kv_bytes']} ({_fmt_bytes(out['kv_bytes'])}, measured: sum of cache nbytes)"),
        ("kv_bytes_fp16", f"{out['kv_bytes_fp16']} ({_fmt_bytes(out['kv_bytes_fp16'])}, "
                          f"{out['kv_tokens']} tokens in mlx_lm's plain cache at fp16)"),
        ("kv_fraction_of_fp16", f"{fraction_text(out['kv_fraction_of_fp16'])} = kv_bytes / kv_bytes_fp16"),
    ]:
        print(f"{label:>19}: {value}")
    if out["kv_fraction_of_fp16"] is not None and out["kv_fraction_of_fp16"] > 1 and out["method"] != NONE:
        print(SHORT_PROMPT_NOTE)
    return 0


# --- demo ------------------------------------------------------------------ #

NEEDLE = "The secret passcode for the blue vault is 4817."
QUESTION = "What is the secret passcode for the blue vault? Answer with the number only."
ANSWER = "4817"


def build_needle_prompt(tokenizer, n_tokens: int, depth: float = 0.5) -> list[int]:
    """~``n_tokens`` prompt tokens: real essay text with :data:`NEEDLE` at ``depth``, then :data:`QUESTION`."""
    from .assets import essays_text

    def wrap(document: str) -> str:
        return ("Read the text below, then answer the question after it.\n\n"
                f"{document}\n\nQuestion: {QUESTION}")

    overhead = len(encode_prompt(tokenizer, wrap(NEEDLE)))
    budget = max(n_tokens - overhead, 16)
    hay_ids = tokenizer.encode(essays_text(max_chars=budget * 8), add_special_tokens=False)[:budget]
    hay = tokenizer.decode(hay_ids)
    cut = int(len(hay) * depth)
    stop = hay.find(". ", cut)
    pos = stop + 2 if stop != -1 else cut
    return encode_prompt(tokenizer, wrap(hay[:pos] + NEEDLE + " " + hay[pos:]))


def _is_correct(answer: str) -> bool:
    return ANSWER in re.sub(r"[\s,.'\"]", "", answer)


def _agreement(reference: list[int], tokens: list[int]) -> float:
    """Fraction of positions where the generated tokens equal the reference run's."""
    n = max(len(reference), len(tokens))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(reference, tokens)) / n


def _demo_settings(method: str, config) -> str:
    if config is None:
        return "uncompressed"
    from .cache.options import OPTIONS_BY_METHOD

    shown = dict(DEMO_PRESETS.get(method, {}))
    opts_cls = OPTIONS_BY_METHOD.get(method)
    if opts_cls is not None:
        for opt, flat in opts_cls.FIELDS.items():
            if opt in ("budget", "window_size", "n_sink", "bits", "residual_length"):
                shown[opt] = getattr(config, flat)
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults"


def _cmd_demo(args) -> int:
    from .cache import method_info
    from .cache.base import STANDALONE_METHODS

    wanted = [m.strip() for m in (args.methods.split(",") if args.methods else DEMO_METHODS) if m.strip()]
    for m in wanted:
        _check_method_name(m)
    if args.context < 64:
        raise UsageError("--context must be >= 64")
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")

    from .cli_progress import Progress

    progress = Progress(enabled=not args.json)
    runs: list[tuple[str, Any]] = [(NONE, None)]
    skipped: list[str] = []
    for m in dict.fromkeys(wanted):
        if m == NONE:
            continue
        info = method_info(m)
        if not info.implemented:
            skipped.append(f"{m}: not implemented yet")
        elif m in STANDALONE_METHODS:
            skipped.append(f"{m}: standalone protocol (no mlx_lm serving contract)")
        else:
            runs.append((m, build_config(m, DEMO_PRESETS.get(m, {}))))
    for note in skipped:
        progress.note(f"note: skipping {note}")

    from .model import load_model

    progress.stage("loading model (first use downloads it)")
    model, tokenizer = load_model(args.model)
    progress.stage("building the needle prompt (first use downloads the essays)")
    prompt_ids = build_needle_prompt(tokenizer, args.context)

    rows = []
    reference: Optional[list[int]] = None
    for i, (method, config) in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] {method}"
        progress.stage(f"{tag}: prefill {len(prompt_ids)} tokens, then up to {args.max_tokens} new tokens")
        caches = make_caches(model, method, config)
        result = run_generation(model, tokenizer, prompt_ids, caches, args.max_tokens, on_prefill=progress.chunk)
        if reference is None:
            reference = result["tokens"]
        kv = _kv_summary(model, caches)
        del caches
        rows.append({
            "method": method, "settings": _demo_settings(method, config),
            "answer": result["text"].strip(), "correct": _is_correct(result["text"]),
            "prompt_tokens": result["prompt_tokens"], "generated_tokens": result["generated_tokens"],
            "prefill_s": result["prefill_s"], "decode_tps": result["decode_tps"],
            "agreement": _agreement(reference, result["tokens"]), **kv,
        })
        progress.stage(f"{tag}: done ({result['prefill_s']:.1f}s prefill, {result['generated_tokens']} tokens)")

    from .measure import fraction_text

    if args.json:
        print(json.dumps({"prompt_tokens": len(prompt_ids), "answer": ANSWER, "skipped": skipped, "rows": rows}))
        return 0
    print(f"Needle in a haystack: {len(prompt_ids)} prompt tokens of Paul Graham essays, passcode sentence at "
          f"50% depth, expected answer {ANSWER}; model {args.model or 'SmolLM2-135M-Instruct (embedded)'}, "
          f"greedy, <= {args.max_tokens} new tokens.")
    table = [[r["method"], r["settings"], _truncate(r["answer"], 50), "yes" if r["correct"] else "no",
              _fmt_bytes(r["kv_bytes"]), fraction_text(r["kv_fraction_of_fp16"]),
              _fmt_tps(r["decode_tps"]), f"{r['agreement']:.2f}"] for r in rows]
    print(_format_table(["method", "settings", "answer", "correct", "KV bytes", "kv_fraction_of_fp16",
                         "decode tok/s", "agreement"], table))
    print(f"KV bytes: measured (sum of the caches' nbytes) after the run; kv_fraction_of_fp16 = KV bytes / the "
          f"same {rows[0]['kv_tokens']} tokens in mlx_lm's plain cache at fp16 without slack (lower = smaller).")
    print("The uncompressed run ('none') stores the model's compute dtype (float32 on the MLX CPU backend) "
          "and counts mlx_lm's 256-row allocation steps, so its fraction is above 1.")
    print("agreement = fraction of generated tokens identical to the uncompressed run, position by position.")
    if any((r["kv_fraction_of_fp16"] or 0) > 1 for r in rows if r["method"] != NONE):
        print(SHORT_PROMPT_NOTE)
    for note in skipped:
        print(f"skipped {note}")
    return 0


# --------------------------------------------------------------------------- #
# formatting and entry point
# --------------------------------------------------------------------------- #


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _fmt_tps(tps: Optional[float]) -> str:
    return f"{tps:.1f}" if tps else "n/a"


def _truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _format_table(headers: list[str], rows: list[list[str]]) -> str:
    cols = list(zip(headers, *rows))
    widths = [max(len(str(c)) for c in col) for col in cols]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="veloxquant", description="Compressed KV caches for mlx_lm.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{methods,generate,demo,eval,bench,cache,serve}")

    m = sub.add_parser("methods", help="list the 44 methods (the spec's 43 + waterfill), or one method's settings")
    m.add_argument("name", nargs="?", default=None,
                   help="a method name: list its --set settings (type, default, allowed values, flat alias)")
    m.add_argument("--json", action="store_true", help="print JSON (a list of methods, or one method's settings)")
    m.set_defaults(func=_cmd_methods)

    g = sub.add_parser("generate", help="generate with a compressed KV cache and report its bytes")
    g.add_argument("--method", default=None,
                   help=f"a method name from `veloxquant methods`, or {NONE!r} (required unless --prompt-cache)")
    g.add_argument("--set", action="append", metavar="FIELD=VALUE", default=[],
                   help="a setting of --method (repeatable): its option name (budget=256) or flat KVCacheConfig "
                        "field (snap_budget=256); `veloxquant methods NAME` lists them. VALUE is parsed as JSON "
                        "when possible")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--prompt", required=True,
                   help="the user message (wrapped in the model's chat template when it has one)")
    g.add_argument("--max-tokens", type=int, default=64, help="most new tokens to generate, greedily (default 64)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_generate)
    from .cli_cache import add_generate_arguments, add_parsers as add_cache_parsers  # generate --prompt-cache, cache

    add_generate_arguments(g)

    d = sub.add_parser("demo", help="needle-in-a-haystack answers: uncompressed vs compressed caches")
    d.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: {','.join(DEMO_METHODS)}; unimplemented ones are skipped)")
    d.add_argument("--context", type=int, default=2000, help="approximate prompt length in tokens (default 2000)")
    d.add_argument("--model", default=None, help=MODEL_HELP)
    d.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS,
                   help=f"most new tokens per answer (default {DEMO_MAX_TOKENS})")
    d.add_argument("--json", action="store_true", help="print the results as one JSON object")
    d.set_defaults(func=_cmd_demo)

    from .cli_measure import add_subcommands  # eval, bench

    add_subcommands(sub)
    add_cache_parsers(sub)

    from .cli_serve import add_subcommand as add_serve

    add_serve(sub)
    return p


def _unsupported_model_error() -> type:
    from .model import UnsupportedModelError

    return UnsupportedModelError


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (captured in tests)
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    from .cache import QuantizerConfigError

    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that went away is reported here, not at exit
        return code
    except BrokenPipeError:  # `veloxquant methods --json | head`: the reader has all it wanted
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a program stopped by a closed pipe
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except QuantizerConfigError as exc:
        print(f"error: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except _unsupported_model_error() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
