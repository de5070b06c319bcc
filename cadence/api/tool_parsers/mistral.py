"""The ``mistral`` tool-call format: after the ``[TOOL_CALLS]`` special token, either a JSON array of
call objects (Mistral 7B v0.3 and other tokenizers before v11) or a name and its arguments object
(v11 and later), one such token per call (docs/tools_and_reasoning.md)::

    Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Content before the token is content. The name form is also read without ``[ARGS]`` (``f{...}``),
as a tokenizer that drops that special token leaves it.
"""

from __future__ import annotations

from string import ascii_letters, digits

from cadence.api.tool_parsers.base import FunctionCall, ToolCallStream, ToolParser
from cadence.api.tool_parsers.json_call import JsonCallStream, object_members
from cadence.api.tool_parsers.markup_stream import skip_space

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
# What OpenAI allows in a function name, and its longest.
NAME_CHARACTERS = frozenset(ascii_letters + digits + "_-")
MAX_NAME = 64


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def stream(self) -> ToolCallStream:
        return _MistralStream()


class _MistralStream(JsonCallStream):
    def __init__(self) -> None:
        super().__init__(start=self._in_content, after_reject=self._in_content)
        self._name = ""

    def _in_content(self, final: bool) -> bool:
        if not self._content_until(MARKER, final):
            return False
        self._cursor, self._state = len(MARKER), self._after_marker
        return True

    def _after_marker(self, final: bool) -> bool:
        self._cursor = skip_space(self._buffer, self._cursor)
        if self._cursor == len(self._buffer):
            return self._hold(final)
        first = self._buffer[self._cursor]
        if first == "[":
            self._cursor, self._state = self._cursor + 1, self._array_item
        elif first in NAME_CHARACTERS:
            self._state = self._in_name
        else:
            return self._reject(self._cursor)
        return True

    def _array_item(self, final: bool) -> bool:
        return self._call_at_cursor(final, ("arguments",), after=self._after_item)

    def _after_item(self, final: bool) -> bool:
        """``,`` and the next call, or ``]``; anything else is content."""
        self._cursor = skip_space(self._buffer, 0)
        if self._cursor == len(self._buffer):
            return self._hold(final)
        separator = self._buffer[self._cursor]
        if separator == ",":
            self._cursor, self._state = self._cursor + 1, self._array_item
            return True
        if separator == "]":
            self._drop(self._cursor + 1)
        self._state = self._in_content
        return True

    def _in_name(self, final: bool) -> bool:
        """The name runs up to ``[ARGS]`` (or straight to the arguments' brace), at most
        :data:`MAX_NAME` characters (OpenAI's limit): a longer run is content, and each piece of a
        stream rescans no more than that."""
        end = self._cursor
        while end < len(self._buffer) and self._buffer[end] in NAME_CHARACTERS:
            end += 1
            if end - self._cursor > MAX_NAME:
                return self._reject(end)
        rest = self._buffer[end:]
        if rest.startswith(ARGS) or rest.startswith("{"):
            self._name = self._buffer[self._cursor:end]
            self._cursor = end + (len(ARGS) if rest.startswith(ARGS) else 0)
            self._state = self._before_arguments
            return True
        if ARGS.startswith(rest):
            return self._hold(final)
        return self._reject(end)

    def _before_arguments(self, final: bool) -> bool:
        return self._object_at_cursor(final, self._read_arguments)

    def _read_arguments(self, text: str, end: int) -> bool:
        if object_members(text) is None:
            return self._reject(end)
        self._emit_call(FunctionCall(self._name, text), end)
        self._state = self._in_content
        return True
