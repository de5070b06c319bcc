"""The ``llama3_json`` tool-call format (Llama 3.1/3.2 JSON tool calling): the message opens with a call
object, optionally after ``<|python_tag|>``, several separated by ``;``; its arguments are under
``"parameters"`` (or ``"arguments"``) (docs/tools_and_reasoning.md)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A message that does not open with a call object is content, and so is whatever follows the calls.
"""

from __future__ import annotations

from cadence.api.tool_parsers.base import ToolCallStream, ToolParser
from cadence.api.tool_parsers.json_call import JsonCallStream
from cadence.api.tool_parsers.markup_stream import skip_space

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream()


class _Llama3JsonStream(JsonCallStream):
    def __init__(self) -> None:
        super().__init__(start=self._at_start, after_reject=self._rest_is_content)

    def _at_start(self, final: bool) -> bool:
        self._cursor = skip_space(self._buffer, 0)
        rest = self._buffer[self._cursor:]
        if rest.startswith(PYTHON_TAG):
            self._cursor += len(PYTHON_TAG)
        elif PYTHON_TAG.startswith(rest):
            return self._hold(final)
        self._state = self._at_call
        return True

    def _at_call(self, final: bool) -> bool:
        return self._call_at_cursor(final, ARGUMENT_KEYS, after=self._after_call)

    def _after_call(self, final: bool) -> bool:
        """A ``;`` and the next call, or the end; anything else from here on is content."""
        self._cursor = skip_space(self._buffer, 0)
        if self._cursor == len(self._buffer):
            return self._hold(final)
        if self._buffer[self._cursor] == ";":
            self._cursor, self._state = self._cursor + 1, self._at_call
        else:
            self._state = self._rest_is_content
        return True
