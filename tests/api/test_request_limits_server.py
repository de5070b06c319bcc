"""The hardening issue's table against a real ``cadence serve`` (the tiny model): each hostile or
careless request gets its status and OpenAI's error body, the HTTP parser's errors included
(``connection.py``), and ``/health`` answers while a slow upload is in flight (by order: see
``test_slow_requests.py``)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import aiohttp
import httpx
import pytest
from support.openai_spec import OpenAISpec

from cadence.api.testing import ServerProcess

HANG_S = 60.0
MAX_BODY = 4 * 2**20  # the default


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., ContextManager[ServerProcess]]) -> Iterator[ServerProcess]:
    with serve_tiny("--request-read-timeout", "2") as process:
        yield process


def raw_exchange(server: ServerProcess, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """Send ``request`` as it is; the answer's head and JSON body, read until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return head, json.loads(body)


def check_error(spec: OpenAISpec, status: int, body: dict[str, Any], expected_status: int, code: str | None,
                param: str | None = None) -> None:
    assert status == expected_status, body
    spec.validate(body, "ErrorResponse")
    assert (body["error"]["code"], body["error"]["param"]) == (code, param), body


def post(server: ServerProcess, body: Any, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = kwargs.pop("headers", {"Content-Type": "application/json"})
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=HANG_S, **kwargs)


@pytest.mark.parametrize(("name", "request_bytes"), [
    ("bare LF", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Note: a\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\n\r\n{}"),
    ("100 KB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n"),
])
def test_what_the_http_parser_rejects_is_a_400_in_openai_shape(server: ServerProcess, spec: OpenAISpec, name: str,
                                                               request_bytes: bytes) -> None:
    head, body = raw_exchange(server, request_bytes)
    assert head.split(b" ", 2)[1] == b"400" and b"Content-Type: application/json" in head, head
    spec.validate(body, "ErrorResponse")
    assert body["error"]["code"] == "bad_http_request"
    assert body["error"]["message"].startswith("the HTTP request could not be parsed: ")
    assert server.health() == 200


def test_a_body_shorter_than_its_content_length_is_408_and_closed(server: ServerProcess, spec: OpenAISpec) -> None:
    head, body = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Paris\"}")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, head
    check_error(spec, 408, body, 408, "request_timeout")
    assert "within 2 s (--request-read-timeout)" in body["error"]["message"]


def test_a_50_mb_prompt_is_413_at_once(server: ServerProcess, spec: OpenAISpec) -> None:
    response = post(server, {"prompt": "a" * (50 * 2**20)})
    check_error(spec, response.status_code, response.json(), 413, "request_too_large")
    assert f"limit is {MAX_BODY} bytes (--max-request-body-bytes)" in response.json()["error"]["message"]


def test_a_prompt_no_tokenization_can_fit_is_refused_without_tokenizing(server: ServerProcess,
                                                                        spec: OpenAISpec) -> None:
    for path, body, param in [("/v1/completions", {"prompt": "word " * 600_000}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600_000}]},
                               "messages")]:
        response = post(server, body, path)
        check_error(spec, response.status_code, response.json(), 400, "context_length_exceeded", param)
        assert "bytes can fit; this one has 3000000 bytes" in response.json()["error"]["message"]


@pytest.mark.parametrize(("name", "body", "param", "code"), [
    ("seed 2**64", {"prompt": "x", "seed": 2**64}, "seed", None),
    ("seed + n over 64 bits", {"prompt": "x", "seed": 2**63 - 1, "n": 2}, "seed", None),
    ("priority 2**80", {"prompt": "x", "priority": 2**80}, "priority", None),
    ("token id 2**40", {"prompt": [5, 2**40]}, "prompt[1]", None),
    ("stop token id 2**64", {"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids[0]", None),
    ("logit_bias key 2**63", {"prompt": "x", "logit_bias": {str(2**63): 1}}, "logit_bias", None),
    ("max_tokens 2**63", {"prompt": "x", "max_tokens": 2**63}, "max_tokens", None),
    # A schema travels to the engine core as its text: numbers xgrammar ignores never meet msgpack.
    ("schema with a 2**80", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": {
        "type": "string", "maxLength": 4, "default": 2**80}}}, None, "ok"),
    # ... and one it does not ignore is a 400 from the check.
    ("schema bound 2**80", {"prompt": "x", "structured_outputs": {"json": {"type": "integer", "maximum": 2**80}}},
     "structured_outputs.json", None),
], ids=lambda v: v if isinstance(v, str) else None)
def test_numbers_the_engine_cannot_carry_are_400_not_500(server: ServerProcess, spec: OpenAISpec, name: str,
                                                         body: dict[str, Any], param: str | None,
                                                         code: str | None) -> None:
    response = post(server, body)
    if code == "ok":
        assert response.status_code == 200, response.text
        return
    check_error(spec, response.status_code, response.json(), 400, code, param)


def test_deep_nesting_in_an_unknown_field_is_a_400(server: ServerProcess, spec: OpenAISpec) -> None:
    response = post(server, b'{"prompt": "x", "frobnicate": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    check_error(spec, response.status_code, response.json(), 400, "json_too_deep")


def test_text_plain_is_415(server: ServerProcess, spec: OpenAISpec) -> None:
    response = post(server, {"prompt": "x"}, headers={"Content-Type": "text/plain"})
    check_error(spec, response.status_code, response.json(), 415, "unsupported_content_type")


def test_empty_content_parts_are_a_400(server: ServerProcess, spec: OpenAISpec) -> None:
    response = post(server, {"messages": [{"role": "user", "content": []}]}, "/v1/chat/completions")
    check_error(spec, response.status_code, response.json(), 400, None, "messages[0].content")


@pytest.mark.parametrize("regex", [r"(a+)+$", r"((a|a)*)*b{1000}"])
def test_the_issues_catastrophic_regexes_are_served(server: ServerProcess, regex: str) -> None:
    response = post(server, {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": regex}})
    assert response.status_code == 200, response.text


def test_health_answers_during_a_huge_upload_which_is_then_413(server: ServerProcess, spec: OpenAISpec) -> None:
    """A 50 MB chunked body (no Content-Length): the server reads it as it comes, answering
    ``/health`` meanwhile, and refuses it once it passes the limit."""
    async def run() -> None:
        sent_first = asyncio.Event()
        health_seen = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield b'{"prompt": "' + b"a" * 2**20
            sent_first.set()
            await health_seen.wait()
            for _ in range(49):
                yield b"a" * 2**20
            yield b'"}'

        async with aiohttp.ClientSession() as session:
            async def upload() -> tuple[int, Any]:
                try:
                    async with session.post(f"{server.url}/v1/completions", data=body(),
                                            headers={"Content-Type": "application/json"}) as response:
                        return response.status, await response.json()
                except aiohttp.ClientError as exc:  # the server answered and closed while the body still came
                    return 0, exc

            slow = asyncio.ensure_future(upload())
            await sent_first.wait()
            async with session.get(f"{server.url}/health") as health:
                assert health.status == 200
            assert not slow.done()
            health_seen.set()
            status, answer = await asyncio.wait_for(slow, HANG_S)
            if status:
                check_error(spec, status, answer, 413, "request_too_large")

    asyncio.run(run())
    assert server.health() == 200
