"""``POST /v1/responses`` and ``GET /v1/models/{id}`` through a real ``cadence serve`` of the tiny
random Llama (the chat template, hermes tool parser and qwen3 reasoning parser of
tests/api/test_tools_api.py), driven by OpenAI's client, raw HTTP and the ``openai-agents`` SDK;
every body and every stream event validated against OpenAI's published spec.

A random model writes no text worth reading, so answers are forced with vLLM's
``structured_outputs`` (a ``choice`` of one text); ``required`` and named tool choices are enforced
by the server's own constraint, so any sampled output holds calls valid under the tool's schema.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import msgspec
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support.openai_spec import OpenAISpec
from support.scripted_engine import ScriptedEngine, out, step
from support.tiny_models import build_tiny_tokenizer
from support.tool_chat import FORCED, SCHEMAS, TEMPLATE, TOOLS

from cadence.api.app import build_app
from cadence.api.chat_output import ChoiceOutput
from cadence.api.conversation import conversation_prompt
from cadence.api.errors import APIError
from cadence.api.params import ChatTemplateArgs
from cadence.api.protocol import ChatMessage, ContentPart, FunctionCall, MessageToolCall
from cadence.api.reasoning_parsers import load_reasoning_parser
from cadence.api.response_store import RESPONSE_STORE, ResponseStore
from cadence.api.responses import create_response
from cadence.api.responses_conversation import input_messages, output_messages
from cadence.api.responses_events import EventStream, OutputItemAdded, OutputTextDelta, stream_events
from cadence.api.responses_output import ResponseOutput
from cadence.api.responses_protocol import FunctionToolCall, OutputMessage, OutputText, ReasoningItem, ResponsesRequest
from cadence.api.serving import APIState, ServerSettings
from cadence.api.testing import ServerProcess
from cadence.api.tool_parsers import load_tool_parser
from cadence.api.tools import ToolMode

# The Responses API's function tools are flat: {"type": "function", "name", "parameters", ...}.
FLAT_TOOLS: Any = [{"type": "function", **tool["function"]} for tool in TOOLS]
TEXT = "Sunny, 21 degrees."
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent", "response.incomplete": "ResponseIncompleteEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent", "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "error": "ResponseErrorEvent",
}


@pytest.fixture(scope="module")
def server(tool_chat_server: ServerProcess) -> ServerProcess:
    return tool_chat_server


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    return str(httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"])


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/v1", timeout=120) as c:
        yield c


def forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"choice": [text]}}


def prompt_tokens(conversation: list[dict[str, Any]], tools: Any = None) -> int:
    """How many tokens the chat template makes of a conversation (calls' arguments as objects)."""
    ids = build_tiny_tokenizer().apply_chat_template(conversation, tools=tools, chat_template=TEMPLATE,
                                                     add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(ids["input_ids"])


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as two answers to one request share them: ids are made fresh for each."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A stream's events: (the ``event:`` line, the data)."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) == {"event", "data"}, block
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def accumulated(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items a client builds from item events: each opened, filled by its deltas, and equal at
    its ``done`` to the item sent there (its status aside)."""
    items: dict[int, dict[str, Any]] = {}
    for data in events:
        kind, index = data["type"], data.get("output_index", -1)
        if kind == "response.output_item.added":
            assert data["item"]["status"] == "in_progress" and index == len(items)
            items[index] = copy.deepcopy(data["item"])
        elif kind == "response.content_part.added":
            items[index]["content"].append(data["part"])
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert data["item_id"] == items[index]["id"]
            items[index]["content"][data["content_index"]]["text"] += data["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += data["delta"]
        elif kind == "response.output_item.done":
            assert {**items[index], "status": data["item"]["status"]} == data["item"]
            items[index] = data["item"]
    return [items[i] for i in sorted(items)]


def checked_stream(text: str, spec: OpenAISpec) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Checks a stream as OpenAI's clients read it (each event valid under its schema, typed and
    numbered in order, between ``response.created`` and its end) and returns what a client
    accumulates from its deltas (the items) and its last event's response."""
    events = sse_events(text)
    assert [kind for kind, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1][0] in ("response.completed", "response.incomplete")
    for number, (kind, data) in enumerate(events):
        spec.validate(data, EVENT_SCHEMAS[kind])
        assert data["type"] == kind and data["sequence_number"] == number
    items = accumulated([data for _, data in events])
    response = events[-1][1]["response"]
    spec.validate(response, "Response")
    assert items == response["output"]
    return items, response


# ---- one answer ------------------------------------------------------------------------------


def test_a_text_answer_is_one_message_item_and_echoes_the_request(http: httpx.Client, model: str,
                                                                  spec: OpenAISpec) -> None:
    body = http.post("/responses", json={
        "model": model, "input": "Weather in Paris?", "instructions": "Be brief.", "temperature": 0,
        "max_output_tokens": 200, "metadata": {"run": "7"}, "user": "u1", **forced(TEXT)}).json()
    spec.validate(body, "Response")
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["id"].startswith("msg_") and message["content"] == [
        {"type": "output_text", "text": TEXT, "annotations": [], "logprobs": []}]
    assert {k: body[k] for k in ("instructions", "temperature", "top_p", "tool_choice", "tools", "metadata",
                                 "max_output_tokens", "parallel_tool_calls", "store", "user", "text",
                                 "incomplete_details", "error", "previous_response_id")} == {
        "instructions": "Be brief.", "temperature": 0.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
        "metadata": {"run": "7"}, "max_output_tokens": 200, "parallel_tool_calls": True, "store": True,
        "user": "u1", "text": {"format": {"type": "text"}, "verbosity": None}, "incomplete_details": None,
        "error": None, "previous_response_id": None}
    usage = body["usage"]
    expected_prompt = prompt_tokens([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Weather in Paris?"}])
    assert usage["input_tokens"] == expected_prompt and usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > usage["input_tokens"]


def test_auto_choice_gives_the_reasoning_and_a_hermes_call_as_items(client: openai.OpenAI, model: str,
                                                                    spec: OpenAISpec) -> None:
    raw = client.responses.with_raw_response.create(model=model, input="Weather in Paris?", tools=FLAT_TOOLS,
                                                    max_output_tokens=350, temperature=0, extra_body=forced(FORCED))
    body = json.loads(raw.text)
    spec.validate(body, "Response")
    reasoning, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I should look it up."}]
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "get_weather", {"city": "Paris", "days": 2}, "completed")
    usage = body["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


@pytest.mark.parametrize("text", [TEXT, FORCED])
def test_the_stream_accumulates_to_the_whole_answer(http: httpx.Client, client: openai.OpenAI, model: str,
                                                    spec: OpenAISpec, text: str) -> None:
    request: Any = dict(model=model, input="Weather in Paris?", tools=FLAT_TOOLS, max_output_tokens=350,
                        temperature=0, extra_body=forced(text))
    whole = json.loads(client.responses.with_raw_response.create(**request).text)
    body = {k: v for k, v in request.items() if k != "extra_body"} | forced(text) | {"stream": True}
    streamed = http.post("/responses", json=body)
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    items, response = checked_stream(streamed.text, spec)
    assert without_ids(items) == without_ids(whole["output"]) and response["status"] == "completed"
    assert response["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    # OpenAI's client accumulates the same response, through either of its stream calls.
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert without_ids([item.model_dump(exclude_none=True) for item in final.output]) == without_ids(
        [{k: v for k, v in item.items() if v is not None} for item in whole["output"]])
    kinds = [event.type for event in client.responses.create(stream=True, **request)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_a_response_cut_by_max_output_tokens_is_incomplete(http: httpx.Client, model: str, spec: OpenAISpec) -> None:
    request = {"model": model, "input": "Tell a story", "max_output_tokens": 3, "ignore_eos": True}
    body = http.post("/responses", json=request).json()
    spec.validate(body, "Response")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3 and [item["status"] for item in body["output"]] == ["incomplete"]
    items, response = checked_stream(http.post("/responses", json={**request, "stream": True}).text, spec)
    assert response["status"] == "incomplete" and [item["status"] for item in items] == ["incomplete"]


# ---- tools -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_required_and_named_choices_always_call_with_valid_arguments(client: openai.OpenAI, model: str,
                                                                     choice: Any, stream: bool) -> None:
    for seed in range(4):
        request: Any = dict(model=model, input="Weather in Paris?", tools=FLAT_TOOLS, tool_choice=choice,
                            parallel_tool_calls=False, max_output_tokens=350, temperature=1.0,
                            extra_body={"seed": seed})
        if stream:
            with client.responses.stream(**request) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**request)
        (call,) = response.output
        assert call.type == "function_call" and call.status == "completed", (seed, response.output)
        if choice != "required":
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ---- conversations ---------------------------------------------------------------------------


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="Weather in Paris?", instructions="Be brief.",
                                    max_output_tokens=200, extra_body=forced(TEXT))
    second = client.responses.create(model=model, input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=200, extra_body=forced("Rain."))
    assert second.previous_response_id == first.id and second.output_text == "Rain."
    # The earlier input and output come first; the earlier instructions applied to that request only.
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens([
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": TEXT},
        {"role": "user", "content": "And tomorrow?"}])


def test_a_function_call_output_answers_the_call(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="Weather in Paris?", tools=FLAT_TOOLS, max_output_tokens=350,
                                    temperature=0, extra_body=forced(FORCED))
    call = first.output[-1]
    assert call.type == "function_call"
    answer: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    expected = prompt_tokens([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], tools=TOOLS)
    stored = client.responses.create(model=model, previous_response_id=first.id, input=[answer], tools=FLAT_TOOLS,
                                     tool_choice="none", max_output_tokens=200, extra_body=forced(TEXT))
    # The same turn sent whole, as a client that keeps its own history does.
    history: Any = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), answer]
    sent = client.responses.create(model=model, input=history, tools=FLAT_TOOLS, tool_choice="none",
                                   max_output_tokens=200, extra_body=forced(TEXT), store=False)
    for response in (stored, sent):
        assert response.output_text == TEXT and response.usage is not None
        assert response.usage.input_tokens == expected


def test_what_is_not_stored_cannot_be_continued(client: openai.OpenAI, model: str) -> None:
    unstored = client.responses.create(model=model, input="hi", max_output_tokens=5, store=False)
    assert getattr(unstored, "store", None) is False
    for previous in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model=model, input="hi", max_output_tokens=5, previous_response_id=previous)
        body: Any = caught.value.body
        assert (body["param"], body["code"]) == ("previous_response_id", "previous_response_not_found")


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "get_time", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "[1]"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_object"}}, **forced("a")}, "structured_outputs"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
])
def test_a_request_the_server_cannot_serve_is_a_400_naming_the_field(
        http: httpx.Client, model: str, spec: OpenAISpec, fields: dict[str, Any], param: str) -> None:
    reply = http.post("/responses", json={"model": model, "input": "hi", "max_output_tokens": 5, **fields})
    assert reply.status_code == 400, reply.text
    spec.validate(reply.json(), "ErrorResponse")
    assert reply.json()["error"]["param"] == param


def test_a_failure_mid_stream_is_one_error_event(spec: OpenAISpec) -> None:
    """(In-process, over a scripted engine that fails after its first token.)"""
    def fails(_: Any) -> Iterator[Any]:
        yield step(out(0, "Hel", [5]))
        raise RuntimeError("the engine broke")

    async def run() -> tuple[str, str]:
        app = build_app(ScriptedEngine(fails), ServerSettings(served_model_names=("m",)))
        async with TestClient(TestServer(app)) as test_client:
            reply = await test_client.post("/v1/responses", json={"input": "hi", "stream": True},
                                           headers={"X-Request-Id": "r7"})
            return reply.headers["X-Request-Id"], await reply.text()

    request_id, text = asyncio.run(run())
    events = sse_events(text)
    for number, (kind, data) in enumerate(events):
        spec.validate(data, EVENT_SCHEMAS[kind])
        assert data["sequence_number"] == number
    assert request_id == "r7" and events[0][1]["response"]["id"].startswith("resp_")  # the id is never the header
    assert [kind for kind, _ in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added", "response.output_text.delta", "error"]
    assert events[-1][1]["code"] == "internal_error" and "the engine broke" in events[-1][1]["message"]


# ---- the agents SDK --------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_an_agent_calls_its_tool_then_answers(server: ServerProcess, model: str, model_class: str) -> None:
    """The first turn must call the tool (``tool_choice="required"``); the SDK then resets the choice,
    and the next turn answers in text through ``auto``. A bias towards the end-of-text token makes
    the random model's answer end well within its tokens (the constraint holds it off the call)."""
    import agents

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The forecast for a city."""
        cities.append(city)
        return f"Sunny in {city}"

    openai_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer briefly.", tools=[get_weather],
        model=getattr(agents, model_class)(model=model, openai_client=openai_client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                            extra_body={"seed": 1, "logit_bias": {"0": 4}}))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    assert cities and set(cities) <= {"Paris", "Rome"}
    assert isinstance(result.final_output, str) and len(result.raw_responses) == len(cities) + 1


# ---- GET /v1/models/{id} ---------------------------------------------------------------------


def test_a_served_model_s_card_and_another_s_404(http: httpx.Client, model: str, spec: OpenAISpec) -> None:
    card = http.get(f"/models/{model}")
    assert card.status_code == 200 and card.json() == http.get("/models").json()["data"][0]
    spec.validate(card.json(), "Model")
    missing = http.get("/models/gpt-4o")
    assert missing.status_code == 404
    spec.validate(missing.json(), "ErrorResponse")
    assert (missing.json()["error"]["param"], missing.json()["error"]["code"]) == ("model", "model_not_found")


# ---- the parts, without a server ---------------------------------------------------------------


def built(pieces: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Items of a text fed piece by piece (one token each), what its events accumulate to, and its
    reasoning tokens."""
    output = ResponseOutput(ChoiceOutput(ToolMode("auto"), load_tool_parser("hermes"), load_reasoning_parser("qwen3")))
    events = [event for piece in pieces for event in output.feed(piece, 1)] + output.finish(cut=False)
    items = [msgspec.to_builtins(item) for item in output.items]
    return items, accumulated([msgspec.to_builtins(event) for event in events]), output.reasoning_tokens


def test_output_items_are_the_same_however_the_text_is_cut() -> None:
    text = "<think>Look it up.</think>Let me see." + FORCED[FORCED.index("<tool_call>"):]
    whole, from_events, _ = built([text])
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"] and from_events == whole
    assert whole[1]["content"][0]["text"] == "Let me see." and whole[2]["name"] == "get_weather"
    for pieces in ([text[:cut], text[cut:]] for cut in range(1, len(text))):
        items, from_events, _ = built(pieces)
        assert without_ids(items) == without_ids(whole) and from_events == items
    # Tokens count as reasoning until the reasoning parser lets the answer through.
    assert built(["<think>", "I think", "</think>", "\n\nHi", " there"])[2] == 3
    assert built(["Hi", " there"])[2] == 0


def test_input_items_become_the_chat_conversation() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}',
            "id": "fc_1", "status": "completed"}
    req = msgspec.convert({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What time"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier reasoning is not rendered again
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        call, {**call, "call_id": "c2"},  # the calls of a turn join its message
        {"type": "function_call_output", "call_id": "c2", "output": "12:00"},
        {"type": "function_call_output", "call_id": "c0", "output": [{"type": "input_text", "text": "earlier"}]},
    ]}, ResponsesRequest)
    earlier = [ChatMessage(role="assistant", tool_calls=[MessageToolCall(id="c0", function=FunctionCall(
        name="get_time", arguments="{}"))])]  # a stored turn's call, answered in this input
    messages = input_messages(req, earlier)
    assert [(m.role, m.content, m.tool_call_id) for m in messages] == [
        ("user", [ContentPart(type="text", text="What time"), ContentPart(type="text", text="?")], None),
        ("assistant", [ContentPart(type="text", text="Let me see.")], None),
        ("tool", "12:00", "c2"), ("tool", [ContentPart(type="text", text="earlier")], "c0")]
    assert [call.id for call in messages[1].tool_calls or []] == ["c1", "c2"]
    with pytest.raises(APIError) as caught:
        input_messages(req, [])  # c0's call is nowhere before its output
    assert caught.value.param == "input[6].call_id"


def test_a_response_is_continued_from_its_text_and_completed_calls() -> None:
    items = [ReasoningItem(id="rs", status="completed"),
             OutputMessage(id="m", status="completed", content=[OutputText(text="Let me see.")]),
             FunctionToolCall(id="f1", call_id="c1", name="get_time", arguments='{"zone": "UTC"}', status="completed"),
             FunctionToolCall(id="f2", call_id="c2", name="get_time", arguments='{"zo', status="incomplete"),
             # completed, but no object: a named call cut by a stop string, or a schema that allows "x"
             FunctionToolCall(id="f3", call_id="c3", name="get_time", arguments='{"zone": "U', status="completed"),
             FunctionToolCall(id="f4", call_id="c4", name="get_time", arguments='"x"', status="completed")]
    (message,) = output_messages(items)
    assert (message.role, message.content, [call.id for call in message.tool_calls or []]) == (
        "assistant", "Let me see.", ["c1"])
    assert output_messages([]) == []


def test_the_handler_keeps_responses_in_its_app_s_store_up_to_its_bound() -> None:
    """``create_response(request, state)`` under a bare app, with a store of two."""
    engine = ScriptedEngine(lambda _: [step(out(0, "Hi", [5], "stop"))])
    state = APIState(engine, ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]
    store = ResponseStore(size=2)

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await create_response(request, state)
        except APIError as exc:  # what the app's middleware does
            return exc.response()

    app = web.Application()
    app[RESPONSE_STORE] = store
    app.router.add_post("/responses", handler)

    async def run() -> tuple[int, int]:
        async with TestClient(TestServer(app)) as test_client:
            async def post(**body: Any) -> Any:
                reply = await test_client.post("/responses", json={"input": "hi", **body})
                return reply.status, await reply.json()

            ids = [(await post())[1]["id"] for _ in range(3)]
            await post(store=False)
            assert len(store) == 2
            oldest, body = await post(previous_response_id=ids[0])
            assert body["error"]["param"] == "previous_response_id"
            return oldest, (await post(previous_response_id=ids[2]))[0]

    assert asyncio.run(run()) == (404, 200)


def test_a_conversation_s_errors_name_the_field_that_holds_it() -> None:
    engine = ScriptedEngine(lambda _: [])
    state = APIState(engine, ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]
    hi = [ChatMessage(role="user", content="hi")]
    ids = asyncio.run(conversation_prompt(state, hi, ChatTemplateArgs(), None, param="input"))
    assert ids == engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=True)["input_ids"]
    too_long = [ChatMessage(role="user", content="x" * (state.text_bound.max_bytes + 1))]
    with pytest.raises(APIError) as caught:
        asyncio.run(conversation_prompt(state, too_long, ChatTemplateArgs(), None, param="input"))
    assert (caught.value.param, caught.value.code) == ("input", "context_length_exceeded")


def test_an_event_stream_numbers_its_events_and_ends_a_failure_with_an_error_event(spec: OpenAISpec) -> None:
    async def produce(stream: EventStream) -> None:
        await stream.emit(OutputItemAdded(output_index=0, item=OutputMessage(id="msg_1", status="in_progress")))
        await stream.emit(OutputTextDelta(item_id="msg_1", output_index=0, content_index=0, delta="Hi"))
        raise APIError(503, "the engine is dead: gone", code="engine_dead")

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, produce)

    app = web.Application()
    app.router.add_post("/stream", handler)

    async def run() -> str:
        async with TestClient(TestServer(app)) as test_client:
            return await (await test_client.post("/stream")).text()

    events = sse_events(asyncio.run(run()))
    for number, (kind, data) in enumerate(events):
        spec.validate(data, EVENT_SCHEMAS[kind])
        assert data["type"] == kind and data["sequence_number"] == number
    assert events[-1] == ("error", {"type": "error", "sequence_number": 2, "code": "engine_dead",
                                    "message": "the engine is dead: gone", "param": None})
