"""A chat request's tools: which way its tool calls come out, and the constraint that enforces them
(docs/tools_and_reasoning.md).

- ``none``: the model answers in text (the tools still reach the chat template, as vLLM does).
- ``auto`` (the default when tools are given): the model chooses; the server's tool parser
  (``--tool-call-parser``, with ``--enable-auto-tool-choice``) finds the calls in its text.
- ``required``: structured output holds the model to a JSON array of calls of the given functions,
  each with arguments valid under its schema (one call without ``parallel_tool_calls``).
- a named function: structured output holds it to that function's arguments (a JSON object).

The last two need no parser: the output always parses, whatever the model, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cadence.api.errors import bad_request
from cadence.api.protocol import ChatTool, NamedToolChoice
from cadence.api.tool_parsers.base import FunctionCall
from cadence.sampling_params import StructuredOutputsParams

ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# The schema of a function that declares no parameters: an object, with anything in it.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How one chat request's calls come out: ``kind`` and, for ``named``, the function."""

    kind: Literal["none", "auto", "required", "named"]
    function: str | None = None


NO_TOOLS = ToolMode("none")


def tool_mode(tools: Sequence[ChatTool], choice: ToolChoice | None, *, constrained: bool,
              auto_tool_choice: bool, name_param: str = "tool_choice.function.name") -> ToolMode:
    """A request's tool mode, checked against what the server can serve (``constrained``: the
    request has an output constraint of its own; ``name_param``: the field that names a function,
    as the request's endpoint spells it).

    :raises APIError: 400 for a ``tool_choice`` without tools, a named function not among them, two
        tools of one name, ``auto`` where the server has no tool parser (never a silent drop), or
        ``required``/named together with another output constraint.
    """
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return NO_TOOLS
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    if choice is None or choice == "auto":
        if not auto_tool_choice:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser; send tool_choice "required", a named function or "none"',
                              param="tool_choice")
        return ToolMode("auto")
    if choice == "none":
        return NO_TOOLS
    if constrained:
        raise bad_request("a required or named tool_choice is enforced with structured output: it cannot be "
                          "combined with another output constraint (response_format, text.format or "
                          "structured_outputs)", param="tool_choice")
    if choice == "required":
        return ToolMode("required")
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the tools",
                          param=name_param)
    return ToolMode("named", choice.function.name)


def tool_constraint(tools: Sequence[ChatTool], mode: ToolMode, parallel_tool_calls: bool | None = None
                    ) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint of a ``required`` or named mode (a JSON schema, as its text) and the field it
    comes from; None for the others."""
    by_name = {tool.function.name: tool for tool in tools}
    if mode.kind == "named":
        assert mode.function is not None  # a named mode names one
        schema = _parameters(by_name[mode.function])
    elif mode.kind == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(tool)},
                            "required": ["name", "parameters"]} for name, tool in by_name.items()]}
        schema = {"type": "array", "minItems": 1, "items": calls}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
    else:
        return None
    return StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":"))), "tools"


def constrained_calls(text: str, mode: ToolMode) -> list[FunctionCall]:
    """The calls in the output of a ``required`` or named mode. The constraint made it parse, but
    ``max_tokens`` may have cut the array short: then its whole calls, those before the cut."""
    if mode.kind == "named":
        assert mode.function is not None
        return [FunctionCall(mode.function, text)]  # as streamed: fragment by fragment
    return [FunctionCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in _whole_items(text)]


_DECODER = json.JSONDecoder()


def _whole_items(text: str) -> list[Any]:
    """The items of a JSON array that are complete, whether or not the array is."""
    items: list[Any] = []
    at = text.find("[") + 1
    while at > 0:
        at = len(text) - len(text[at:].lstrip(" \t\r\n,"))  # to the next item
        try:
            item, at = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            break  # the end of the array, or an item cut short
        items.append(item)
    return items


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (transformers' ``tools=``): OpenAI's function objects."""
    if not tools:
        return None
    return [{"type": "function", "function": _function(tool)} for tool in tools]


def _function(tool: ChatTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name, "parameters": _parameters(tool)}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    return function


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT
