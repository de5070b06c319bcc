"""The ``hermes`` tool-call format (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object between
tags, several in a row for parallel calls, with content around them (docs/tools_and_reasoning.md)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from cadence.api.tool_parsers.base import ToolCallStream, ToolParser
from cadence.api.tool_parsers.json_call import JsonCallStream
from cadence.api.tool_parsers.markup_stream import skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(JsonCallStream):
    def __init__(self) -> None:
        super().__init__(start=self._in_content, after_reject=self._in_content)

    def _in_content(self, final: bool) -> bool:
        if not self._content_until(OPEN, final):
            return False
        self._cursor, self._state = len(OPEN), self._in_tag
        return True

    def _in_tag(self, final: bool) -> bool:
        return self._call_at_cursor(final, ("arguments",), after=self._at_close)

    def _at_close(self, final: bool) -> bool:
        """After a call: its closing tag. Text other than that is content (a call whose tag the output
        never closes still counts, its JSON being whole)."""
        self._cursor = skip_space(self._buffer, self._cursor)
        rest = self._buffer[self._cursor:]
        if rest.startswith(CLOSE):
            self._drop(self._cursor + len(CLOSE))
        elif CLOSE.startswith(rest) and not final:
            return False
        self._state = self._in_content
        return True
