"""Calls written as JSON objects (hermes, llama3_json, mistral): following an object's extent as it
streams in, reading ``{"name": ..., "arguments": {...}}`` out of it, and the stream states for both.

A call's arguments are the arguments object's own text as the model wrote it, so the streamed and
the whole paths give the same string. A call goes out when its object closes: before that the
object may still turn out invalid or cut off, and then its markup is content
(docs/tools_and_reasoning.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cadence.api.tool_parsers.base import FunctionCall
from cadence.api.tool_parsers.markup_stream import JSON_SPACE, MarkupStream, State, skip_space

# What JSON allows outside a string besides brackets: a character outside these cannot be JSON, so
# a scan stops there instead of holding the text back until the end.
_BARE = frozenset(JSON_SPACE + ":,-+.0123456789eE" + "truefalsn")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


class JsonObjectScan:
    """Follows a JSON object from its opening brace at ``start`` to its closing one, each character
    once however the text arrives: nesting depth, strings and their escapes."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.position = start  # the next character to look at
        self.broken = False  # a character JSON cannot have there: the object never closes
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def advance(self, text: str) -> int | None:
        """Scan what is new in ``text``: the index just past the closing brace, or None (open, or broken)."""
        for at in range(self.position, len(text)):
            char = text[at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.position = at + 1
                    return at + 1
            elif char not in _BARE:
                self.position, self.broken = at, True
                return None
        self.position = len(text)
        return None


def _past(text: str, at: int, char: str) -> int:
    """The index after ``char`` at ``at`` and the whitespace that follows; ValueError when it is not there."""
    if text[at:at + 1] != char:
        raise ValueError(f"expected {char!r} at {at}")
    return skip_space(text, at + 1)


def object_members(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of the JSON object ``text`` (exactly one object): each value and its own text."""
    members: dict[str, tuple[Any, str]] = {}
    try:
        at = _past(text, 0, "{")
        if text[at:at + 1] != "}":
            while True:
                key, at = _DECODER.raw_decode(text, at)
                start = _past(text, skip_space(text, at), ":")
                value, end = _DECODER.raw_decode(text, start)
                if not isinstance(key, str):
                    return None
                members[key] = (value, text[start:end])
                at = skip_space(text, end)
                if text[at:at + 1] != ",":
                    break
                at = _past(text, at, ",")
    except (ValueError, RecursionError):  # not JSON, it ended early, or it nests past Python's stack
        return None
    return members if text[at:] == "}" else None


def read_call(text: str, argument_keys: tuple[str, ...]) -> FunctionCall | None:
    """The call ``{"name": "f", "<key>": {...}}`` (one of ``argument_keys``; none at all means no
    arguments); None when ``text`` is not one. Other keys are refused: arguments under a key the
    format does not use must not turn into a call without arguments."""
    members = object_members(text)
    if members is None or "name" not in members or not set(members) <= {"name", *argument_keys}:
        return None
    name = members["name"][0]
    given = [members[key] for key in argument_keys if key in members]
    if not (isinstance(name, str) and name) or len(given) > 1:
        return None
    if not given:
        return FunctionCall(name, "{}")
    value, source = given[0]
    return FunctionCall(name, source) if isinstance(value, dict) else None


class JsonCallStream(MarkupStream):
    """A markup stream whose calls (or their arguments) are JSON objects."""

    # Set when an object starts: its scan, and what reads it once it closes.
    _scan: JsonObjectScan
    _then: Callable[[str, int], bool]

    def _object_at_cursor(self, final: bool, then: Callable[[str, int], bool]) -> bool:
        """After whitespace, an object must start: ``then(object_text, end)`` reads it once it closes."""
        self._cursor = skip_space(self._buffer, self._cursor)
        if self._cursor == len(self._buffer):
            return self._hold(final)
        if self._buffer[self._cursor] != "{":
            return self._reject(self._cursor)
        self._scan, self._then = JsonObjectScan(self._cursor), then
        self._state = self._in_object
        return True

    def _call_at_cursor(self, final: bool, argument_keys: tuple[str, ...], after: State) -> bool:
        """After whitespace, a call object must start; once read, the stream goes on in ``after``."""
        def read(text: str, end: int) -> bool:
            call = read_call(text, argument_keys)
            if call is None:
                return self._reject(end)
            self._emit_call(call, end)
            self._cursor, self._state = 0, after
            return True
        return self._object_at_cursor(final, read)

    def _in_object(self, final: bool) -> bool:
        end = self._scan.advance(self._buffer)
        if end is not None:
            return self._then(self._buffer[self._scan.start:end], end)
        if self._scan.broken:
            return self._reject(self._scan.position)
        return self._hold(final)
