"""Tool calling and reasoning through a real ``cadence serve`` and OpenAI's client, on the tiny
random Llama with a chat template of our own (``--chat-template``, written here) that renders tools,
earlier tool calls and results, and Qwen3's think block.

A random model never writes the markup by itself, so the ``auto`` path is driven by forced output
(a structured-output ``choice`` of one text with reasoning and a hermes tool call); ``required`` and
named tool choices are enforced by the server's own constraint, so any sampled output must hold
calls valid under the tool's schema: checked over many seeds, streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from support.openai_spec import OpenAISpec
from support.tiny_models import build_tiny_tokenizer
from support.tool_chat import FORCED, SCHEMAS, TEMPLATE, TOOLS

from cadence.api.testing import ServerProcess

ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tool_chat_server: ServerProcess) -> ServerProcess:
    return tool_chat_server


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _forced(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=_model(client), messages=ASK, tools=TOOLS, max_tokens=350, temperature=0,
        extra_body={"structured_outputs": {"choice": [FORCED]}}, **kwargs)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _accumulate(chunks: list[Any]) -> tuple[str, str, list[dict[str, str]], str | None]:
    """What a client library builds from a stream: content, reasoning, calls by index, finish reason."""
    content, reasoning, calls, finish = "", "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                if piece.index == len(calls):
                    assert piece.id and piece.function.name, "a call's first delta has its id and whole name"
                    calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
                else:
                    assert piece.id is None and (piece.function is None or piece.function.name is None)
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


def test_auto_choice_parses_reasoning_and_a_hermes_call(client: openai.OpenAI, spec: OpenAISpec) -> None:
    raw = _forced(client)
    body = json.loads(raw.text)
    spec.validate(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_the_stream_accumulates_to_the_same_answer(client: openai.OpenAI, spec: OpenAISpec) -> None:
    whole = json.loads(_forced(client).text)["choices"][0]["message"]
    chunks = list(client.chat.completions.create(
        model=_model(client), messages=ASK, tools=TOOLS, max_tokens=350, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": [FORCED]}}))
    for chunk in chunks:
        spec.validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
    content, reasoning, calls, finish = _accumulate(chunks)
    assert (content, reasoning, finish) == ("", whole["reasoning_content"], "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


@pytest.mark.parametrize("stream", [False, True])
def test_required_choice_always_returns_calls_valid_under_their_schemas(client: openai.OpenAI, stream: bool) -> None:
    for seed in range(8):
        kwargs: Any = dict(model=_model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False, max_tokens=350, temperature=1.0, seed=seed)
        if stream:
            _, _, calls, finish = _accumulate(list(client.chat.completions.create(stream=True, **kwargs)))
        else:
            answer = client.chat.completions.create(**kwargs).choices[0]
            finish = answer.finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in answer.message.tool_calls or []]
        assert finish == "tool_calls" and len(calls) == 1, (seed, calls)
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_the_default_response_format_is_no_constraint_beside_a_required_choice(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=_model(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, response_format={"type": "text"},
                                            max_tokens=350, temperature=0)
    (call,) = answer.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_always_called_with_valid_arguments(client: openai.OpenAI, stream: bool) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(8):
        kwargs: Any = dict(model=_model(client), messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=350,
                           temperature=1.0, seed=seed)
        if stream:
            content, _, calls, finish = _accumulate(list(client.chat.completions.create(stream=True, **kwargs)))
            assert content == ""
        else:
            answer = client.chat.completions.create(**kwargs).choices[0]
            finish = answer.finish_reason
            assert answer.message.content is None
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in answer.message.tool_calls or []]
        assert finish == "stop" and [c["name"] for c in calls] == ["get_time"], (seed, calls)
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_time"])


def test_a_conversation_with_a_call_and_its_result_renders_through_the_template(client: openai.OpenAI) -> None:
    """The second turn of an agent loop: the earlier call (its arguments an object, as templates
    expect) and the tool's answer reach the template, with the tools."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = client.chat.completions.create(model=_model(client), messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.usage is not None
    rendered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                    {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    expected = build_tiny_tokenizer().apply_chat_template(rendered, tools=TOOLS, chat_template=TEMPLATE,
                                                          add_generation_prompt=True, tokenize=True, return_dict=True)
    assert answer.usage.prompt_tokens == len(expected["input_ids"])


def test_a_langchain_tool_loop_calls_then_answers(server: ServerProcess, client: openai.OpenAI) -> None:
    """``langchain-openai`` over chat completions: a forced call, the tool's result as a
    ``ToolMessage``, then the answer (forced text: a random model writes none worth reading)."""
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The forecast."""
        return f"Sunny in {city} for {days} days"

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key=SecretStr("none"), model=_model(client),
                     max_completion_tokens=300, temperature=1.0, seed=3, max_retries=0)
    history: list[BaseMessage] = [HumanMessage("Weather in Paris?")]
    called = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(history)
    (call,) = getattr(called, "tool_calls", [])
    jsonschema.validate(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    history += [called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(
        history, extra_body={"structured_outputs": {"choice": ["Sunny in Paris."]}})
    assert (answer.content, getattr(answer, "tool_calls", None)) == ("Sunny in Paris.", [])


def test_thinking_off_through_chat_template_kwargs_is_all_content(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=_model(client), messages=ASK, max_tokens=350, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                    "structured_outputs": {"choice": ["Sunny, 21 degrees."]}})
    message = answer.choices[0].message
    assert message.content == "Sunny, 21 degrees." and getattr(message, "reasoning_content", None) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
])
def test_a_tool_request_the_server_cannot_serve_is_a_400_naming_the_field(
        client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=2, extra_body=body)
    assert caught.value.body is not None and caught.value.body["param"] == param  # type: ignore[index]


def test_auto_choice_without_a_tool_parser_is_refused_not_dropped(
        serve_tiny: Callable[..., AbstractContextManager[ServerProcess]]) -> None:
    with serve_tiny() as server:
        plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            plain.chat.completions.create(model=_model(plain), messages=ASK, tools=TOOLS, max_tokens=2)


def test_an_unknown_parser_stops_the_server_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hermes"):
        from cadence.api.serving import ServerSettings
        ServerSettings(served_model_names=("m",), tool_call_parser="no-such-parser")
