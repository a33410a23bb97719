"""Checks of a ``veloxquant serve`` request on the handler's thread, before generation: ``"kv_cache"``, chat
messages, sampling fields. Anything wrong is a :class:`RequestError` or ``ValueError`` naming the field (a 4xx)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, Optional

from mlx_lm import server as mlx_server

from .cache.errors import QuantizerConfigError
from .cache.settings import NONE, UsageError, method_config
from .generate import has_batch_form, make_caches, method_class
from .server_store import reuse_mode

__all__ = ["RequestError", "KVSettings", "parse_kv_settings", "request_kv", "check_messages",
           "check_number_types", "check_generation_fields", "prompt_tokens"]


class RequestError(ValueError):
    """A client error with its HTTP status (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class KVSettings:
    """A request's cache configuration: a method, its ``--set`` fields and the built config."""

    method: str
    settings: tuple  # sorted (field, value) pairs, hashable
    config: Any = dataclasses.field(default=None, compare=False, hash=False)
    reuse: bool = True  # False: neither reuse a cached prefix nor keep this request's cache

    @property
    def key(self) -> tuple:
        return (self.method, self.settings)

    @property
    def batchable(self) -> bool:
        return has_batch_form(self.method)

    def describe(self) -> dict:
        cls = method_class(self.method)
        out = {"method": self.method, "settings": dict(self.settings)}
        if cls is None:
            return dict(out, batching="batched", batching_reason="mlx_lm's batch path (uncompressed KVCache)",
                        prompt_reuse="mlx_lm's prompt cache (trim when trimmable)")
        reason = (f"{cls.__name__}.merge builds its compressed batch form: requests with these settings share "
                  "mlx_lm's continuous batch" if self.batchable else f"{cls.__name__} has no batch form (merge "
                  "raises BatchingNotSupported): requests are served one at a time, compressed")
        return dict(out, batching="batched" if self.batchable else "sequential", batching_reason=reason,
                    prompt_reuse=reuse_mode(cls))


def parse_kv_settings(method: str, sets: dict, model=None) -> KVSettings:
    """``KVSettings`` of ``method`` and its fields, or ``RequestError(400)``; with ``model``, caches are built
    once, so per-layer checks fail here rather than in the generation thread."""
    if not isinstance(method, str):
        raise RequestError(400, f"kv_cache.method must be a string, got {method!r}")
    if not isinstance(sets, dict):
        raise RequestError(400, f"kv_cache.settings must be an object of FIELD: VALUE, got {sets!r}")
    try:
        parsed, config = method_config(method, [f"{k}={json.dumps(v)}" for k, v in sets.items()],
                                       standalone_ok=False)
        if method == NONE:
            return KVSettings(NONE, ())
        if model is not None:
            make_caches(model, method, config)
    except (UsageError, QuantizerConfigError, NotImplementedError, TypeError, ValueError, OverflowError) as e:
        raise RequestError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever else a config or cache constructor raises is the request's
        raise RequestError(400, f"kv_cache settings {sets!r} for method {method!r} were refused: "
                                f"{type(e).__name__}: {e}") from None
    return KVSettings(method, tuple(sorted(((k, _frozen(v)) for k, v in parsed.items()), key=lambda kv: kv[0])), config)


class _FrozenDict(dict):
    """A dict setting (e.g. ``a2ats_rope_scaling``) that can be part of a key; JSON still writes an object."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _frozen(value):
    """A settings value made hashable (the settings are a dict key and part of the model key): lists become
    tuples, dicts :class:`_FrozenDict`."""
    if isinstance(value, dict):
        return _FrozenDict((k, _frozen(v)) for k, v in value.items())
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def request_kv(spec, default: KVSettings, model) -> Optional[KVSettings]:
    """The KV settings of a request body's ``kv_cache`` (None when it has none: the server's default)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"method", "settings", "reuse"}:
        raise RequestError(400, 'kv_cache must be {"method": NAME, "settings": {FIELD: VALUE}, '
                                f'"reuse": BOOL}} (each optional), got {spec!r}'[:400])
    reuse = spec.get("reuse", True)
    if not isinstance(reuse, bool):
        raise RequestError(400, f"kv_cache.reuse must be true or false, got {reuse!r}")
    kv = default
    if "method" in spec or "settings" in spec:
        sets = spec.get("settings")
        kv = parse_kv_settings(spec.get("method", kv.method), {} if sets is None else sets, model=model)
    return dataclasses.replace(kv, reuse=reuse)


_INT_FIELDS = ("max_tokens", "top_k", "num_draft_tokens", "repetition_context_size", "presence_context_size",
               "frequency_context_size", "top_logprobs", "seed")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "xtc_probability", "xtc_threshold")
_ROLES = ("system", "user", "assistant", "tool")  # examples for the message; the chat template decides
_IMAGE_TYPES = ("image_url", "input_image", "image")
_CONTEXT_FIELDS = ("repetition_context_size", "presence_context_size", "frequency_context_size")
_TEMPLATE_SET = ("tokenize", "tools", "add_generation_prompt")  # template arguments the server passes itself


def check_messages(messages) -> None:
    """Malformed chat messages, before mlx_lm's processing (which fetches image URLs and templates anything)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be a {{role, content}} object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(400, f"messages[{i}].role must be a string such as {', '.join(_ROLES)}, "
                                    f"got {json.dumps(role)[:80]}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"messages[{i}].content must be a string, null or a list of "
                                    f"{{type: text, text}} parts, got {type(content).__name__}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_TYPES:
                raise RequestError(400, f"messages[{i}].content[{j}]: image inputs are not supported by "
                                        "veloxquant serve (it serves text-only models); nothing was fetched")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": "
                                        f"STRING}}, got {part!r}"[:300])


def check_number_types(req) -> None:
    """No booleans where mlx_lm's handler ``req`` expects numbers (before mlx_lm's own checks)."""
    for name in _INT_FIELDS + _FLOAT_FIELDS:
        if isinstance(getattr(req, name), bool):
            raise ValueError(f"{name} must be a number, got {json.dumps(getattr(req, name))}")


def check_generation_fields(req, vocab: int) -> None:
    """What mlx_lm's checks let through: finite floats, seed and token ids in range, types of the rest."""
    for name in _FLOAT_FIELDS:
        if not math.isfinite(getattr(req, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(req, name)}")
    if req.seed is not None and not 0 <= req.seed < 2 ** 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {req.seed}")
    for name in _CONTEXT_FIELDS:  # mlx_lm slices the generated tokens with it: 32-bit indices
        if getattr(req, name) >= 2 ** 31:
            raise ValueError(f"{name} must be an integer in [0, 2**31), got {getattr(req, name)}")
    options = req.stream_options
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"stream_options must be an object such as {{\"include_usage\": true}}, got "
                         f"{json.dumps(options)[:200]}")
    usage = None if options is None else options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ValueError(f"stream_options.include_usage must be true or false, got {json.dumps(usage)[:200]}")
    if req.top_k >= vocab:
        raise ValueError(f"top_k={req.top_k} is not below the vocabulary of {vocab} tokens (allowed: 0 "
                         f"= off, or 1..{vocab - 1})")
    if req.logit_bias is not None:
        for token, bias in req.logit_bias.items():
            if not 0 <= token < vocab:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary of {vocab} "
                                 f"tokens (ids 0..{vocab - 1})")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias[{token}] must be a finite number, got {bias}")
    stop = req.body.get("stop")
    words = [stop] if isinstance(stop, str) else stop
    if words is not None and (not isinstance(words, list)
                              or not all(isinstance(w, str) and w for w in words)):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got "
                         f"{json.dumps(stop)[:200]}")
    for name, value, kind in (("chat_template_kwargs", req.chat_template_kwargs, dict), ("tools", req.body.get("tools"),
                              list), ("role_mapping", req.body.get("role_mapping"), dict)):
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{name} must be {'a list' if kind is list else 'an object'}, got "
                             f"{json.dumps(value)[:200]}")


def prompt_tokens(request, tokenizer, template_args: dict) -> list:
    """The prompt as the generation thread will build it (to check its length); a template error is a 400."""
    if request.request_type != "chat":
        if not isinstance(request.prompt, str):
            raise RequestError(400, f"prompt must be a string, got {type(request.prompt).__name__}")
        return tokenizer.encode(request.prompt)
    if tokenizer.has_chat_template and (set_here := [name for name in _TEMPLATE_SET if name in template_args]):
        raise RequestError(400, f"chat_template_kwargs must not set {', '.join(set_here)}: the server sets "
                                f"{', '.join(_TEMPLATE_SET)} itself")
    try:
        messages = copy.deepcopy(request.messages)
        mlx_server.process_message_content(messages)
        if not tokenizer.has_chat_template:
            return tokenizer.encode(mlx_server.convert_chat(messages, request.role_mapping))
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=request.tools,
                                             **{**template_args, "tokenize": True})
    except Exception as e:  # noqa: BLE001 - the template's own error, whatever its type
        raise RequestError(400, "messages (with tools and chat_template_kwargs) could not be rendered by "
                                f"the model's chat template: {type(e).__name__}: {e}"[:500]) from None
