"""The ``pythonic`` tool-call format (Llama 3.2 and Llama 4 pythonic tool calling): the message opens
with a Python list of calls whose keyword arguments are literals (docs/tools_and_reasoning.md)::

    [get_weather(city="Paris", unit='celsius'), get_time()]

The literals are read with ``ast`` (never evaluated) and given as JSON. A message that does not open
with such a list is content, and so is whatever follows it. The calls go out when the list closes:
until then a later element may still show that it is not a call list.
"""

from __future__ import annotations

import ast
import json
from string import ascii_letters, digits
from typing import Any

from cadence.api.tool_parsers.base import FunctionCall, ToolCallStream, ToolParser
from cadence.api.tool_parsers.markup_stream import MarkupStream, skip_space

NAME_START = frozenset(ascii_letters + "_")
NAME = NAME_START | frozenset(digits)

# The shape of the list between calls: state -> (characters, next state); whitespace may come
# anywhere but inside a name. "call" enters the call's parentheses, "end" closes the list.
_SHAPE = {
    "name": ((NAME_START, "in_name"),),
    "in_name": ((NAME, "in_name"), (frozenset("("), "call"), (frozenset(" \t\r\n"), "paren")),
    "paren": ((frozenset("("), "call"),),
    "next": ((frozenset(","), "name"), (frozenset("]"), "end")),
}


class CallListScan:
    """Follows ``[name(...), ...]`` from its opening bracket at ``start`` to its closing one, each
    character once: inside a call, brackets and Python strings with their escapes; between calls, the
    list's shape, so that text which cannot be a call list stops the scan early (``broken``)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.position = start + 1  # the next character to look at
        self.broken = False
        self._shape = "name"
        self._depth = 0  # brackets open inside the current call
        self._quote = ""  # the quote of the string the scan is in
        self._escaped = False

    def advance(self, text: str) -> int | None:
        """Scan what is new in ``text``: the index just past the closing bracket, or None (open, or broken)."""
        for at in range(self.position, len(text)):
            char = text[at]
            if self._quote:
                self._in_string(char)
            elif self._depth:
                self._in_call(char)
            else:
                shape = self._between_calls(char)
                if shape is None:
                    self.position, self.broken = at, True
                    return None
                if shape == "end":
                    self.position = at + 1
                    return at + 1
                self._shape = shape
        self.position = len(text)
        return None

    def _in_string(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == self._quote:
            self._quote = ""

    def _in_call(self, char: str) -> None:
        if char in "'\"":
            self._quote = char
        elif char in "([{":
            self._depth += 1
        elif char in ")]}":
            self._depth -= 1
            if self._depth == 0:
                self._shape = "next"

    def _between_calls(self, char: str) -> str | None:
        for characters, shape in _SHAPE[self._shape]:
            if char in characters:
                if shape == "call":
                    self._depth = 1
                return shape
        return self._shape if char.isspace() and self._shape != "in_name" else None


def read_calls(text: str) -> list[FunctionCall] | None:
    """The calls of the list ``text``; None unless it is a non-empty list of calls with literal keyword
    arguments only."""
    try:
        body = ast.parse(text, mode="eval").body
        if not (isinstance(body, ast.List) and body.elts):
            return None
        return [_read_call(node) for node in body.elts]
    except (SyntaxError, ValueError, RecursionError):  # not Python, not calls, or too deep
        return None


def _read_call(node: ast.expr) -> FunctionCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise ValueError("not a call of a name with keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**arguments are not literals")
        arguments[keyword.arg] = _literal(keyword.value)
    # allow_nan=False: 1e999 is a Python literal, but infinity is not JSON.
    return FunctionCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))


def _literal(node: ast.expr) -> Any:
    """A literal as its JSON value: None, bools, numbers (with a sign), strings, lists, tuples, and
    dicts with string keys."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):  # -1 is not a Constant
        number = _literal(node.operand)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError("a sign on something other than a number")
        return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
                for key in node.keys]
        if None in keys:
            raise ValueError("dict keys must be strings")
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise ValueError("not a literal")


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def stream(self) -> ToolCallStream:
        return _PythonicStream()


class _PythonicStream(MarkupStream):
    _scan: CallListScan  # set when the list opens

    def __init__(self) -> None:
        super().__init__(start=self._at_start, after_reject=self._rest_is_content)

    def _at_start(self, final: bool) -> bool:
        self._cursor = skip_space(self._buffer, 0)
        if self._cursor == len(self._buffer):
            return self._hold(final)
        if self._buffer[self._cursor] != "[":
            return self._reject(len(self._buffer))
        self._scan, self._state = CallListScan(self._cursor), self._in_list
        return True

    def _in_list(self, final: bool) -> bool:
        end = self._scan.advance(self._buffer)
        if end is None:
            return self._reject(self._scan.position) if self._scan.broken else self._hold(final)
        calls = read_calls(self._buffer[self._scan.start:end])
        if calls is None:
            return self._reject(end)
        for call in calls:
            self._emit_call(call, 0)
        self._drop(end)
        self._state = self._rest_is_content
        return True
