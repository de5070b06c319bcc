"""The machinery every built-in tool-call stream shares: the buffer of text that may still be markup,
the hold-back of a marker's prefix, and the deltas (content, whole calls numbered in order).

A format is a set of states, each a method ``(final) -> progressed`` that decides what it can about
the front of the buffer. A state decides only what no later text can change, which is what makes
the result the same however the text is cut (docs/tools_and_reasoning.md).
"""

from __future__ import annotations

from collections.abc import Callable

from cadence.api.markers import partial_marker
from cadence.api.tool_parsers.base import FunctionCall, StreamDelta, ToolCallDelta, ToolCallStream

# A state looks at the buffer; it returns False when it must wait for more text (never when final).
State = Callable[[bool], bool]

JSON_SPACE = " \t\r\n"


def skip_space(text: str, at: int) -> int:
    """The first index from ``at`` that is not JSON whitespace (``len(text)`` if none is)."""
    while at < len(text) and text[at] in JSON_SPACE:
        at += 1
    return at


class MarkupStream(ToolCallStream):
    """Runs a format's states over a buffer; ``_cursor`` is the state's place in it.

    Content that is only whitespace so far is held: a message whose content is only whitespace has
    none (ParsedMessage.content is None), and a stream cannot take back what it sent.
    """

    def __init__(self, start: State, after_reject: State) -> None:
        self._state = start
        self._after_reject = after_reject
        self._buffer = ""
        self._cursor = 0
        self._content = ""
        self._blank = ""
        self._has_text = False
        self._calls: list[ToolCallDelta] = []
        self._count = 0

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        self._run(final=True)
        self._blank = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while self._buffer and self._state(final):
            pass

    def _take(self) -> StreamDelta:
        delta = StreamDelta(self._content, self._calls)
        self._content, self._calls = "", []
        return delta

    def _emit_content(self, end: int) -> None:
        """``buffer[:end]`` is content."""
        text, self._buffer = self._buffer[:end], self._buffer[end:]
        if not self._has_text and (not text or text.isspace()):
            self._blank += text
            return
        self._content += self._blank + text
        self._blank, self._has_text = "", True

    def _emit_call(self, call: FunctionCall, end: int) -> None:
        """``buffer[:end]`` was ``call``'s markup."""
        self._calls.append(ToolCallDelta(self._count, call.name, call.arguments))
        self._count += 1
        self._buffer = self._buffer[end:]

    def _drop(self, end: int) -> None:
        """``buffer[:end]`` was markup that carries nothing."""
        self._buffer = self._buffer[end:]

    def _reject(self, end: int) -> bool:
        """``buffer[:end]`` looked like markup but is not: it is content, and the format goes on."""
        self._emit_content(end)
        self._state = self._after_reject
        return True

    def _hold(self, final: bool) -> bool:
        """Wait for more text; once the text has ended, what is held is content."""
        return self._reject(len(self._buffer)) if final else False

    def _content_until(self, marker: str, final: bool) -> bool:
        """Send the content before ``marker``; True once the buffer starts with it."""
        at = self._buffer.find(marker)
        if at >= 0:
            self._emit_content(at)
            return True
        self._emit_content(len(self._buffer) - (0 if final else partial_marker(self._buffer, marker)))
        return False

    def _rest_is_content(self, final: bool) -> bool:
        """The state of a format whose markup can only open the message: everything from here is content."""
        self._emit_content(len(self._buffer))
        return False
