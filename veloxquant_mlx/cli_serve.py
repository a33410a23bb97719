"""``veloxquant serve``: the subcommand's parser and handler (the server is :mod:`.server`)."""

from __future__ import annotations

import argparse
import logging
import math
import os

from .cli_output import POSITIVE, add_command, at_least


def add_subcommand(sub) -> None:
    s = add_command(
        sub, "serve", _cmd_serve, json=None, help="OpenAI-compatible server (mlx_lm.server) with compressed KV caches",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and GET /v1/kv/stats; a request may "
                    'pick its own cache with "kv_cache": {"method": M, "settings": {FIELD: VALUE}}.')
    s.add_argument("--method", default=None,
                   help="default method (default: kivi with bit_width_inlier=4; 'none' = mlx_lm's plain cache)")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE", default=[],
                   help="a setting of the default method (repeatable)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    s.add_argument("--allow-origin", action="append", metavar="ORIGIN", default=[],
                   help="a web origin whose pages may call the server (repeatable; others get HTTP 403)")
    s.add_argument("--api-key", default=os.environ.get("VELOXQUANT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $VELOXQUANT_API_KEY; unset = no key)")
    s.add_argument("--socket-timeout", type=float, default=30.0,
                   help="seconds a connection may stall on a read or write before it is dropped (default 30)")
    s.add_argument("--max-tokens", type=POSITIVE, default=512, help="default max_tokens of a request")
    s.add_argument("--max-tokens-limit", type=POSITIVE, default=4096, help="largest max_tokens a request may ask")
    s.add_argument("--max-prompt-tokens", type=POSITIVE, default=8192,
                   help="longer prompts get HTTP 413 (default 8192; one prompt holds the generation thread)")
    s.add_argument("--max-body-bytes", type=POSITIVE, default=1 << 20,
                   help="larger bodies get HTTP 413 (default 1 MiB)")
    s.add_argument("--prompt-cache-size", type=at_least(0), default=10,
                   help="finished caches kept for prefix reuse (0: none)")
    s.add_argument("--prompt-cache-bytes", type=int, default=None, help="byte cap of the kept caches")
    s.add_argument("--decode-concurrency", type=POSITIVE, default=32,
                   help="most requests decoded together in mlx_lm's batch: 'none' and the methods with a batch form "
                        "(kivi, turboquant_rvq, waterfill, streaming_llm); others run one request at a time")
    s.add_argument("--prefill-step-size", type=POSITIVE, default=2048,
                   help="prompt tokens per prefill chunk (default 2048)")
    s.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="server log verbosity (default WARNING)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from .cache.settings import UsageError, parse_sets
    from .server import DEFAULT_METHOD, DEFAULT_SETTINGS, RequestError, parse_kv_settings, serve, server_args
    if not (math.isfinite(args.socket_timeout) and args.socket_timeout > 0):
        raise UsageError(f"--socket-timeout must be a positive number of seconds, got {args.socket_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty")
    if args.max_tokens > args.max_tokens_limit:
        raise UsageError(f"--max-tokens {args.max_tokens} is over --max-tokens-limit {args.max_tokens_limit}")
    method = args.method or DEFAULT_METHOD
    defaults = DEFAULT_SETTINGS if args.method is None else {}  # the server's default, under any --set given
    try:
        kv = parse_kv_settings(method, {**defaults, **parse_sets(args.set, method=method)})
    except RequestError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(message)s")
    opts = vars(args)  # the flags whose names are mlx_lm's server arguments or make_server's limits
    cli_args = server_args(args.model, allowed_origins=list(args.allow_origin), **{n: opts[n] for n in (
        "host", "port", "max_tokens", "prompt_cache_size", "prompt_cache_bytes", "decode_concurrency",
        "prefill_step_size", "log_level")})
    serve(kv, cli_args, **{n: opts[n] for n in ("max_prompt_tokens", "max_body_bytes", "max_tokens_limit",
                                                "socket_timeout", "api_key")})
    return 0
