"""A chat choice's text into its message (cadence/api/chat_output.py) and the tool modes that decide
how (cadence/api/tools.py): for every mode, the stream's deltas accumulate, however the text is cut,
to the message of the whole text; the required and named modes' constraints and calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from cadence.api.chat_output import ChoiceOutput
from cadence.api.errors import APIError
from cadence.api.params import call_arguments
from cadence.api.protocol import ChatCompletionRequest, DeltaMessage
from cadence.api.reasoning_parsers import load_reasoning_parser
from cadence.api.tool_parsers import load_tool_parser
from cadence.api.tools import ToolMode, constrained_calls, template_tools, tool_constraint, tool_mode

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
HERMES = load_tool_parser("hermes")
QWEN3 = load_reasoning_parser("qwen3")


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def mode_of(req: ChatCompletionRequest, auto_tool_choice: bool) -> ToolMode:
    return tool_mode(req.tools or [], req.tool_choice, constrained=False, auto_tool_choice=auto_tool_choice)


def streamed(output: ChoiceOutput, pieces: list[str]) -> dict[str, Any]:
    """What a client accumulates from the deltas of ``pieces``, then the end."""
    content, reasoning, calls = "", "", []
    deltas: list[DeltaMessage] = [output.feed(piece) for piece in pieces] + [output.finish()]
    for delta in deltas:
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for piece in delta.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id and piece.function and piece.function.name  # opened whole, with its id
                calls.append([piece.function.name, ""])
            function: Any = piece.function
            calls[piece.index][1] += function.arguments or ""
    return {"content": content, "reasoning": reasoning, "calls": calls}


def whole(output: ChoiceOutput, text: str) -> dict[str, Any]:
    message = output.message(text)
    calls = message.tool_calls or []
    return {"content": message.content or "", "reasoning": message.reasoning_content or "",
            "calls": [[c.function.name, c.function.arguments] for c in calls]}


CASES = [
    (ToolMode("none"), None, "Just text, no markup."),
    (ToolMode("none"), QWEN3, "<think>Let me see.</think>\n\nIt is sunny."),
    (ToolMode("auto"), QWEN3, '<think>Tools.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                              '{"city": "Paris"}}\n</tool_call>'),
    (ToolMode("auto"), None, 'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
                             '<tool_call>{"name": "get_weather", "arguments": {"city": "Ro{me}"}}</tool_call>'),
    (ToolMode("named", "get_weather"), QWEN3, ' {"city": "Oslo"}'),
    (ToolMode("required"), QWEN3, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                  '{"name": "now", "parameters": {}}]'),
]


@pytest.mark.parametrize(("mode", "reasoning", "text"), CASES)
def test_the_stream_accumulates_to_the_whole_message_at_every_cut(mode: ToolMode, reasoning: Any, text: str) -> None:
    expected = whole(ChoiceOutput(mode, HERMES, reasoning), text)
    for cut in range(len(text) + 1):
        assert streamed(ChoiceOutput(mode, HERMES, reasoning), [text[:cut], text[cut:]]) == expected, cut
    assert streamed(ChoiceOutput(mode, HERMES, reasoning), list(text)) == expected


def test_the_whole_messages_hold_the_reasoning_and_calls_apart() -> None:
    (none, thinking, auto, parallel, named, required) = [whole(ChoiceOutput(m, HERMES, r), t) for m, r, t in CASES]
    assert none == {"content": "Just text, no markup.", "reasoning": "", "calls": []}
    assert thinking == {"content": "\n\nIt is sunny.", "reasoning": "Let me see.", "calls": []}
    assert auto == {"content": "", "reasoning": "Tools.", "calls": [["get_weather", '{"city": "Paris"}']]}
    assert parallel["calls"] == [["now", "{}"], ["get_weather", '{"city": "Ro{me}"}']]
    # A constrained output is JSON from its first token: nothing is taken for reasoning.
    assert named == {"content": "", "reasoning": "", "calls": [["get_weather", ' {"city": "Oslo"}']]}
    assert required["calls"] == [["get_weather", '{"city": "Paris"}'], ["now", "{}"]]


def test_tool_modes_follow_the_choice_and_what_the_server_serves() -> None:
    assert mode_of(request(), auto_tool_choice=False) == ToolMode("none")
    assert mode_of(request(tools=TOOLS), auto_tool_choice=True) == ToolMode("auto")
    assert mode_of(request(tools=TOOLS, tool_choice="none"), auto_tool_choice=False) == ToolMode("none")
    assert mode_of(request(tools=TOOLS, tool_choice="required"), auto_tool_choice=False) == ToolMode("required")
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert mode_of(named, auto_tool_choice=False) == ToolMode("named", "now")
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as caught:
        mode_of(request(tools=TOOLS), auto_tool_choice=False)
    assert caught.value.param == "tool_choice"


def test_the_required_constraint_allows_exactly_calls_of_the_tools_valid_under_their_schemas() -> None:
    req = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    constraint, field = tool_constraint(req.tools or [], ToolMode("required"), req.parallel_tool_calls) or (None, None)
    assert field == "tools" and constraint is not None and isinstance(constraint.json, str)
    schema = json.loads(constraint.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "now", "parameters": {"anything": 1}}], schema)  # no parameters: any object
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]):  # one call only
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named, _ = tool_constraint(req.tools or [], ToolMode("named", "get_weather")) or (None, None)
    assert named is not None and json.loads(str(named.json)) == WEATHER
    assert tool_constraint(req.tools or [], ToolMode("auto")) is None


def test_a_constrained_output_cut_short_holds_the_calls_before_the_cut() -> None:
    required = ToolMode("required")
    assert constrained_calls('[{"name": "now", "parameters": {', required) == []
    cut = '[{"name": "now", "parameters": {}} ,\n {"name": "get_weather", "parameters": {"city": "Pa'
    assert [(c.name, c.arguments) for c in constrained_calls(cut, required)] == [("now", "{}")]


def test_tools_reach_the_template_as_openai_function_objects() -> None:
    assert template_tools(request(tools=TOOLS).tools) == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "description": "Forecast"}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    assert template_tools(request().tools) is None


DEEP = "[" * 5000 + "]" * 5000  # past Python's recursion limit, inside a string the body check cannot see


def test_arguments_nested_past_the_parsers_stack_are_content_or_a_400_never_a_crash() -> None:
    hermes_text = '<tool_call>{"name": "now", "arguments": {"x": ' + DEEP + "}}</tool_call>"
    assert HERMES.parse(hermes_text).tool_calls == []
    assert constrained_calls("[" + DEEP, ToolMode("required")) == []
    with pytest.raises(APIError) as caught:
        call_arguments(DEEP, "messages[1].tool_calls[0].function.arguments")
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"


def test_an_output_constraint_turns_the_reasoning_split_off() -> None:
    """deepseek_r1 takes text without a </think> for reasoning; a constrained output has none."""
    deepseek = load_reasoning_parser("deepseek_r1")
    text = '{"answer": 42}'
    assert whole(ChoiceOutput(ToolMode("none"), None, deepseek), text)["reasoning"] == text
    assert whole(ChoiceOutput(ToolMode("none"), None, deepseek, constrained=True), text) == {
        "content": text, "reasoning": "", "calls": []}


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    mode, _, text = CASES[3]  # content, then two calls
    expected = {"content": "Sure. ", "reasoning": "", "calls": [["now", "{}"]]}
    assert whole(ChoiceOutput(mode, HERMES, None, single_call=True), text) == expected
    for cut in range(len(text) + 1):
        assert streamed(ChoiceOutput(mode, HERMES, None, single_call=True), [text[:cut], text[cut:]]) == expected
