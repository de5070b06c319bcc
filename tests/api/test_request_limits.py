"""What a hostile or careless client can send, refused at the edge with the right status and OpenAI's
error body (``cadence/api/request_body.py``, ``protocol.py``'s ranges, ``params.py``'s prompt bound,
the 503's ``Retry-After``), in-process over a scripted engine. Slow requests and ``/health`` are in
``test_slow_requests.py``; the HTTP parser's errors and a real server in
``test_request_limits_server.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support.openai_spec import OpenAISpec
from support.scripted_engine import ScriptedEngine, out, step

from cadence.api.app import build_app
from cadence.api.connection import APIRunner
from cadence.api.errors import APIError
from cadence.api.limits import MAX_JSON_DEPTH
from cadence.api.params import TextBound, longest_token_bytes
from cadence.api.protocol import CompletionRequest
from cadence.api.request_body import decode_request, json_depth
from cadence.api.serving import ServerSettings

JSON = {"Content-Type": "application/json"}
PROMPT = {"prompt": "Paris"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda call: [step(*(out(i, "x", [5], "stop") for i in range(call.request.params.n)))])


def send(path: str, data: bytes | AsyncIterator[bytes], headers: dict[str, str] | None = None, *,
         target: ScriptedEngine | None = None, **settings: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    """POST raw ``data`` to the app; its status, JSON body and headers."""
    async def run() -> tuple[int, dict[str, Any], dict[str, str]]:
        app = build_app(target or engine(), ServerSettings(served_model_names=("m",), **settings))  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            # Without a Content-Type given, none is sent (aiohttp's client would add one).
            response = await client.post(path, data=data, headers=JSON if headers is None else headers,
                                         skip_auto_headers=() if headers is None or headers else ("Content-Type",))
            return response.status, await response.json(), dict(response.headers)
    return asyncio.run(run())


def assert_error(spec: OpenAISpec, reply: tuple[int, dict[str, Any], dict[str, str]], status: int,
                 code: str | None, param: str | None = None) -> str:
    """The reply is ``status`` in OpenAI's shape with ``code`` and ``param``; its message."""
    got, body, _ = reply
    assert got == status, body
    spec.validate(body, "ErrorResponse")
    assert (body["error"]["code"], body["error"]["param"]) == (code, param), body
    message: str = body["error"]["message"]
    return message


# ---- json_depth ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "depth"), [
    (b"1", 0), (b'"[[["', 0), (b"[]", 1), (b"{}", 1), (b'{"a": [1, {"b": [[]]}]}', 5),
    (b'{"a": "[[[{{{"}', 1),  # brackets in strings do not nest
    (b'{"a": "\\"[["}', 1),  # nor after an escaped quote
    (b'{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash ends with the string's real quote
    (b'["\\\\\\"[", [[]]]', 3),
    (b'{"a": "[[[', 1),  # an unterminated string: the rest is inside it
    (b"]]]", 0), (b"[" * 100_000, 100_000),
])
def test_json_depth_counts_nesting_outside_strings(text: bytes, depth: int) -> None:
    assert json_depth(text) == depth


def test_nesting_deeper_than_the_limit_is_a_400_anywhere_even_in_an_unknown_field() -> None:
    def body(depth: int, field: str) -> bytes:
        return b'{"prompt": "x", "' + field.encode() + b'": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    assert decode_request(body(MAX_JSON_DEPTH, "frobnicate"), CompletionRequest).prompt == "x"
    for depth, field in ((MAX_JSON_DEPTH + 1, "frobnicate"), (10_000, "frobnicate"), (10_000, "stop")):
        with pytest.raises(APIError) as info:
            decode_request(body(depth, field), CompletionRequest)
        assert (info.value.status, info.value.code) == (400, "json_too_deep")
        assert f"{depth} deep; the limit is {MAX_JSON_DEPTH}" in info.value.message


# ---- the body: media type, size, encoding, nesting -------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/jsonl",
                                          "application/json; charset=latin-1", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_that_is_not_declared_json_is_415(spec: OpenAISpec, path: str, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = send(path, json.dumps(PROMPT).encode(), headers)
    message = assert_error(spec, reply, 415, "unsupported_content_type")
    assert "application/json" in message and (content_type or "no Content-Type header") in message


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON; charset=UTF-8"])
def test_json_with_or_without_a_utf8_charset_is_accepted(content_type: str) -> None:
    status, body, _ = send("/v1/completions", json.dumps(PROMPT).encode(), {"Content-Type": content_type})
    assert status == 200, body


def test_a_body_over_the_limit_is_413_whether_announced_or_streamed(spec: OpenAISpec) -> None:
    big = json.dumps({"prompt": "x" * 2000}).encode()
    message = assert_error(spec, send("/v1/completions", big, max_request_body_bytes=1000), 413, "request_too_large")
    assert message == (f"the request body is too large: its Content-Length is {len(big)} bytes; this server's "
                       "limit is 1000 bytes (--max-request-body-bytes)")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: found too large while read
        for i in range(0, len(big), 100):
            yield big[i:i + 100]

    message = assert_error(spec, send("/v1/completions", chunked(), max_request_body_bytes=1000), 413,
                           "request_too_large")
    assert message == ("the request body is too large: it grew past 1000 bytes while read; this server's limit is "
                       "1000 bytes (--max-request-body-bytes)")
    # At the limit exactly it is read.
    body = json.dumps({"prompt": "ab"}).encode()
    assert send("/v1/completions", body, max_request_body_bytes=len(body))[0] == 200


def test_invalid_utf8_is_a_400_even_in_an_unknown_field(spec: OpenAISpec) -> None:
    for raw in (b'{"prompt": "\xff"}', b'{"prompt": "x", "frobnicate": "\xc3\x28"}'):
        message = assert_error(spec, send("/v1/completions", raw), 400, None)
        assert message.startswith("the request body is not valid UTF-8")


def test_deep_nesting_through_the_app_is_a_400(spec: OpenAISpec) -> None:
    raw = b'{"prompt": "x", "frobnicate": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    assert_error(spec, send("/v1/completions", raw), 400, "json_too_deep")


# ---- numbers the engine cannot carry -----------------------------------------------------------


INT64 = 2**63
BAD_NUMBERS = [
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": INT64}, "seed"),
    ("/v1/completions", {"seed": -INT64 - 1}, "seed"),
    ("/v1/completions", {"seed": INT64 - 1, "n": 2}, "seed"),  # the second sequence's seed + 1 overflows
    ("/v1/completions", {"priority": 2**80}, "priority"),
    ("/v1/completions", {"priority": 2**31}, "priority"),
    ("/v1/completions", {"prompt": [5, 2**31]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [[5], [2**64]]}, "prompt[1][0]"),
    ("/v1/completions", {"prompt": [5, -1]}, "prompt[1]"),
    ("/v1/completions", {"stop_token_ids": [2**31]}, "stop_token_ids[0]"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/completions", {"logit_bias": {str(2**31): 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 1e300}}, "logit_bias"),
    ("/v1/completions", {"max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"min_tokens": 2**40}, "min_tokens"),
    ("/v1/completions", {"top_k": 2**31}, "top_k"),
    ("/v1/completions", {"logprobs": 2**64}, "logprobs"),
    ("/v1/completions", {"best_of": 2**64}, "best_of"),
    ("/v1/completions", {"n": 2**64}, "n"),
    ("/v1/completions", {"temperature": 1e999}, "temperature"),  # JSON's "infinity": out of range, not inf
    ("/v1/completions", {"repetition_penalty": 1e300}, "repetition_penalty"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**31}, "max_completion_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2**64, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"priority": -(2**31) - 1}, "priority"),
    ("/detokenize", {"tokens": [2**64]}, "tokens[0]"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD_NUMBERS, ids=[f"{p} {f}"[:60] for p, f, _ in BAD_NUMBERS])
def test_a_number_out_of_range_is_a_400_naming_the_field(spec: OpenAISpec, path: str, fields: dict[str, Any],
                                                         param: str) -> None:
    base = CHAT if path == "/v1/chat/completions" else {} if path == "/detokenize" else PROMPT
    # json.dumps cannot write 1e999: written by hand.
    raw = json.dumps({**base, **fields}).replace("Infinity", "1e999").encode()
    assert_error(spec, send(path, raw), 400, None, param)


@pytest.mark.parametrize("fields", [{"seed": INT64 - 1}, {"seed": -INT64}, {"seed": INT64 - 2, "n": 2},
                                    {"priority": 2**31 - 1}, {"priority": -(2**31)}])
def test_the_extremes_in_range_reach_the_engine(fields: dict[str, Any]) -> None:
    target = engine()
    status, body, _ = send("/v1/completions", json.dumps({**PROMPT, **fields}).encode(), target=target)
    assert status == 200, body
    [call] = target.calls
    assert (call.request.params.seed, call.priority) == (fields.get("seed"), fields.get("priority", 0))


# ---- empty but required ------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": []}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs"),
])
def test_an_empty_required_value_is_a_400_naming_the_field(spec: OpenAISpec, path: str, body: dict[str, Any],
                                                           param: str) -> None:
    assert_error(spec, send(path, json.dumps(body).encode()), 400, None, param)


# ---- a text that cannot fit the context -------------------------------------------------------


class CountingTokenizer:
    """The tiny tokenizer, counting what it is asked to tokenize or render."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner.apply_chat_template(*args, **kwargs)


def test_a_text_too_long_for_any_tokenization_to_fit_is_refused_untokenized(spec: OpenAISpec) -> None:
    target = engine()
    tokenizer = target.tokenizer = CountingTokenizer(target.tokenizer)
    bound = TextBound(target.limits.max_model_len, longest_token_bytes(tokenizer))
    assert bound.max_bytes == 64 * max(len(t.encode()) for t in tokenizer.get_vocab())
    over = "é" * (bound.max_bytes // 2 + 1)  # 2 bytes a character
    for path, body, param in [("/v1/completions", {"prompt": over}, "prompt"),
                              ("/v1/completions", {"prompt": ["Paris", over]}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "messages"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": over[:len(over) // 2]},
                                                                    {"role": "user", "content": over}]}, "messages")]:
        message = assert_error(spec, send(path, json.dumps(body).encode(), target=target), 400,
                               "context_length_exceeded", param)
        assert f"no prompt over {bound.max_bytes} bytes can fit" in message
    assert tokenizer.calls == 0
    # At the bound a text is tokenized (and then found too long by its token count).
    at = "a" * bound.max_bytes
    assert_error(spec, send("/v1/completions", json.dumps({"prompt": at}).encode(), target=target), 400,
                 "context_length_exceeded", "prompt")
    assert tokenizer.calls == 1


# ---- overload ----------------------------------------------------------------------------------


def test_the_overload_503_says_when_to_retry(spec: OpenAISpec) -> None:
    target = engine()
    target.num_pending_requests = 4
    reply = send("/v1/completions", json.dumps(PROMPT).encode(), target=target, max_waiting_requests=4)
    assert_error(spec, reply, 503, "engine_overloaded")
    assert reply[2]["Retry-After"] == "1"
    assert target.calls == []


def test_a_batch_larger_than_the_server_admits_is_a_400_not_a_retry(spec: OpenAISpec) -> None:
    reply = send("/v1/completions", json.dumps({"prompt": ["a"] * 5}).encode(), max_waiting_requests=4)
    message = assert_error(spec, reply, 400, None, "prompt")
    assert "5 prompts" in message and "Retry-After" not in reply[2]


# ---- what the HTTP parser rejects ------------------------------------------------------------


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Note: a\nContent-Length: 2\r\n\r\n{}",  # a bare LF
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",  # too many headers
])
def test_the_http_parsers_errors_leave_in_openai_shape(spec: OpenAISpec, request_bytes: bytes) -> None:
    head, _, body = asyncio.run(exchange(request_bytes)).partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400" and b"Content-Type: application/json" in head, head
    error = json.loads(body)
    spec.validate(error, "ErrorResponse")
    assert error["error"]["code"] == "bad_http_request" and "\n" not in error["error"]["message"]


def test_a_connection_that_trickles_its_headers_is_closed_at_the_keepalive_timeout() -> None:
    async def trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(int(60 / 0.05)):
                writer.write(b"X-More: a\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)

    # The server closes it, headers unfinished: read() returns what it sent (nothing) at the close.
    assert asyncio.run(exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n", trickle, keepalive_timeout=0.3)) == b""


async def exchange(request_bytes: bytes, then: Callable[[asyncio.StreamWriter], Awaitable[None]] | None = None,
                   **runner_options: Any) -> bytes:
    """Send ``request_bytes`` to the app served as ``cadence serve`` serves it (``APIRunner``),
    then run ``then`` while reading what comes back until the server closes the connection."""
    runner = APIRunner(build_app(engine(), ServerSettings(served_model_names=("m",))),  # type: ignore[arg-type]
                       access_log=None, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(request_bytes)
        extra = asyncio.ensure_future(then(writer)) if then is not None else None
        answer = await asyncio.wait_for(reader.read(), 60)  # to the close
        if extra is not None:
            extra.cancel()
        writer.close()
        return answer
    finally:
        await runner.cleanup()
