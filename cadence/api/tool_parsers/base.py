"""The tool-call parser contract: find the function calls in a chat model's output.

A model asked to use tools writes its calls as markup in its text (``<tool_call>{...}</tool_call>``,
``[TOOL_CALLS][...]``, ``[f(a=1)]``). The chat endpoint gives them as ``tool_calls`` and the rest as
``content``: whole with :meth:`ToolParser.parse`, or delta by delta with a :class:`ToolCallStream`.
Both ways agree on every text however it was cut: the built-in parsers define ``parse`` as their
stream run over the whole text. A third-party parser is a subclass registered in the
``cadence.tool_parsers`` entry-point group (docs/tools_and_reasoning.md).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class FunctionCall:
    """One call: the function's name and its arguments, a JSON object as text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    """A whole output: the text outside the calls (None when that is only whitespace) and the calls in order."""

    content: str | None
    tool_calls: list[FunctionCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """The next part of call ``index`` (counted from 0 per message).

    ``name`` is set on the call's first delta only, and always whole; ``arguments`` is the next
    fragment of the arguments text ("" allowed).
    """

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    """What one piece of a streamed output adds: new content ("" for none) and call parts."""

    content: str
    tool_calls: list[ToolCallDelta]


class ToolCallStream(abc.ABC):
    """One choice's streamed output, fed piece by piece.

    Holds back only what may still be markup; :meth:`finish` releases it (as content where it never
    became a call).
    """

    @abc.abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of the output; return what is now known to be content or calls."""

    @abc.abstractmethod
    def finish(self) -> StreamDelta:
        """The output has ended: return whatever was held back."""


class ToolParser(abc.ABC):
    """Finds one model family's tool calls. Stateless: one instance serves every request."""

    name: ClassVar[str]
    # Markup made of special tokens (Mistral's [TOOL_CALLS]) must survive detokenization: the chat
    # endpoint then sets skip_special_tokens=False.
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str) -> ParsedMessage:
        """Parse a whole output: by default the stream over it, so that both paths agree by construction."""
        stream = self.stream()
        return collect([stream.feed(text), stream.finish()])

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh stream for one choice's output."""


def collect(deltas: Iterable[StreamDelta]) -> ParsedMessage:
    """Join a stream's deltas into the message they make up."""
    content = ""
    names: list[str] = []
    arguments: list[str] = []
    for delta in deltas:
        content += delta.content
        for part in delta.tool_calls:
            if part.index == len(names):
                names.append(part.name or "")
                arguments.append("")
            arguments[part.index] += part.arguments
    calls = [FunctionCall(name, args) for name, args in zip(names, arguments, strict=True)]
    return ParsedMessage(content if content.strip() else None, calls)
