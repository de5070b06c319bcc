"""Server-sent events: ``data: {chunk}`` per event, ``data: [DONE]`` at the end.

A failure once the stream has started cannot change the status any more: it is sent as one
``data: {"error": {...}}`` event (which OpenAI's clients raise as an error), and the stream closes
without ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from aiohttp import web
from msgspec import Struct

from cadence.api.errors import APIError
from cadence.api.protocol import encode

logger = logging.getLogger(__name__)


class SSEStream:
    """One streamed response. Writes are serialised: several prompts' tasks may send at once."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # tells a proxy in front not to buffer the stream
        })
        self._lock = anyio.Lock()

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, chunk: Struct) -> None:
        await self._write(b"data: " + encode(chunk) + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, error: APIError) -> None:
        with contextlib.suppress(ConnectionError):
            await self._write(b"data: " + encode(error.body()) + b"\n\n")
            await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        async with self._lock:
            await self.response.write(data)


async def stream_response(request: web.Request, produce: Callable[[SSEStream], Awaitable[None]]
                          ) -> web.StreamResponse:
    """Open an event stream, let ``produce`` fill it, and close it with ``[DONE]`` or an error event."""
    return await run_stream(SSEStream(request), produce)


S = TypeVar("S", bound=SSEStream)


async def run_stream(stream: S, produce: Callable[[S], Awaitable[None]]) -> web.StreamResponse:
    """Open ``stream``, let ``produce`` fill it, and end it its way (``done``), or with its error
    event (``fail``): an ``APIError`` as it is, anything else as a 500."""
    request = stream.request
    await stream.open()
    try:
        await produce(stream)
        await stream.done()
    except APIError as exc:
        await stream.fail(exc)
    except ConnectionError:
        # The client left; its generation was aborted on the way out.
        logger.debug("client of %s disconnected mid-stream", request.path)
    except Exception as exc:
        logger.exception("stream of %s failed", request.path)
        await stream.fail(APIError(500, f"internal error while streaming: {type(exc).__name__}: {exc}",
                                   code="internal_error"))
    return stream.response
