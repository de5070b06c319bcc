"""The Responses API's stream: its typed events, and the server-sent-event stream that numbers and
sends them as OpenAI does (``event: TYPE`` and ``data: {...}`` per event, ``sequence_number`` from 0,
no ``[DONE]``).

Each output item streams as ``response.output_item.added``, its content part opened
(``response.content_part.added``), its text in deltas (``response.output_text.delta``,
``response.reasoning_text.delta``) or a call's arguments in deltas
(``response.function_call_arguments.delta``), each closed by its ``.done``, then
``response.output_item.done``; around them ``response.created``, ``response.in_progress`` and
``response.completed`` (or ``response.incomplete``). A failure once the stream has started is one
``error`` event, and the stream ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from msgspec import Struct

from cadence.api.errors import APIError
from cadence.api.protocol import encode
from cadence.api.responses_protocol import OutputItem, OutputText, ReasoningText, Response
from cadence.api.streaming import SSEStream, run_stream

logger = logging.getLogger(__name__)


class Event(Struct, kw_only=True, tag_field="type"):
    """One stream event; :class:`EventStream` numbers it as it goes out."""

    sequence_number: int = 0


class ResponseCreated(Event, tag="response.created"):
    response: Response


class ResponseInProgress(Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(Event, tag="response.incomplete"):
    response: Response


class OutputItemAdded(Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[object] = []


class OutputTextDone(Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[object] = []


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Event, tag="error"):
    code: str | None
    message: str
    param: str | None


class EventStream(SSEStream):
    """One streamed response: each event typed (``event:`` line) and numbered in the order sent."""

    def __init__(self, request: web.Request) -> None:
        super().__init__(request)
        self._next = 0

    async def emit(self, event: Event) -> None:
        event.sequence_number = self._next
        self._next += 1
        kind = str(type(event).__struct_config__.tag)
        await self._write(b"event: " + kind.encode() + b"\ndata: " + encode(event) + b"\n\n")

    async def done(self) -> None:
        await self.response.write_eof()

    async def fail(self, error: APIError) -> None:
        with contextlib.suppress(ConnectionError):
            await self.emit(ErrorEvent(code=error.code, message=error.message, param=error.param))
            await self.response.write_eof()


async def stream_events(request: web.Request, produce: Callable[[EventStream], Awaitable[None]]
                        ) -> web.StreamResponse:
    """Open an event stream, let ``produce`` fill it, and end it (after an ``error`` event if it failed)."""
    return await run_stream(EventStream(request), produce)
