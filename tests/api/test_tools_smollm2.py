"""Tool calling on the default model (SmolLM2-135M-Instruct, bf16) through a real ``cadence serve``
and OpenAI's client: ``required`` and named tool choices always return calls of the given tools
whose arguments validate against their schemas (jsonschema), streamed and not, over many seeds
(the server enforces them with structured output, whatever the model would write), a two-turn
loop (call, the tool's result, an answer), and an ``openai-agents`` agent with a function tool on
the SDK's default (Responses) model class and on its chat-completions one. The seeds of one case
go in at once, so the constrained requests are batched together as users' would be."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest

from cadence.api.testing import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smol"
FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}}}
CONVERT = {"type": "object", "additionalProperties": False, "required": ["amount", "to"], "properties": {
    "amount": {"type": "number", "minimum": 0, "maximum": 1000}, "to": {"enum": ["EUR", "USD", "JPY"]}}}
TOOLS: Any = [{"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
                                                "parameters": FORECAST}},
              {"type": "function", "function": {"name": "convert_currency", "description": "Convert money",
                                                "parameters": CONVERT}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: Any = [{"role": "user", "content": "What will the weather be in Lisbon this week?"}]
SEEDS = range(10)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ["--dtype", "bfloat16", "--served-model-name", MODEL,
            "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as process:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="none", max_retries=0)
        assert process.stop() == 0, process.log()


def _calls(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The (name, arguments) of each call and the finish reason, as a client library accumulates them."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kwargs).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], choice.finish_reason
    calls: list[list[str]] = []
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True, **kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                if piece.index == len(calls):
                    calls.append([piece.function.name or "", ""])
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, arguments) for name, arguments in calls], finish


def _per_seed(call: Callable[[int], tuple[list[tuple[str, str]], str | None]]) -> dict[int, Any]:
    """``call(seed)`` for every seed, all in flight at once: each seed's calls and finish reason."""
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return dict(zip(SEEDS, pool.map(call, SEEDS), strict=True))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_choice_calls_tools_with_valid_arguments_for_every_seed(client: openai.OpenAI, stream: bool,
                                                                         parallel: bool) -> None:
    """One call without parallel calls; with them the model says how many, and one that runs into
    max_tokens keeps the calls it finished."""
    answers = _per_seed(lambda seed: _calls(client, stream, tool_choice="required", parallel_tool_calls=parallel,
                                            temperature=1.0, seed=seed, max_tokens=200))
    for seed, (calls, finish) in answers.items():
        assert calls and (finish == "tool_calls" if not parallel else finish in ("tool_calls", "length")), seed
        assert parallel or len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments_for_every_seed(client: openai.OpenAI, stream: bool) -> None:
    choice: Any = {"type": "function", "function": {"name": "convert_currency"}}
    answers = _per_seed(lambda seed: _calls(client, stream, tool_choice=choice, temperature=1.0, seed=seed,
                                            max_tokens=120))
    for seed, (calls, finish) in answers.items():
        assert finish == "stop" and [name for name, _ in calls] == ["convert_currency"], (seed, calls)
        jsonschema.validate(json.loads(calls[0][1]), CONVERT)


def test_a_two_turn_loop_answers_after_the_tools_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    result = {"forecast": "sunny, 24 degrees"}
    second = client.chat.completions.create(
        model=MODEL, tools=TOOLS, temperature=0, max_tokens=40,
        messages=[*ASK, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}])
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls") and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens if first.usage else True


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_an_agent_calls_its_tool_and_finishes(client: openai.OpenAI, model_class: str) -> None:
    """The first turn must call the tool; the SDK then resets the choice to ``auto`` (the hermes
    parser reads whatever the model writes) and runs until the model answers in text."""
    import agents

    agents.set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_forecast(city: str, days: int, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"Sunny for {days} days in {city}, 24 {unit}"

    async_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer briefly.", tools=[get_forecast],
        model=getattr(agents, model_class)(model=MODEL, openai_client=async_client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                            temperature=0))
    result = agents.Runner.run_sync(agent, "What will the weather be in Lisbon for 3 days?", max_turns=6)
    assert calls and all(isinstance(city, str) and isinstance(days, int) for city, days in calls)
    assert isinstance(result.final_output, str)
