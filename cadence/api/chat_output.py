"""One chat choice's generated text turned into OpenAI's assistant message: the reasoning apart
(``--reasoning-parser``), the tool calls parsed or read from the constrained output
(cadence/api/tools.py), as a whole message or as stream deltas that a client accumulates into the
same message (docs/tools_and_reasoning.md)."""

from __future__ import annotations

import uuid

import msgspec

from cadence.api.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    MessageToolCall,
)
from cadence.api.reasoning_parsers.base import ReasoningParser, ReasoningStream
from cadence.api.tool_parsers.base import ToolCallDelta, ToolCallStream, ToolParser
from cadence.api.tools import ToolMode, constrained_calls
from cadence.sampling_params import SamplingParams


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def with_markup_tokens(params: SamplingParams, tool_parser: ToolParser | None) -> SamplingParams:
    """``params`` as a choice parsed by ``tool_parser`` needs them: special tokens kept in the text
    where its markup is made of them (Mistral's ``[TOOL_CALLS]``)."""
    if tool_parser is not None and tool_parser.needs_special_tokens:
        return msgspec.structs.replace(params, skip_special_tokens=False)
    return params


class ChoiceOutput:
    """The message of one choice, built from its text. Stream: :meth:`feed` each new piece, then
    :meth:`finish` once; whole: :meth:`message` of the whole text."""

    def __init__(self, mode: ToolMode, tool_parser: ToolParser | None,
                 reasoning_parser: ReasoningParser | None, *, constrained: bool = False,
                 single_call: bool = False) -> None:
        self._mode = mode
        self._tool_parser = tool_parser if mode.kind == "auto" else None
        # An output constraint (a required or named mode's, or the request's own) holds the output
        # to its grammar from the first token: it never opened a reasoning of its own (a grammar that
        # allows an explicit <think> block is split as any output).
        never_reasoned = constrained or mode.kind in ("required", "named")
        if never_reasoned and reasoning_parser is not None and reasoning_parser.starts_in_reasoning:
            reasoning_parser = None
        self._reasoning_parser = reasoning_parser
        # parallel_tool_calls false: the model's first call only (a required mode's grammar allows one).
        self._max_calls = 1 if single_call else None
        self._reasoning: ReasoningStream | None = None
        self._tools: ToolCallStream | None = None
        self._ids: list[str] = []  # the streamed calls' ids, by index
        self._constrained: list[str] = []  # a required mode's text, parsed at the end
        self._past_reasoning = False

    @property
    def called(self) -> bool:
        """Whether the stream has opened a tool call."""
        return bool(self._ids)

    @property
    def past_reasoning(self) -> bool:
        """Whether the stream's reasoning parser has let content through (the answer has begun)."""
        return self._past_reasoning

    @property
    def plain(self) -> bool:
        """Text in, content out: nothing to parse."""
        return self._reasoning_parser is None and self._mode.kind == "none"

    # ---- whole -----------------------------------------------------------------------------

    def message(self, text: str) -> AssistantMessage:
        """The message of the whole text; its tool calls get fresh ids."""
        reasoning = None
        if self._reasoning_parser is not None:
            split = self._reasoning_parser.split(text)
            reasoning, text = split.reasoning, split.content or ""
        content: str | None = text
        calls = []
        if self._tool_parser is not None:
            parsed = self._tool_parser.parse(text)
            content, calls = parsed.content, parsed.tool_calls[:self._max_calls]
        elif self._mode.kind in ("required", "named"):
            content, calls = None, constrained_calls(text, self._mode)
        message = AssistantMessage(content=content)
        if calls:
            message.tool_calls = [
                MessageToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls]
        if reasoning is not None:
            message.reasoning_content = reasoning
        return message

    # ---- streamed --------------------------------------------------------------------------

    def feed(self, text: str) -> DeltaMessage:
        """The delta of the next piece of text (empty fields unset)."""
        if self.plain:
            return DeltaMessage(content=text)
        reasoning, content = text, text
        if self._reasoning_parser is not None:
            self._reasoning = self._reasoning or self._reasoning_parser.stream()
            step = self._reasoning.feed(text)
            reasoning, content = step.reasoning, step.content
            self._past_reasoning = self._past_reasoning or bool(content)
        else:
            reasoning = ""
        return self._delta(reasoning, content, end=False)

    def finish(self) -> DeltaMessage:
        """The delta of what was held back, at the end of the text."""
        if self.plain:
            return DeltaMessage()
        reasoning, content = "", ""
        if self._reasoning is not None:
            step = self._reasoning.finish()
            reasoning, content = step.reasoning, step.content
        return self._delta(reasoning, content, end=True)

    def _delta(self, reasoning: str, content: str, end: bool) -> DeltaMessage:
        delta = DeltaMessage()
        if reasoning:
            delta.reasoning_content = reasoning
        calls: list[DeltaToolCall] = []
        kind = self._mode.kind
        if kind == "auto":
            assert self._tool_parser is not None
            self._tools = self._tools or self._tool_parser.stream()
            step = self._tools.feed(content)
            content, pieces = step.content, list(step.tool_calls)
            if end:
                last = self._tools.finish()
                content, pieces = content + last.content, pieces + list(last.tool_calls)
            calls = [self._call_delta(piece) for piece in pieces
                     if self._max_calls is None or piece.index < self._max_calls]
        elif kind == "named":
            assert self._mode.function is not None
            if content or not self._ids:  # the first delta opens the call, even before any argument
                calls = [self._call_delta(ToolCallDelta(0, None if self._ids else self._mode.function, content))]
            content = ""
        elif kind == "required":
            self._constrained.append(content)
            content = ""
            if end:
                calls = [self._call_delta(ToolCallDelta(i, call.name, call.arguments))
                         for i, call in enumerate(constrained_calls("".join(self._constrained), self._mode))]
        if content:
            delta.content = content
        if calls:
            delta.tool_calls = calls
        return delta

    def _call_delta(self, piece: ToolCallDelta) -> DeltaToolCall:
        if piece.index == len(self._ids):  # a call's first piece: its id, type and name
            self._ids.append(new_call_id())
            return DeltaToolCall(index=piece.index, id=self._ids[piece.index], type="function",
                                 function=DeltaFunctionCall(name=piece.name or "", arguments=piece.arguments))
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
