"""``veloxquant serve`` against a hostile client (issue 13, items 11-17 and the server parts of 7).

Every test talks HTTP to a server started in-process on 127.0.0.1, serving a tiny random-weight llama
with a byte-level tokenizer (258 ids, a ChatML template), so the whole file runs in seconds without
the real model. The model can be told to raise on its next forward pass, which is how the tests make
generation fail inside the batch path, the one-at-a-time compressed path and mlx_lm's own path.
Waits are bounded (polls with deadlines, socket timeouts); only loopback addresses are used."""

from __future__ import annotations

import http.client
import http.server
import json
import math
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import _init  # noqa: E402

from veloxquant_mlx import server as S  # noqa: E402

SERVED_ID = "tiny-hostile"
QUESTION = [{"role": "user", "content": "Say something."}]
TIMEOUT = 60


# --------------------------------------------------------------------------- the served model


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (256 byte ids) plus <|im_start|> (256) and <|im_end|>
    (257, EOS), with a ChatML chat template: enough for every code path of mlx_lm's server."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 chat_template=template, clean_up_tokenization_spaces=False)
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=[257])


VOCAB = 258
EOS = 257


def flaky_llama():
    """A tiny llama that counts its forward passes and raises on demand (``fail_in`` passes from now)."""
    from mlx_lm.models import llama

    class FlakyLlama(llama.Model):
        def __call__(self, inputs, cache=None, **kwargs):
            self.calls += 1
            if self.fail_in is not None:
                self.fail_in -= 1
                if self.fail_in <= 0:
                    self.fail_in = None
                    raise RuntimeError("injected model failure")
            return super().__call__(inputs, cache=cache, **kwargs)

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
    model = _init(FlakyLlama(args), 0)
    model.calls = 0
    model.fail_in = None
    return model


@pytest.fixture(scope="module")
def loaded():
    return flaky_llama(), byte_tokenizer()


def start(loaded, method="kivi", sets=None, **kwargs):
    kv = S.parse_kv_settings(method, sets or {})
    cli = S.server_args(SERVED_ID, port=0, max_tokens=8, **kwargs.pop("cli", {}))
    httpd, gen = S.make_server(kv, cli, loaded=loaded, max_prompt_tokens=2000, max_body_bytes=50_000,
                               **kwargs)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return httpd, gen


@pytest.fixture(scope="module")
def srv(loaded):
    httpd, gen = start(loaded, socket_timeout=1.0)
    yield httpd, gen
    S.shutdown(httpd, gen)


@pytest.fixture
def model(loaded):
    m = loaded[0]
    m.fail_in = None
    yield m
    m.fail_in = None


# --------------------------------------------------------------------------- clients


def address(httpd):
    return httpd.server_address[:2]


def call(httpd, path, body=None, *, raw: bytes | None = None, method=None, headers=None):
    """``(status, headers, text)`` of one request (http.client: real sockets, no proxies)."""
    conn = http.client.HTTPConnection(*address(httpd), timeout=TIMEOUT)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method or ("POST" if data is not None else "GET"), path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read().decode()
    conn.close()
    return out


def chat(httpd, messages=QUESTION, **extra):
    return call(httpd, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, **extra})


def ok_chat(httpd, **extra):
    status, _, text = chat(httpd, **extra)
    assert status == 200, text
    return json.loads(text)


def error_of(text):
    out = json.loads(text)
    assert isinstance(out, dict) and "error" in out, text
    return out["error"]


def raw_exchange(httpd, payload: bytes, wait=TIMEOUT) -> bytes:
    """Send raw bytes, then read until the server closes (bounded by ``wait``)."""
    with socket.create_connection(address(httpd), timeout=wait) as s:
        s.sendall(payload)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def counters(httpd):
    status, _, text = call(httpd, "/v1/kv/stats")
    assert status == 200
    return json.loads(text)["counters"]


def wait_for(predicate, what, limit=TIMEOUT):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- 11, 12, 17: refused values


@pytest.mark.parametrize("bias, needle", [
    ({"1000000000": 1}, "token id 1000000000 is outside the vocabulary of 258"),
    ({str(VOCAB): 1}, f"token id {VOCAB} is outside the vocabulary of 258"),
    ({"-1": 1}, "token id -1 is outside the vocabulary of 258"),
])
def test_logit_bias_ids_outside_the_vocabulary_are_refused(srv, bias, needle):
    httpd, _ = srv
    status, _, text = chat(httpd, logit_bias=bias)
    assert status == 400, text
    assert needle in error_of(text)


def test_logit_bias_inside_the_vocabulary_steers_the_output(srv):
    httpd, _ = srv
    out = ok_chat(httpd, logit_bias={"65": 100.0, str(EOS): -100.0}, kv_cache={"reuse": False})
    assert out["choices"][0]["message"]["content"] == "b" * 4  # byte id 65 is "b" in the byte alphabet


@pytest.mark.parametrize("extra, raw, needle", [
    ({"top_k": 100000}, None, "top_k=100000 is not below the vocabulary of 258"),
    ({"top_k": VOCAB}, None, "top_k=258"),
    ({"stop": [1]}, None, "stop must be"),
    ({"stop": ""}, None, "stop must be"),
    ({"max_tokens": True}, None, "max_tokens must be a number"),
    ({"top_k": False}, None, "top_k must be a number"),
    ({"temperature": True}, None, "temperature must be a number"),
    ({"seed": -1}, None, "seed must be an integer in [0, 2**64)"),
    ({"seed": 2 ** 70}, None, "seed must be an integer in [0, 2**64)"),
    ({"chat_template_kwargs": 5}, None, "chat_template_kwargs must be an object"),
    ({"tools": "x"}, None, "tools must be a list"),
    (None, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature must be a finite"),
    (None, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p must be"),
    (None, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature must be a finite"),
    (None, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}', "logit_bias[5]"),
    ({"messages": [{"role": "user", "content": 5}]}, None, "messages[0].content must be"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, None, "messages[0].content[0]"),
    ({"messages": [{"content": "hi"}]}, None, "messages[0].role must be a string"),
    ({"messages": [{"role": 7, "content": "hi"}]}, None, "messages[0].role must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}, 3]}, None, "messages[1] must be"),
    ({"model": "gpt-4"}, None, "'gpt-4' is not served"),
])
def test_bad_values_get_400_naming_the_field_and_the_server_goes_on(srv, extra, raw, needle):
    httpd, _ = srv
    if raw is not None:
        status, _, text = call(httpd, "/v1/chat/completions", raw=raw)
    else:
        status, _, text = chat(httpd, **extra)
    assert status in (400, 404), text
    assert (status == 404) == ("model" in (extra or {})), text
    assert needle in error_of(text), text
    assert ok_chat(httpd, kv_cache={"reuse": False})["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("method, field", [("kivi", "kivi_group_size"), ("turboquant_rvq", "residual_length"),
                                           ("streaming_llm", "stream_window_size")])
def test_huge_integer_settings_fail_that_request_alone(srv, method, field):
    """Whether the config layer refuses a huge integer (400 naming the field) or lets it reach the
    generation thread (which then fails: 500), the client gets a JSON error and the server goes on."""
    httpd, gen = srv
    for value in (2 ** 31, 10 ** 12):
        status, _, text = chat(httpd, kv_cache={"method": method, "settings": {field: value}, "reuse": False})
        assert status in (400, 500), text
        message = error_of(text)
        assert field in message if status == 400 else message.startswith("generation failed")
        assert ok_chat(httpd, kv_cache={"method": method, "reuse": False})
    assert gen.generation_available()


def test_template_errors_are_400_naming_the_messages_not_a_raw_python_error(srv):
    httpd, _ = srv
    # a template argument the template cannot take: the error names the template and the field
    status, _, text = chat(httpd, chat_template_kwargs={"messages": 3})
    assert status == 400, text
    assert error_of(text).startswith("messages (with tools and chat_template_kwargs) could not be rendered")


# --------------------------------------------------------------------------- 12, 13: failures in generation


@pytest.mark.parametrize("method", ["kivi", "snapkv", "none"])
def test_a_failing_generation_fails_that_request_alone(srv, model, method):
    """kivi: mlx_lm's batch loop (the failure escapes it: the loop restarts); snapkv: served one at a time,
    compressed; none: mlx_lm's own path. Each failed request gets a 500 JSON error; the next succeeds."""
    httpd, gen = srv
    spec = {"method": method, "reuse": False}
    before = counters(httpd)
    model.fail_in = 1
    status, _, text = chat(httpd, kv_cache=spec)
    assert status == 500, text
    assert "injected model failure" in error_of(text)
    assert model.fail_in is None
    after = ok_chat(httpd, kv_cache=spec)
    assert after["choices"][0]["message"]["content"]
    now = counters(httpd)
    assert now["errors"] == before["errors"] + 1
    assert gen.generation_available()


def test_a_seed_request_that_fails_after_it_started_gets_a_500_json(srv, model):
    """A request with a seed is served one at a time by mlx_lm's own loop; it fails after its context
    was handed to the handler (the old code dropped the connection)."""
    httpd, _ = srv
    model.fail_in = 2  # the prefill passes, the first decode step raises
    status, _, text = chat(httpd, seed=7, max_tokens=6, logit_bias={str(EOS): -100.0}, kv_cache={"reuse": False})
    assert status == 500, text
    assert "injected model failure" in error_of(text)
    assert ok_chat(httpd, seed=7, kv_cache={"reuse": False})


@pytest.mark.parametrize("method", ["kivi", "snapkv"])
def test_a_stream_that_fails_ends_with_an_error_event(srv, model, method):
    httpd, _ = srv
    before = counters(httpd)["errors"]
    model.fail_in = 8  # a few tokens ("b", forced by the bias) are streamed first
    status, _, text = chat(httpd, stream=True, max_tokens=30, logit_bias={"65": 100.0},
                           kv_cache={"method": method, "reuse": False})
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert any(e.get("choices") for e in events[:-1]), "tokens were streamed before the failure"
    assert events[-1]["error"]["status"] == 500
    assert "injected model failure" in events[-1]["error"]["message"]
    assert counters(httpd)["errors"] == before + 1


def test_a_request_waiting_behind_a_failed_batch_is_served(srv, model):
    """A (kivi, batched) is streaming when B (snapkv: no batch form, so it waits for A's batch to drain)
    arrives; then A's batch step raises. A ends with an error event; B, never started, is served by the
    restarted loop instead of failing with A."""
    httpd, gen = srv
    spec_a = {"messages": QUESTION, "max_tokens": 3000, "stream": True, "logit_bias": {"65": 100.0},
              "kv_cache": {"method": "kivi", "reuse": False}}
    body = json.dumps(spec_a).encode()
    before = counters(httpd)["requests"]
    result_b = []
    with socket.create_connection(address(httpd), timeout=TIMEOUT) as a:
        a.sendall(post_head(str(len(body)).encode(), body))
        got = b""
        while got.count(b"data: ") < 2:
            chunk = a.recv(4096)
            assert chunk, f"A's stream ended before two events: {got[-300:]!r}"  # (a closed socket: b"" forever)
            got += chunk
        b = threading.Thread(target=lambda: result_b.append(chat(httpd, kv_cache={"method": "snapkv", "reuse": False})))
        b.start()
        wait_for(lambda: gen.counters["requests"] == before + 2 and gen.requests.qsize() == 0,
                 "B to be taken off the queue by the generation loop")
        time.sleep(0.1)
        model.fail_in = 1
        while chunk := a.recv(65536):
            got += chunk
    b.join(TIMEOUT)
    last = [line for line in got.decode().splitlines() if line.startswith("data: {")][-1]
    assert "injected model failure" in json.loads(last[6:])["error"]["message"]
    status, _, text = result_b[0]
    assert status == 200, text


# --------------------------------------------------------------------------- 13, 16: bytes and sockets


def post_head(length: bytes, body: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + length + b"\r\n\r\n" + body)


@pytest.mark.parametrize("payload, needle", [
    (post_head(b"11", b'{"a": "\xff\xfe"}'), b"not valid UTF-8"),
    (post_head(b"1\xb2"), b"Content-Length must be a decimal byte count"),  # latin-1 superscript two
    (post_head(b"-5"), b"Content-Length must be a decimal byte count"),
    (post_head(b"\xd9\xa1"), b"Content-Length must be a decimal byte count"),
])
def test_bad_bytes_get_a_400_json_not_a_dropped_connection(srv, payload, needle):
    httpd, _ = srv
    reply = raw_exchange(httpd, payload)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", reply
    assert needle in json.loads(body)["error"].encode()


def test_a_client_that_stalls_its_body_is_dropped_after_the_socket_timeout(srv):
    """Ten connections promise 100 body bytes and send 10: each gets a 408 after the server's 1 s
    timeout and its handler thread ends (the old server kept one thread per such connection)."""
    httpd, _ = srv
    baseline = threading.active_count()
    socks = [socket.create_connection(address(httpd), timeout=TIMEOUT) for _ in range(10)]
    for s in socks:
        s.sendall(post_head(b"100", b"{" * 10))
    t0 = time.monotonic()
    for s in socks:
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        s.close()
        assert reply.split(b" ")[1] == b"408", reply
    assert time.monotonic() - t0 < 20
    wait_for(lambda: threading.active_count() <= baseline, "the stalled connections' threads to end", 10)


@pytest.mark.parametrize("method", ["kivi", "snapkv"])
def test_a_non_streaming_request_whose_client_left_is_cancelled(srv, model, method):
    """The client sends a 1000-token request and closes at once: generation stops after a few steps
    instead of running 1000 forward passes (EOS is banned, so only the cancellation can end it early)."""
    httpd, gen = srv
    before = counters(httpd)["cancelled_client_gone"]
    calls = model.calls
    body = json.dumps({"messages": QUESTION, "max_tokens": 1000, "logit_bias": {str(EOS): -100.0},
                       "kv_cache": {"method": method, "reuse": False}}).encode()
    with socket.create_connection(address(httpd), timeout=TIMEOUT) as s:
        s.sendall(post_head(str(len(body)).encode(), body))
    wait_for(lambda: counters(httpd)["cancelled_client_gone"] == before + 1, "the request to be cancelled")
    wait_for(lambda: not gen.stats()["live"], "the generation to stop")
    time.sleep(0.2)
    used = model.calls - calls
    assert used < 500, f"{used} forward passes for a request whose client had gone"
    assert ok_chat(httpd, kv_cache={"reuse": False})


def test_a_streaming_client_that_disconnects_leaves_no_traceback(srv, model, monkeypatch):
    """The server's ``handle_error`` (which prints a traceback) is never reached when a streaming
    client goes away mid-stream; the request is dropped and the server goes on."""
    httpd, gen = srv
    errors = []
    monkeypatch.setattr(httpd, "handle_error", lambda request, address: errors.append(sys.exc_info()))
    body = json.dumps({"messages": QUESTION, "max_tokens": 1000, "stream": True,
                       "logit_bias": {str(EOS): -100.0}, "kv_cache": {"reuse": False}}).encode()
    with socket.create_connection(address(httpd), timeout=TIMEOUT) as s:
        s.sendall(post_head(str(len(body)).encode(), body))
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(4096)
            assert chunk, f"the stream ended before three events: {got[-300:]!r}"
            got += chunk
    wait_for(lambda: not gen.stats()["live"], "the stream to stop")
    time.sleep(0.2)
    assert errors == [], [e[1] for e in errors]
    assert ok_chat(httpd, kv_cache={"reuse": False})


# --------------------------------------------------------------------------- 14: image URLs


def test_image_urls_are_refused_before_any_fetch(srv):
    hits = []

    class Counting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\x89PNG" + b"0" * 1000)

        def log_message(self, *args):
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    host, port = images.server_address[:2]
    httpd, _ = srv
    try:
        for part in ({"type": "image_url", "image_url": {"url": f"http://{host}:{port}/big.png"}},
                     {"type": "image_url", "image_url": f"http://{host}:{port}/other.png"},
                     {"type": "input_image", "image": f"http://{host}:{port}/third.png"}):
            messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
            status, _, text = chat(httpd, messages=messages)
            assert status == 400, text
            assert "messages[0].content[1]: image inputs are not supported" in error_of(text)
    finally:
        images.shutdown()
        images.server_close()
    assert hits == []


# --------------------------------------------------------------------------- 15: origins and keys


def test_no_cross_origin_access_by_default(srv):
    httpd, _ = srv
    status, headers, _ = call(httpd, "/v1/chat/completions", method="OPTIONS",
                              headers={"Origin": "http://evil.example"})
    assert status == 204 and "Access-Control-Allow-Origin" not in headers
    status, headers, text = call(httpd, "/v1/chat/completions", {"messages": QUESTION},
                                 headers={"Origin": "http://evil.example"})
    assert status == 403 and "origin 'http://evil.example' is not allowed" in error_of(text)
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, _ = call(httpd, "/v1/models")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_allowed_origin_and_api_key(loaded):
    httpd, gen = start(loaded, api_key="s3cret", cli={"allowed_origins": ["http://localhost:3000"]})
    try:
        good = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, got, text = call(httpd, "/v1/chat/completions", {"messages": QUESTION}, headers=headers)
            assert status == 401 and "API key" in error_of(text) and got.get("WWW-Authenticate") == "Bearer"
            status, _, text = call(httpd, "/v1/kv/stats", headers=headers)
            assert status == 401
        status, got, text = call(httpd, "/v1/chat/completions", {"messages": QUESTION},
                                 headers={**good, "Origin": "http://localhost:3000"})
        assert status == 200, text
        assert got["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, _, _ = call(httpd, "/v1/chat/completions", {"messages": QUESTION},
                            headers={**good, "Origin": "http://localhost:4000"})
        assert status == 403
        status, _, text = call(httpd, "/v1/kv/stats", headers=good)
        assert status == 200 and json.loads(text)["counters"]["errors"] == 7
    finally:
        S.shutdown(httpd, gen)


# --------------------------------------------------------------------------- 7 and 2: counters, ids, ratio


def test_errors_counter_counts_4xx_and_responses_name_the_served_model(srv):
    httpd, _ = srv
    before = counters(httpd)["errors"]
    assert call(httpd, "/v1/chat/completions", raw=b"{not json")[0] == 400
    assert chat(httpd, top_k=-1)[0] == 400
    assert chat(httpd, model="nope")[0] == 404
    assert call(httpd, "/v1/nowhere", {"x": 1})[0] == 404
    assert counters(httpd)["errors"] == before + 4
    out = ok_chat(httpd)
    assert out["model"] == SERVED_ID
    out = json.loads(call(httpd, "/v1/completions", {"prompt": "abc", "max_tokens": 2})[2])
    assert out["model"] == SERVED_ID


def test_stats_report_the_fraction_of_fp16_bytes(srv):
    httpd, _ = srv
    ok_chat(httpd, messages=[{"role": "user", "content": "x" * 300}])
    status, _, text = call(httpd, "/v1/kv/stats")
    cached = [e for e in json.loads(text)["cached"] if e["method"] == "kivi"]
    assert cached
    for entry in cached:
        assert "ratio_vs_fp16" not in entry
        assert math.isclose(entry["kv_fraction_of_fp16"], entry["kv_bytes"] / entry["kv_bytes_fp16"])


def test_serve_cli_refuses_bad_access_options_before_loading(capsys):
    from veloxquant_mlx.cli import main as cli_main

    assert cli_main(["serve", "--socket-timeout", "0"]) == 2
    assert "--socket-timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err
    assert cli_main(["serve", "--socket-timeout", "nan"]) == 2
    assert cli_main(["serve", "--api-key", " "]) == 2
    assert "--api-key must not be empty" in capsys.readouterr().err


# --------------------------------------------------------------------------- refused before generation, not a 500


@pytest.mark.parametrize("options, needle", [
    (5, "stream_options must be an object"),
    ([1], "stream_options must be an object"),
    ({"include_usage": "x"}, "stream_options.include_usage must be true or false"),
])
def test_malformed_stream_options_get_a_400_not_a_failed_stream(srv, options, needle):
    httpd, _ = srv
    status, _, text = chat(httpd, stream=True, stream_options=options, kv_cache={"reuse": False})
    assert status == 400, text
    assert needle in error_of(text)


@pytest.mark.parametrize("options", [{}, {"include_usage": None}])
def test_empty_stream_options_stream_without_usage_and_without_error(srv, options):
    httpd, _ = srv
    status, _, text = chat(httpd, stream=True, stream_options=options, kv_cache={"reuse": False})
    assert status == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events and not any("error" in e for e in events), text
    assert not any("usage" in e for e in events)


@pytest.mark.parametrize("field", ["repetition_context_size", "presence_context_size", "frequency_context_size"])
def test_huge_context_sizes_are_refused_before_they_fail_the_generation_loop(srv, field):
    httpd, gen = srv
    failures = counters(httpd)["generation_failures"]
    status, _, text = chat(httpd, **{field: 10 ** 15}, kv_cache={"reuse": False})
    assert status == 400, text
    assert field in error_of(text)
    assert counters(httpd)["generation_failures"] == failures
    assert ok_chat(httpd, **{field: 2 ** 20}, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                   kv_cache={"reuse": False})


@pytest.mark.parametrize("name", ["tokenize", "tools", "add_generation_prompt"])
def test_chat_template_kwargs_that_the_server_sets_get_a_400(srv, name):
    httpd, _ = srv
    status, _, text = chat(httpd, chat_template_kwargs={name: False}, kv_cache={"reuse": False})
    assert status == 400, text
    assert name in error_of(text)


def test_a_per_layer_bit_list_in_kv_cache_settings_is_served(srv):
    httpd, _ = srv
    spec = {"method": "kivi", "settings": {"bit_width_inlier": [2, 4]}}
    for _ in range(2):  # the second one may reuse the first one's prefix
        assert ok_chat(httpd, kv_cache=spec)["choices"][0]["message"]["content"]
    status, _, text = call(httpd, "/v1/kv/stats")
    assert status == 200
    assert any(e["settings"] == {"bit_width_inlier": [2, 4]} for e in json.loads(text)["cached"]), text
    hash(S.parse_kv_settings("kivi", {"bit_width_inlier": [2, 4]}).key)
    scaling = {"type": "linear", "factor": [2.0]}  # a dict setting: hashable too, still an object in JSON
    kv = S.parse_kv_settings("a2ats", {"a2ats_rope_scaling": scaling})
    reordered = S.parse_kv_settings("a2ats", {"a2ats_rope_scaling": dict(reversed(scaling.items()))})
    assert hash(kv.key) == hash(reordered.key)
    assert json.loads(json.dumps(kv.describe()["settings"])) == {"a2ats_rope_scaling": scaling}


@pytest.mark.parametrize("settings", [[], "", 0, False])
def test_kv_cache_settings_that_are_not_an_object_are_refused_even_when_empty(srv, settings):
    httpd, _ = srv
    status, _, text = chat(httpd, kv_cache={"method": "kivi", "settings": settings})
    assert status == 400, text
    assert "kv_cache.settings must be an object" in error_of(text)


@pytest.mark.parametrize("method", ["kivi", "snapkv", "none"])
def test_an_empty_prompt_gets_a_400_and_fails_no_generation_loop(srv, method):
    httpd, _ = srv
    failures = counters(httpd)["generation_failures"]
    for stream in (False, True):
        status, _, text = call(httpd, "/v1/completions", {"prompt": "", "max_tokens": 2, "stream": stream,
                                                          "kv_cache": {"method": method, "reuse": False}})
        assert status == 400, text
        assert "prompt" in error_of(text) and "no tokens" in error_of(text)
    assert counters(httpd)["generation_failures"] == failures
    status, _, text = call(httpd, "/v1/completions", {"prompt": "a", "max_tokens": 2, "kv_cache": {"method": method}})
    assert status == 200, text


def test_stats_answer_with_a_query_string(srv):
    httpd, _ = srv
    status, _, text = call(httpd, "/v1/kv/stats?t=123")
    assert status == 200, text
    assert "counters" in json.loads(text)


# --------------------------------------------------------------------------- /v1/models/ID, repeated keys


def test_models_endpoint_lists_or_retrieves_one_model_and_404s_an_unknown_id(srv, loaded):
    """OpenAI's ``GET /v1/models/{model}``: the model object of a served id (or a name a request may use for it),
    a 404 with an OpenAI error object for any other id; ``/v1/models`` (a query, a trailing slash) lists."""
    httpd, _ = srv
    for path in ("/v1/models", "/v1/models/", "/v1/models?x=1"):
        status, _, text = call(httpd, path)
        assert status == 200 and json.loads(text)["object"] == "list", (path, text)
        assert [m["id"] for m in json.loads(text)["data"]] == [SERVED_ID]
    listed = json.loads(text)["data"][0]
    for path in (f"/v1/models/{SERVED_ID}", f"/v1/models/{SERVED_ID}/", f"/v1/models/{SERVED_ID}?x=1",
                 "/v1/models/default_model"):
        status, _, text = call(httpd, path)
        assert status == 200 and json.loads(text) == listed, (path, text)
    for path, name in (("/v1/models/gpt-4o", "gpt-4o"), (f"/v1/models/{SERVED_ID}x", f"{SERVED_ID}x"),
                       (f"/v1/models/{SERVED_ID}/extra", f"{SERVED_ID}/extra")):
        status, _, text = call(httpd, path)
        assert status == 404, (path, text)
        assert json.loads(text) == {"error": {"message": f"The model {name!r} does not exist; this server serves "
                                                         f"{SERVED_ID!r}", "type": "invalid_request_error",
                                              "param": "model", "code": "model_not_found"}}
    status, _, text = call(httpd, "/v1/modelsx")
    assert status == 404 and "data" not in text
    other, gen = S.make_server(S.parse_kv_settings("kivi", {}), S.server_args("org/tiny-model", port=0),
                               loaded=loaded)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:  # a Hugging Face id holds a slash, sent as is or percent-encoded
        for path in ("/v1/models/org/tiny-model", "/v1/models/org%2Ftiny-model"):
            status, _, text = call(other, path)
            assert status == 200 and json.loads(text)["id"] == "org/tiny-model", (path, text)
    finally:
        S.shutdown(other, gen)
