"""Structured output through a real ``cadence serve`` (SmolLM2, bf16) and OpenAI's client:
``response_format`` json_schema streamed and not, vLLM's ``structured_outputs``, and bad constraints
answered with a 400 that names the problem and the field, without disturbing other requests."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from support.openai_spec import OpenAISpec

from cadence.api.testing import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smol"
PERSON = {"type": "object", "required": ["name", "age", "hobbies"], "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "running", "music"]}, "maxItems": 2},
}}
ASK_PERSON: Any = [{"role": "user", "content": "Describe a person as JSON."}]
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--dtype", "bfloat16", "--served-model-name", MODEL]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as process:
        yield process
        assert process.stop() == 0, process.log()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_response_format_json_schema(client: openai.OpenAI, spec: OpenAISpec) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK_PERSON, max_tokens=120, temperature=0, response_format=RESPONSE_FORMAT)
    spec.validate(json.loads(raw.text), "CreateChatCompletionResponse")
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_schema_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=120, temperature=0,
                                           response_format=RESPONSE_FORMAT)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=120,
                                                 temperature=0, response_format=RESPONSE_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert text == whole.choices[0].message.content


def test_structured_outputs_extra_body_on_both_endpoints(client: openai.OpenAI) -> None:
    options = ["Paris", "London", "Rome"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10,
        temperature=0.7, seed=5, extra_body={"structured_outputs": {"choice": options}})
    assert chat.choices[0].message.content in options
    completion = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower was finished:", max_tokens=10,
                                           temperature=0, extra_body={"structured_outputs": {"regex": r" ?1[89]\d\d"}})
    assert re.fullmatch(r" ?1[89]\d\d", completion.choices[0].text) and completion.choices[0].finish_reason == "stop"


# Once "yes" or "no" is out the grammar allows only the stop token, which min_tokens masks: the engine
# samples a token the grammar refuses and ends the request with finish reason "error". The front end
# accepts this (so it is the way to make a real engine fail a request on cue).
OUTLASTS_ITS_GRAMMAR = {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 5}
ASK_YES_NO: Any = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
REFUSED = "the request failed in the engine: the grammar does not allow the sampled token"


def test_a_request_that_fails_in_the_engine_is_a_500_naming_the_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_YES_NO, max_tokens=10, temperature=0,
                                       extra_body=OUTLASTS_ITS_GRAMMAR)
    assert caught.value.status_code == 500
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "server_error"
    assert caught.value.body["message"].startswith(REFUSED), caught.value.body


def test_a_streamed_request_that_fails_in_the_engine_ends_with_an_error_event(client: openai.OpenAI) -> None:
    chunks = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=10,
                                               temperature=0, stream=True, extra_body=OUTLASTS_ITS_GRAMMAR):
            chunks.append(chunk)
    assert caught.value.message.startswith(REFUSED), caught.value.message
    assert all(c.choices[0].finish_reason is None for c in chunks)
    # The engine lives on.
    after = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=10, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert after.choices[0].text in ("yes", "no") and after.choices[0].finish_reason == "stop"


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (name, extra body, param, message pattern)
    ("invalid JSON schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"n": {"type": "strin"}}}}}},
     "response_format.json_schema.schema",
     r"^response_format\.json_schema\.schema: invalid JSON schema: 'strin' is not valid under any of the given "
     r"schemas \(at \$\.properties\.n\.type\)$"),
    ("json_schema without a schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", r"^response_format of type json_schema needs json_schema\.schema$"),
    ("bad regex", {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex",
     r"^structured_outputs\.regex: invalid regex: Regex parsing error at position 5: Unclosed '\['$"),
    ("empty choice list", {"structured_outputs": {"choice": []}}, "structured_outputs",
     r"^structured_outputs\.choice must list at least one option"),
    ("bad grammar", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar",
     r"^structured_outputs\.grammar: invalid grammar: EBNF parser error"),
    ("two constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     r"^structured_outputs takes exactly one of json, regex, choice, grammar or json_object, got regex, choice"),
    ("both fields", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", r"^give response_format or structured_outputs, not both$"),
]


@pytest.mark.parametrize(("name", "body", "param", "message"), BAD, ids=[case[0] for case in BAD])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_bad_constraint_is_a_400_naming_the_problem(server: ServerProcess, spec: OpenAISpec, path: str, name: str,
                                                      body: dict[str, Any], param: str, message: str) -> None:
    prompt = {"messages": ASK_PERSON} if "chat" in path else {"prompt": "Hello"}
    response = httpx.post(f"{server.url}{path}", json={**prompt, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    spec.validate(error, "ErrorResponse")
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    assert re.search(message, error["error"]["message"]), error["error"]["message"]


def test_bad_constraints_leave_a_concurrent_unconstrained_request_unchanged(server: ServerProcess) -> None:
    async def run() -> tuple[str | None, list[str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        async def plain() -> str | None:
            out = await client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=24,
                                                       temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].message.content

        async def bad(extra: dict[str, Any]) -> str:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=24,
                                                     extra_body=extra)
            return str(caught.value)

        # One unconstrained request in flight at a time, sent before the bad ones and then after them:
        # it runs in steps of one row, as alone. (Two at once may share a step or not, as timing
        # falls; without AVX-512 the dense GEMMs round a row differently beside another, and a
        # near-tie at token 15 of this prompt then flips, constraints or not.)
        alone = await plain()
        before = await asyncio.gather(plain(), *(bad(body) for _, body, _, _ in BAD))
        after = await asyncio.gather(*(bad(body) for _, body, _, _ in BAD), plain())
        return alone, [before[0], after[-1]]

    alone, together = asyncio.run(run())
    assert together == [alone, alone]
