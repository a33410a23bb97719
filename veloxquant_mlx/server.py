"""``veloxquant serve``: mlx_lm's OpenAI-compatible server (HTTP API, queue, generation thread, continuous batching)
with this library's caches: per-request ``"kv_cache"`` (:mod:`.server_requests`), batchable methods in mlx_lm's batch
(one per KV settings, carried by the model key), the others one at a time, prefix reuse (:mod:`.server_store`),
``/v1/kv/stats``, access checks and cancellation when the client is gone (README.md, "Serving")."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import hmac
import io
import json
import logging
import re
import select
import socket
import threading
import time
import urllib.parse
import weakref
from http.server import ThreadingHTTPServer
from typing import Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from .cache.rotating import RING_CLASSES
from .cache.settings import NONE
from .generate import make_caches, method_class  # noqa: F401
from .measure import batch_figures, cache_figures, process_memory
from .server_requests import (KVSettings, RequestError, check_generation_fields, check_messages,  # noqa: F401
                              check_number_types, parse_kv_settings, prompt_tokens, request_kv)
from .server_store import PromptCacheStore, SafePromptCache, reuse_mode  # noqa: F401

EMBEDDED_ID = "smollm2-135m"
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_PROMPT_TOKENS = 8192
DEFAULT_SOCKET_TIMEOUT = 30.0
#: Without ``--method``: KIVI-4, batchable, KL ~0.007 at ~0.36x fp16 bytes, the fastest quantizer (docs/RESULTS.md).
DEFAULT_METHOD = "kivi"
DEFAULT_SETTINGS = {"bit_width_inlier": 4}
_POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")

# mlx_lm's handler answers every error of a request factory with 400 and every error of ``generate`` with 404;
# the status of a RequestError raised on the handler's thread replaces it.
_pending = threading.local()


@contextlib.contextmanager
def _status_kept(kinds=RequestError):
    """An exception of ``kinds`` raised inside keeps its status (a RequestError's, else 500) for the answer."""
    try:
        yield
    except kinds as e:
        _pending.status = e.status if isinstance(e, RequestError) else 500
        raise


class ClientGone(Exception):
    """The client of a request closed its connection: the request is cancelled, nothing is sent."""


@dataclasses.dataclass
class KVModelDescription(mlx_server.ModelDescription):
    """mlx_lm's model description plus the KV settings: its batch path batches only equal descriptions."""

    kv: tuple = ()


class CachedModel:
    """The served model whose ``make_cache`` (mlx_lm's batch path) builds compressed caches; it remembers the
    latest forward pass's caches weakly, for ``/v1/kv/stats``."""

    def __init__(self, model, kv: KVSettings):
        self._model, self._kv, self._last = model, kv, ()

    def __call__(self, *args, cache=None, **kwargs):
        if cache is not None:
            self._last = tuple(weakref.ref(c) for c in cache)
        return self._model(*args, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def make_cache(self):
        return make_caches(self._model, self._kv.method, self._kv.config)

    def live_caches(self) -> list:
        caches = [r() for r in self._last]
        return caches if caches and all(c is not None for c in caches) else []


class ServedModelProvider(mlx_server.ModelProvider):
    """Serves one model (default: the embedded SmolLM2), loaded through ``veloxquant_mlx.model``."""

    def __init__(self, cli_args, loaded: Optional[tuple] = None):
        super().__init__(cli_args)
        self.served_id = cli_args.model
        self._loaded = loaded  # (model, tokenizer) given by the caller instead of loading served_id
        self.kv: Optional[KVSettings] = None  # of the request being scheduled (set by _is_batchable)
        self._wrapped: dict = {}
        self.aliases = {None, "default_model", cli_args.model}
        if cli_args.model == EMBEDDED_ID:
            self.aliases |= {"smollm2", "SmolLM2-135M-Instruct"}

    def check_served(self, name) -> None:
        if name not in self.aliases:
            raise RequestError(404, f"model {name!r} is not served here; this server serves {self.served_id!r}")

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """A ``CachedModel`` of the scheduled request's KV settings, also named in ``model_key`` (so mlx_lm's
        prompt-cache store never hands one method's cache to another)."""
        self.check_served(model_path)
        if adapter_path is not None or draft_model_path not in (None, "default_model", self.cli_args.draft_model):
            raise RequestError(400, "adapters and draft models are not supported by veloxquant serve")
        kv = self.kv
        self.model_key = (self.served_id, kv.key if kv is not None and kv.method != NONE else None, None)
        if self.model is None:
            if self._loaded is None:
                from .model import load_model
                self._loaded = load_model(None if self.served_id == EMBEDDED_ID else self.served_id)
            self.model, self.tokenizer = self._loaded
            self.processor, self.draft_model, self._sliding = None, None, None
            self.is_batchable = True  # for ``none`` requests; compressed ones opt out in _is_batchable
        if kv is None:
            return self.model, self.tokenizer
        return self._wrapped.setdefault(kv.key, CachedModel(self.model, kv)), self.tokenizer

    def batches(self, kv: KVSettings) -> bool:
        """Whether ``kv`` joins mlx_lm's batch: it has a batch form and no layer gets its compressed ring."""
        if not kv.batchable:
            return False
        if kv.method not in RING_CLASSES or self.model is None:
            return True
        if self._sliding is None:
            self._sliding = any(type(c) is RotatingKVCache for c in make_prompt_cache(self.model))
        return not self._sliding


class _TrackedQueue:
    """A response queue that knows whether its request started and finished: a failed generation loop fails
    the started ones and re-queues the others, once."""

    __slots__ = ("queue", "request", "started", "done", "retried", "__weakref__")

    def __init__(self, queue, request: tuple, retried: bool = False):
        self.queue, self.request, self.retried = queue, request, retried  # request: (request, generation args)
        self.started = self.done = False

    def put(self, item) -> None:
        self.started = True
        if item is None or isinstance(item, Exception):
            self.done = True
        self.queue.put(item)


class CompressedResponseGenerator(mlx_server.ResponseGenerator):
    """mlx_lm's generation thread; compressed requests without a batch form are served one at a time."""

    def __init__(self, provider, prompt_cache, default_kv: KVSettings, store: PromptCacheStore, counters: dict):
        self.default_kv, self.store, self.counters = default_kv, store, counters
        self.live: dict[int, tuple] = {}  # id -> (KV settings, caches) of the requests served one at a time
        self.last_reuse = None  # the prefix-reuse decision of the latest request served one at a time
        self._ids, self._count_lock = 0, threading.Lock()
        self._in_flight: weakref.WeakSet = weakref.WeakSet()  # before the thread starts
        super().__init__(provider, prompt_cache)

    def count(self, **increments: int) -> None:
        with self._count_lock:
            for name, n in increments.items():
                self.counters[name] = self.counters.get(name, 0) + n

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:  # noqa: BLE001 - any failure fails the requests in flight, not the server
                if self._stop:
                    return
                logging.error("generation loop failed (%s: %s); failing its requests and going on",
                              type(e).__name__, e, exc_info=logging.getLogger().isEnabledFor(logging.DEBUG))
                failure = RuntimeError(f"generation failed: {type(e).__name__}: {e}")
                for q in [q for q in self._in_flight if not q.done]:
                    if q.started or q.retried:
                        q.put(failure)
                    else:  # waiting behind the failed batch: served by the restarted loop
                        self.requests.put((_TrackedQueue(q.queue, q.request, retried=True), *q.request))
                self._in_flight = weakref.WeakSet()
                self.count(generation_failures=1)
                del e
                gc.collect()
                time.sleep(0.05)  # no busy loop should the failure repeat without requests

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is None:
            return None
        queue = request[0]
        tracked = queue if isinstance(queue, _TrackedQueue) else _TrackedQueue(queue, tuple(request[1:]))
        self._in_flight.add(tracked)
        return (tracked, *request[1:])

    def generate(self, request, generation_args, progress_callback=None):
        """mlx_lm's ``generate``; a client gone at a progress report or token stops it (``ClientGone``)."""
        kv = getattr(request, "kv", None) or self.default_kv
        generation_args.kv = kv
        generation_args.model = KVModelDescription(**dataclasses.asdict(generation_args.model), kv=kv.key)
        self.count(requests=1)
        gone = getattr(_pending, "client_gone", None) or (lambda: False)

        def check(*report):
            if gone():
                ctx.stop()
                raise ClientGone()
            if report and progress_callback is not None:
                progress_callback(*report)
        with _status_kept(Exception):
            ctx, responses = super().generate(request, generation_args, check)
        return ctx, (check() or response for response in responses)

    def _is_batchable(self, args):  # per request, before its model is loaded: the provider learns its settings
        kv = getattr(args, "kv", self.default_kv)
        self.model_provider.kv = kv
        self.prompt_cache.skip_fetch = not kv.reuse
        return super()._is_batchable(args) and self.model_provider.batches(kv)

    def _serve_single(self, request, stream):
        rqueue, req, args = request
        kv = getattr(args, "kv", self.default_kv)
        if kv.method == NONE:
            return super()._serve_single(request, stream)
        try:
            self._serve_compressed(rqueue, req, args, kv, stream)
        except Exception as e:  # reported to the request's handler (its response counts it), the thread goes on
            rqueue.put(e)
        finally:
            gc.collect()
            mx.clear_cache()

    def _serve_compressed(self, rqueue, request, args, kv, stream):
        provider = self.model_provider
        model, tokenizer = provider.model, provider.tokenizer
        prompt, _, _, initial_state, vision = self._tokenize(tokenizer, request, args)
        if vision is not None:
            raise RequestError(400, "image inputs are not supported by veloxquant serve")
        stop_sequences, text_sm = self._make_state_machine(provider.model_key, tokenizer, args.stop_words)
        ctx = mlx_server.GenerationContext(
            has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser, text_sm=text_sm, initial_state=initial_state, prompt=prompt)
        caches, reused, how = self.store.fetch(kv.key, prompt) if kv.reuse else (None, 0, "reuse off")
        self.last_reuse = {"method": kv.method, "reused_tokens": reused, "prompt_tokens": len(prompt), "how": how}
        if caches is None:
            caches = make_caches(model, kv.method, kv.config)
        ctx.prompt_cache_count = reused
        self.count(served_one_at_a_time=1, prompt_tokens_one_at_a_time=len(prompt), reused_tokens=reused)
        rqueue.put(ctx)
        if args.seed is not None:
            mx.random.seed(args.seed)
        self._ids += 1
        live_id, tokens = self._ids, list(prompt)
        self.live[live_id] = (kv, caches)

        def progress(done, total):
            if ctx._should_stop:  # the handler stopped the request (its client is gone): stop the prefill here
                raise ClientGone()
            rqueue.put((done, total))
        try:
            matcher = stop_sequences.matcher()
            for gen in stream_generate(
                model=model, tokenizer=tokenizer, prompt=prompt[reused:], max_tokens=args.max_tokens,
                sampler=mlx_server._make_sampler(args, tokenizer),
                logits_processors=mlx_server._make_logits_processors(args), prompt_cache=caches,
                prompt_progress_callback=progress,
                prefill_step_size=self.cli_args.prefill_step_size, stream=stream,
            ):
                finish = "stop" if matcher.advance(gen.token) else gen.finish_reason
                rqueue.put(mlx_server.Response(
                    gen.text, gen.token, gen.logprobs[gen.token].item(), finish,
                    mlx_server._format_top_logprobs(gen.logprobs, args.top_logprobs, tokenizer)))
                tokens.append(gen.token)
                if ctx._should_stop or finish is not None:
                    break
            rqueue.put(None)
        finally:
            self.live.pop(live_id, None)
        # mlx_lm's generate_step feeds each token before yielding it: the caches have seen ``offset`` of ``tokens``
        seen = max(int(c.offset) for c in caches)
        if kv.reuse and seen <= len(tokens):
            self.store.insert(kv.key, tokens[:seen], caches)

    def stats(self) -> dict:
        model = self.model_provider.model
        with self._count_lock:
            counters = dict(self.counters)
        live = [{"id": i, "method": kv.method, "settings": dict(kv.settings), **cache_figures(model, caches)}
                for i, (kv, caches) in list(self.live.items())]
        live += [{"batch": True, "method": key[0], "settings": dict(key[1]), **batch_figures(model, caches)}
                 for key, wrapped in list(self.model_provider._wrapped.items()) if (caches := wrapped.live_caches())]
        cached = self.store.describe(model) + self.prompt_cache.describe(model)
        return {"model": self.model_provider.served_id, "default": self.default_kv.describe(), "live": live,
                "cached": cached, "cached_kv_bytes": sum(c["kv_bytes"] for c in cached), "counters": counters,
                "last_one_at_a_time_reuse": self.last_reuse, "process": process_memory(), "time": time.time()}


def _guarded(handler, access: bool = True):
    """A ``do_*`` handler behind the access checks (unless ``access=False``) that a client gone or stalled past
    the socket timeout ends quietly."""
    @functools.wraps(handler)
    def run(self) -> None:
        _pending.status = None
        _pending.client_gone = self._client_gone
        try:
            if not (access and self._access_refused()):
                handler(self)
        except (ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError) as e:
            self.close_connection = True
            if isinstance(e, ClientGone):
                self.response_generator.count(cancelled_client_gone=1)
            logging.info("client %s gone (%s): request dropped", self.client_address[0], type(e).__name__)
        finally:
            _pending.client_gone = None
    return run


class CompressedAPIHandler(mlx_server.APIHandler):
    """mlx_lm's handler plus ``/v1/kv/stats``, ``kv_cache``, limits, origin and API-key checks, a socket timeout
    and validation."""

    def __init__(self, response_generator, *args, **kwargs):
        self.timeout = response_generator.limits["socket_timeout"]  # read by StreamRequestHandler.setup
        super().__init__(response_generator, *args, **kwargs)

    def send_response(self, code, message=None):
        if code >= 400:
            self.response_generator.count(errors=1)
        super().send_response(code, message)

    def _set_completion_headers(self, status_code: int = 200):
        pending = getattr(_pending, "status", None)
        if status_code >= 400 and pending is not None:
            status_code = pending
        _pending.status = None
        super()._set_completion_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        self._stream_started = True
        super()._set_stream_headers(status_code)

    def _set_cors_headers(self):
        origin, allowed = self.headers.get("Origin"), self.response_generator.cli_args.allowed_origins
        if origin is not None and ("*" in allowed or origin in allowed):
            self.send_header("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)
            self.send_header("Vary", "Origin")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")

    def _send_json(self, status: int, obj, headers: Optional[dict] = None, close: bool = False) -> None:
        """A JSON answer; ``close``: end the connection after it (the rest of the request is not read)."""
        self.close_connection = self.close_connection or close
        _pending.status = None
        self._set_completion_headers(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        data = json.dumps(obj).encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, status: int, message: str, **kw) -> None:
        self._send_json(status, {"error": message}, **kw)

    def _client_gone(self) -> bool:  # readable with nothing to read: EOF
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _access_refused(self) -> bool:
        """403 for an origin not allowed, 401 without the API key."""
        origin, allowed = self.headers.get("Origin"), self.response_generator.cli_args.allowed_origins
        if origin is not None and "*" not in allowed and origin not in allowed:
            self._error(403, f"origin {origin!r} is not allowed (the server allows "
                             f"{', '.join(allowed) or 'no cross-origin requests'}; see --allow-origin)", close=True)
            return True
        key = self.response_generator.limits.get("api_key")
        if key:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {key}".encode()):
                self._error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' (--api-key)",
                            headers={"WWW-Authenticate": "Bearer"}, close=True)
                return True
        return False

    do_OPTIONS = _guarded(mlx_server.APIHandler.do_OPTIONS, access=False)

    @_guarded
    def do_GET(self):
        route = self.path.split("?", 1)[0]
        if route.rstrip("/") == "/v1/kv/stats":
            return self._send_json(200, self.response_generator.stats())
        if route.rstrip("/") == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [self._model_object()]})
        if route.startswith("/v1/models/"):  # OpenAI's retrieve; an id may hold a slash (org/name), or %2F
            name = urllib.parse.unquote(route[len("/v1/models/"):].rstrip("/"))
            provider = self.response_generator.model_provider
            if name in provider.aliases:
                return self._send_json(200, self._model_object())
            return self._send_json(404, {"error": {
                "message": f"The model {name[:200]!r} does not exist; this server serves {provider.served_id!r}",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
        if route.startswith("/v1/models"):  # mlx_lm's handler would list its Hugging Face cache
            return self._error(404, f"no such endpoint: GET {self.path[:200]}")
        return super().do_GET()

    def _model_object(self) -> dict:
        """The served model as OpenAI's API describes one."""
        served = self.response_generator.model_provider.served_id
        return {"id": served, "object": "model", "created": self.created, "owned_by": "veloxquant"}

    @_guarded
    def do_POST(self):
        """Path, Content-Length and UTF-8 checks, then mlx_lm's ``do_POST`` on the body read here."""
        if self.path not in _POST_PATHS:
            return self._error(404, f"no such endpoint: POST {self.path[:200]}")
        limit = self.response_generator.limits["max_body_bytes"]
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "Content-Length header is required", close=True)
        if not re.fullmatch(r"[0-9]{1,20}", length.strip()):
            return self._error(400, f"Content-Length must be a decimal byte count, got {length[:40]!r}", close=True)
        n = int(length)
        if n > limit:
            return self._error(413, f"request body of {n} bytes is over the limit of {limit} bytes (--max-body-bytes)",
                               close=True)
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            return self._error(408, f"request body not received within {self.timeout:g} s (Content-Length: {n})",
                               close=True)
        if len(raw) < n:
            return self._error(400, f"request body ended after {len(raw)} of {n} bytes", close=True)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return self._error(400, f"request body is not valid UTF-8 (byte {e.start}): send UTF-8 encoded JSON")
        socket_file, self.rfile = self.rfile, io.BytesIO(raw)
        self._stream_started = False
        try:
            super().do_POST()
        finally:
            self.rfile = socket_file

    def validate_model_parameters(self) -> None:
        check_number_types(self)
        super().validate_model_parameters()
        check_generation_fields(self, self.response_generator.vocab_size)
        if (options := self.stream_options) is not None:  # mlx_lm reads include_usage, optional in OpenAI's API
            self.stream_options = {**options, "include_usage": options.get("include_usage") or False}
        provider = self.response_generator.model_provider
        with _status_kept():
            provider.check_served(self.requested_model)
        self.requested_model = provider.served_id  # responses name the served model

    def _checked(self, request):
        """Attach the request's KV settings; check max_tokens and the prompt length."""
        gen = self.response_generator
        with _status_kept():
            kv = request_kv(self.body.get("kv_cache"), gen.default_kv, gen.model_provider.model)
            if kv is not None:
                request.kv = kv
            if self.max_tokens > gen.limits["max_tokens"]:
                raise RequestError(400, f"max_tokens={self.max_tokens} is over this server's limit of "
                                        f"{gen.limits['max_tokens']}")
            template_args = {**gen.cli_args.chat_template_args, **(self.chat_template_kwargs or {})}
            n = len(prompt_tokens(request, gen.model_provider.tokenizer, template_args))
            if n == 0:  # mlx_lm's generation would fail on it (in the batch loop, with the batch's other requests)
                raise RequestError(400, "prompt has no tokens: send a non-empty prompt")
            cap = gen.limits["max_prompt_tokens"]
            if n > cap:
                raise RequestError(413, f"prompt of {n} tokens is over the limit of {cap} tokens "
                                        "(--max-prompt-tokens)")
        return request

    def handle_chat_completions(self):
        with _status_kept():
            check_messages(self.body.get("messages"))
        return self._checked(super().handle_chat_completions())

    def handle_text_completions(self):
        with _status_kept():
            if "prompt" not in self.body:
                raise RequestError(400, "prompt is required")
        return self._checked(super().handle_text_completions())

    def handle_completion(self, request, stop_words):
        """mlx_lm's response loop; a failure gets a JSON error, or a final SSE ``error`` event once streaming."""
        try:
            super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
            status = e.status if isinstance(e, RequestError) else 500
            message = str(e) or type(e).__name__
            logging.warning("request failed after it started (%s): %s", status, message)
            self.close_connection = True
            if self._stream_started:
                self.response_generator.count(errors=1)
                event = {"error": {"message": message, "status": status}}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            else:
                self._headers_buffer = []  # drop the buffered 200 header: nothing was sent yet
                self._error(status, message)


def server_args(model: Optional[str] = None, **overrides) -> argparse.Namespace:
    """The argument namespace mlx_lm's server pieces read, with its defaults."""
    return argparse.Namespace(**{
        "model": model or EMBEDDED_ID, "adapter_path": None, "host": "127.0.0.1", "port": 8080, "allowed_origins": [],
        "draft_model": None, "num_draft_tokens": 3, "trust_remote_code": False, "log_level": "INFO",
        "chat_template": "", "use_default_chat_template": False, "temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "max_tokens": 512, "chat_template_args": {}, "decode_concurrency": 32, "prompt_concurrency": 8,
        "prefill_step_size": 2048, "prompt_cache_size": 10, "prompt_cache_bytes": None, "kv_bits": None,
        "kv_group_size": 64, "quantized_kv_start": 0, "pipeline": False, **overrides})


def make_server(kv: KVSettings, cli_args: argparse.Namespace, *, max_prompt_tokens=DEFAULT_MAX_PROMPT_TOKENS,
                max_body_bytes=DEFAULT_MAX_BODY_BYTES, max_tokens_limit: Optional[int] = None,
                socket_timeout: float = DEFAULT_SOCKET_TIMEOUT, api_key: Optional[str] = None,
                loaded: Optional[tuple] = None):
    """``(httpd, generator)``, not yet serving (port 0 picks a free one); ``loaded``: an already loaded
    ``(model, tokenizer)`` to serve as ``cli_args.model``. Stop with ``shutdown``."""
    provider = ServedModelProvider(cli_args, loaded)
    provider.load("default_model")  # load before serving: handlers tokenize to check prompt lengths
    make_caches(provider.model, kv.method, kv.config)  # per-layer configuration errors surface now
    # errors: 4xx/5xx answers and error events ending a stream; generation_failures: loop failures survived
    counters = dict.fromkeys(("requests", "served_one_at_a_time", "prompt_tokens_one_at_a_time", "reused_tokens",
                              "errors", "cancelled_client_gone", "generation_failures"), 0)
    store = PromptCacheStore(cli_args.prompt_cache_size, cli_args.prompt_cache_bytes)
    plain = SafePromptCache(cli_args.prompt_cache_size, counters)
    generator = CompressedResponseGenerator(provider, plain, kv, store, counters)
    # the logits' width bounds logit_bias ids and top_k (MLX infers the shape without computing the pass)
    generator.vocab_size = int(provider.model(mx.array([[0]])).shape[-1])
    generator.limits = {"max_prompt_tokens": max_prompt_tokens, "max_body_bytes": max_body_bytes,
                        "max_tokens": max_tokens_limit or max(cli_args.max_tokens, 4096),
                        "socket_timeout": socket_timeout, "api_key": api_key}
    httpd = _HTTPServer((cli_args.host, cli_args.port), lambda *a, **k: CompressedAPIHandler(generator, *a, **k))
    return httpd, generator


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection; a backlog that holds a burst of connections rather than dropping them."""

    daemon_threads = True
    request_queue_size = 128


def shutdown(httpd, generator) -> None:
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()


def serve(kv: KVSettings, cli_args: argparse.Namespace, **limits) -> None:
    httpd, generator = make_server(kv, cli_args, **limits)
    host, port = httpd.server_address[:2]
    logging.info("veloxquant serve: %s with %s at http://%s:%s/v1", cli_args.model, kv.method, host, port)
    print(f"serving {cli_args.model} with method {kv.method} at http://{host}:{port}/v1 "
          f"(stats: http://{host}:{port}/v1/kv/stats)", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            httpd.serve_forever()
    finally:
        shutdown(httpd, generator)
