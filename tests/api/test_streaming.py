"""Server-sent events (``cadence/api/streaming.py``): ``data: {chunk}\\n\\n`` framing, ``data: [DONE]`` at
the end, and a failure once the stream has started sent as one error event in OpenAI's shape, after
which the stream closes without ``[DONE]``; a client that left gets nothing more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import anyio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from msgspec import Struct
from support.openai_spec import OpenAISpec

from cadence.api.errors import APIError
from cadence.api.streaming import SSEStream, stream_response

Produce = Callable[[SSEStream], Awaitable[None]]


class Chunk(Struct):
    n: int
    text: str = ""


def serve(produce: Produce) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and raw body of one streamed response that ``produce`` fills."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_response(request, produce)

    async def run() -> tuple[int, dict[str, str], bytes]:
        app = web.Application()
        app.router.add_post("/stream", handler)
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/stream")
            return response.status, dict(response.headers), await response.read()

    return asyncio.run(run())


def sending(*chunks: Chunk, then: BaseException | None = None) -> Produce:
    async def produce(stream: SSEStream) -> None:
        for chunk in chunks:
            await stream.send(chunk)
        if then is not None:
            raise then
    return produce


def test_each_chunk_is_one_data_event_and_done_ends_the_stream() -> None:
    status, headers, body = serve(sending(Chunk(1, "a"), Chunk(2, "b\nc")))
    assert status == 200
    assert body == b'data: {"n":1,"text":"a"}\n\ndata: {"n":2,"text":"b\\nc"}\n\ndata: [DONE]\n\n'
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache"
    assert headers["X-Accel-Buffering"] == "no"


def test_a_stream_without_chunks_is_only_done() -> None:
    status, _, body = serve(sending())
    assert (status, body) == (200, b"data: [DONE]\n\n")


def test_an_api_error_mid_stream_is_one_error_event_and_no_done(spec: OpenAISpec) -> None:
    error = APIError(503, "the server is overloaded", code="engine_overloaded")
    status, _, body = serve(sending(Chunk(1, "a"), then=error))
    assert status == 200  # the status went out with the first chunk
    first, second, tail = body.split(b"\n\n")
    assert (first, tail) == (b'data: {"n":1,"text":"a"}', b"")
    assert second.startswith(b"data: ") and b"[DONE]" not in body
    event = json.loads(second[len(b"data: "):])
    spec.validate(event, "ErrorResponse")
    assert event == {"error": {"message": "the server is overloaded", "type": "server_error", "param": None,
                               "code": "engine_overloaded"}}


def test_an_api_error_before_any_chunk_keeps_its_param_and_type(spec: OpenAISpec) -> None:
    status, _, body = serve(sending(then=APIError(400, "bad value", param="n")))
    assert status == 200
    assert body == (b'data: {"error":{"message":"bad value","type":"invalid_request_error","param":"n",'
                    b'"code":null}}\n\n')
    spec.validate(json.loads(body[len(b"data: "):]), "ErrorResponse")


def test_an_unexpected_exception_becomes_an_internal_error_event(spec: OpenAISpec) -> None:
    status, _, body = serve(sending(Chunk(7), then=RuntimeError("boom")))
    assert status == 200
    events = [part[len(b"data: "):] for part in body.split(b"\n\n") if part]
    assert events[0] == b'{"n":7,"text":""}' and len(events) == 2
    error = json.loads(events[1])
    spec.validate(error, "ErrorResponse")
    assert error == {"error": {"message": "internal error while streaming: RuntimeError: boom",
                               "type": "server_error", "param": None, "code": "internal_error"}}


def test_a_client_that_left_gets_neither_an_error_event_nor_done() -> None:
    status, _, body = serve(sending(Chunk(1), then=ConnectionResetError("gone")))
    assert (status, body) == (200, b'data: {"n":1,"text":""}\n\n')


def test_concurrent_senders_never_interleave_within_an_event() -> None:
    async def produce(stream: SSEStream) -> None:
        async with anyio.create_task_group() as group:
            for i in range(20):
                group.start_soon(stream.send, Chunk(i, "x" * 4096))

    status, _, body = serve(produce)
    assert status == 200
    *events, done, tail = body.split(b"\n\n")
    assert (done, tail) == (b"data: [DONE]", b"")
    decoded = [json.loads(event[len(b"data: "):]) for event in events]
    assert sorted(e["n"] for e in decoded) == list(range(20))
    assert all(e["text"] == "x" * 4096 for e in decoded)
