"""One response's output items, built from its generated text as it arrives: the text goes through a
chat choice's parsing (cadence/api/chat_output.py: reasoning apart, tool calls parsed or read from
the constrained output), and what each piece adds opens, fills and closes items in order: a
``reasoning`` item, ``message`` items of ``output_text``, ``function_call`` items.

Items follow one another, each closed before the next opens: text written after a call is a message
item of its own (within one piece, text comes before calls, as in a chat message). A streamed
response sends the events each step returns; a whole one keeps only the items. Both run the same
steps over the engine's deltas, so the items a client accumulates from the stream are the items of
the whole answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from cadence.api.chat_output import ChoiceOutput
from cadence.api.protocol import DeltaMessage, DeltaToolCall
from cadence.api.responses_events import (
    ContentPartAdded,
    ContentPartDone,
    Event,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
)
from cadence.api.responses_protocol import (
    FunctionToolCall,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)

ItemKind = Literal["reasoning", "message", "function_call"]
_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclass
class _OpenItem:
    """The item being written: its place, its id, its text (a call's arguments) so far."""

    kind: ItemKind
    index: int
    id: str
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseOutput:
    """Feed each piece of the text with :meth:`feed`, then :meth:`finish` once; :attr:`items` are
    the output items, closed in order."""

    def __init__(self, choice: ChoiceOutput) -> None:
        self._choice = choice
        self.items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._tokens_before_answer = 0

    @property
    def reasoning_tokens(self) -> int:
        """The tokens generated before the reasoning parser let the answer through, when the output
        has reasoning (counted by the engine's deltas: one that ends the reasoning and begins the
        answer counts for the answer)."""
        has_reasoning = any(isinstance(item, ReasoningItem) for item in self.items)
        return self._tokens_before_answer if has_reasoning else 0

    def feed(self, text: str, num_tokens: int) -> list[Event]:
        """The events of the next piece of text (``num_tokens`` tokens)."""
        events = self._apply(self._choice.feed(text))
        if not self._choice.past_reasoning:
            self._tokens_before_answer += num_tokens
        return events

    def finish(self, cut: bool) -> list[Event]:
        """The events of what was held back, then of closing the last item (``incomplete`` where the
        output was ``cut`` by its token limit)."""
        return self._apply(self._choice.finish()) + self._close("incomplete" if cut else "completed")

    def _apply(self, delta: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if isinstance(delta.reasoning_content, str) and delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if isinstance(delta.content, str) and delta.content:
            events += self._text("message", delta.content)
        if isinstance(delta.tool_calls, list):
            for piece in delta.tool_calls:
                events += self._call(piece)
        return events

    def _text(self, kind: ItemKind, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close("completed") + self._start(kind)
        item = self._require_open()
        item.text.append(text)
        if kind == "reasoning":
            events.append(ReasoningTextDelta(item_id=item.id, output_index=item.index, content_index=0, delta=text))
        else:
            events.append(OutputTextDelta(item_id=item.id, output_index=item.index, content_index=0, delta=text))
        return events

    def _call(self, piece: DeltaToolCall) -> list[Event]:
        """A call's first piece (its id and name) opens its item; the others carry its arguments."""
        function = piece.function
        arguments = function.arguments if function and isinstance(function.arguments, str) else ""
        events: list[Event] = []
        if isinstance(piece.id, str):
            name = function.name if function and isinstance(function.name, str) else ""
            events += self._close("completed") + self._start("function_call", call_id=piece.id, name=name)
        item = self._require_open()
        if arguments:
            item.text.append(arguments)
            events.append(FunctionCallArgumentsDelta(item_id=item.id, output_index=item.index, delta=arguments))
        return events

    def _start(self, kind: ItemKind, call_id: str = "", name: str = "") -> list[Event]:
        item = self._open = _OpenItem(kind, len(self.items), f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}",
                                      call_id=call_id, name=name)
        if kind == "function_call":
            added: OutputItem = FunctionToolCall(id=item.id, call_id=call_id, name=name, arguments="",
                                                 status="in_progress")
            return [OutputItemAdded(output_index=item.index, item=added)]
        part: OutputText | ReasoningText
        if kind == "reasoning":
            added, part = ReasoningItem(id=item.id, status="in_progress"), ReasoningText(text="")
        else:
            added, part = OutputMessage(id=item.id, status="in_progress"), OutputText(text="")
        return [OutputItemAdded(output_index=item.index, item=added),
                ContentPartAdded(item_id=item.id, output_index=item.index, content_index=0, part=part)]

    def _close(self, status: ItemStatus) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.text)
        events: list[Event]
        done: OutputItem
        if item.kind == "function_call":
            done = FunctionToolCall(id=item.id, call_id=item.call_id, name=item.name, arguments=text, status=status)
            events = [FunctionCallArgumentsDone(item_id=item.id, output_index=item.index, name=item.name,
                                                arguments=text)]
        elif item.kind == "reasoning":
            done = ReasoningItem(id=item.id, status=status, content=[ReasoningText(text=text)])
            events = [ReasoningTextDone(item_id=item.id, output_index=item.index, content_index=0, text=text),
                      ContentPartDone(item_id=item.id, output_index=item.index, content_index=0,
                                      part=ReasoningText(text=text))]
        else:
            done = OutputMessage(id=item.id, status=status, content=[OutputText(text=text)])
            events = [OutputTextDone(item_id=item.id, output_index=item.index, content_index=0, text=text),
                      ContentPartDone(item_id=item.id, output_index=item.index, content_index=0,
                                      part=OutputText(text=text))]
        self.items.append(done)
        return [*events, OutputItemDone(output_index=item.index, item=done)]

    def _require_open(self) -> _OpenItem:
        assert self._open is not None  # _start has just opened it, or the call it continues is open
        return self._open
