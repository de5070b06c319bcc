"""From OpenAI request bodies to the engine's inputs (``cadence/api/params.py``): every field that
maps to a ``SamplingParams`` field and its default when omitted, the 400s (and the field each names)
for bad values, output constraints, ``max_tokens`` against the context, and prompts and chat
messages as token ids, on the tiny random tokenizer (its chat template is ChatML's shape)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import pytest
from support.tiny_models import build_tiny_tokenizer
from tokenizers import processors

from cadence.api.constraints import ConstraintChecks
from cadence.api.errors import APIError
from cadence.api.params import (
    ChatTemplateArgs,
    chat_prompt,
    check_stream_options,
    completion_prompts,
    max_tokens_for,
    sampling_params,
    structured_outputs,
)
from cadence.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart
from cadence.api.request_body import decode_request
from cadence.engine.admission import ModelLimits
from cadence.engine.prefix_tokenizer import PrefixTokenizer
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

USER_HI = [{"role": "user", "content": "Hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
LIMITS = ModelLimits(max_model_len=64, vocab_size=320, kv_capacity_tokens=160, eos_token_id=0)
# What SamplingParams gets when the request sets nothing (max_tokens and logprobs are arguments).
DEFAULTS: dict[str, Any] = {
    "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None, "max_tokens": 16, "min_tokens": 0,
    "stop": [], "stop_token_ids": [], "ignore_eos": False, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "logprobs": None, "prompt_logprobs": None, "structured_outputs": None,
    "extra_args": None,
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def completion(**fields: Any) -> CompletionRequest:
    """A completion request as the server decodes it from JSON (``prompt`` "x" unless given)."""
    return decode_request(json.dumps({"prompt": "x", **fields}).encode(), CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    return decode_request(json.dumps({"messages": USER_HI, **fields}).encode(), ChatCompletionRequest)


def compact(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"))


def fields_of(params: SamplingParams) -> dict[str, Any]:
    return msgspec.structs.asdict(params)


def error_of(call: Callable[[], object]) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def assert_400(error: APIError, param: str | None, message: str, code: str | None = None) -> None:
    assert (error.status, error.type, error.param, error.code, error.message) == (
        400, "invalid_request_error", param, code, message)


# ---- decode_request ------------------------------------------------------------------------


def test_every_field_decodes_with_openai_names() -> None:
    req = completion(
        model="m", n=2, max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["a"], presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"5": 10, "7": -1.5}, stream=True, stream_options={"include_usage": True},
        user="u", response_format={"type": "json_object"}, top_k=4, min_p=0.1, repetition_penalty=1.2,
        stop_token_ids=[3], ignore_eos=True, min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False,
        priority=-1, echo=True, logprobs=0, best_of=1, suffix="s", add_special_tokens=False)
    assert (req.model, req.n, req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (
        "m", 2, 7, 0.5, 0.9, 3, ["a"])
    assert (req.presence_penalty, req.frequency_penalty, req.logit_bias) == (0.5, -0.5, {5: 10.0, 7: -1.5})
    assert (req.stream, req.stream_options is not None and req.stream_options.include_usage, req.user) == (
        True, True, "u")
    assert req.response_format is not None and req.response_format.type == "json_object"
    assert (req.top_k, req.min_p, req.repetition_penalty, req.stop_token_ids, req.ignore_eos, req.min_tokens) == (
        4, 0.1, 1.2, [3], True, 2)
    assert (req.include_stop_str_in_output, req.skip_special_tokens, req.priority) == (True, False, -1)
    assert (req.echo, req.logprobs, req.best_of, req.suffix, req.add_special_tokens) == (True, 0, 1, "s", False)


def test_null_means_the_default_and_unknown_fields_are_ignored() -> None:
    nulls = dict.fromkeys(["model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
                           "frequency_penalty", "logit_bias", "stream", "stream_options", "user", "response_format",
                           "top_k", "min_p", "repetition_penalty", "stop_token_ids", "structured_outputs",
                           "logprobs"])
    assert completion(**nulls, frobnicate=1, functions=[]) == CompletionRequest(prompt="x")
    assert chat(max_completion_tokens=None, top_logprobs=None, logprobs=None, tools=None,
                functions=[]) == ChatCompletionRequest(messages=[ChatMessage(role="user", content="Hi")])


def test_chat_fields_decode() -> None:
    req = chat(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=3, add_generation_prompt=False,
               messages=[{"role": "system", "content": "s", "name": "n"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}])
    assert (req.max_tokens, req.max_completion_tokens, req.logprobs, req.top_logprobs) == (5, 9, True, 3)
    assert req.add_generation_prompt is False
    assert req.messages == [
        ChatMessage(role="system", content="s", name="n"),
        ChatMessage(role="user", content=[ContentPart(type="text", text="a"), ContentPart(type="image_url")]),
    ]


@pytest.mark.parametrize(("raw", "param", "message"), [
    (b"{", None, "the request body is not valid JSON: Input data was truncated"),
    (b"", None, "the request body is not valid JSON: Input data was truncated"),
    (b"[]", None, "Expected `object`, got `array`"),
    (b"{}", "prompt", "Object missing required field `prompt`"),
    (b'{"prompt": 1.5}', "prompt", "Expected `str | array`, got `float` - at `$.prompt`"),
    (b'{"prompt": [1.5]}', "prompt[0]", "Expected `int | str | array`, got `float` - at `$.prompt[0]`"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature",
     "Expected `float | null`, got `str` - at `$.temperature`"),
    (b'{"prompt": "x", "temperature": 2.5}', "temperature", "Expected `float` <= 2.0 - at `$.temperature`"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature", "Expected `float` >= 0.0 - at `$.temperature`"),
    (b'{"prompt": "x", "n": 0}', "n", "Expected `int` >= 1 - at `$.n`"),
    (b'{"prompt": "x", "n": 129}', "n", "Expected `int` <= 128 - at `$.n`"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p", "Expected `float` <= 1.0 - at `$.top_p`"),
    (b'{"prompt": "x", "min_p": -0.1}', "min_p", "Expected `float` >= 0.0 - at `$.min_p`"),
    (b'{"prompt": "x", "presence_penalty": -2.5}', "presence_penalty",
     "Expected `float` >= -2.0 - at `$.presence_penalty`"),
    (b'{"prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty",
     "Expected `float` <= 2.0 - at `$.frequency_penalty`"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", "Expected `int` >= 0 - at `$.max_tokens`"),
    (b'{"prompt": "x", "min_tokens": -1}', "min_tokens", "Expected `int` >= 0 - at `$.min_tokens`"),
    (b'{"prompt": "x", "logprobs": 21}', "logprobs", "Expected `int` <= 20 - at `$.logprobs`"),
    (b'{"prompt": "x", "seed": 1.5}', "seed", "Expected `int | null`, got `float` - at `$.seed`"),
    (b'{"prompt": "x", "logit_bias": {"a": 1}}', "logit_bias",
     "Expected `int`, got `str` - at `key` in `$.logit_bias`"),
    (b'{"prompt": "x", "stop": 5}', "stop", "Expected `str | array | null`, got `int` - at `$.stop`"),
    (b'{"prompt": "x", "stop_token_ids": ["a"]}', "stop_token_ids[0]",
     "Expected `int`, got `str` - at `$.stop_token_ids[0]`"),
    (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage",
     "Expected `bool | null`, got `str` - at `$.stream_options.include_usage`"),
    (b'{"prompt": "x", "response_format": {"type": "xml"}}', "response_format.type",
     "Invalid enum value 'xml' - at `$.response_format.type`"),
    (b'{"prompt": "x", "structured_outputs": {"regex": 1}}', "structured_outputs.regex",
     "Expected `str | null`, got `int` - at `$.structured_outputs.regex`"),
    (b'{"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}', "structured_outputs",
     "structured_outputs takes exactly one of json, regex, choice, grammar or json_object, got regex, choice "
     "- at `$.structured_outputs`"),
    (b'{"prompt": "x", "structured_outputs": {}}', "structured_outputs",
     "structured_outputs takes exactly one of json, regex, choice, grammar or json_object, got none "
     "- at `$.structured_outputs`"),
    (b'{"prompt": "x", "structured_outputs": {"choice": []}}', "structured_outputs",
     "structured_outputs.choice must list at least one option - at `$.structured_outputs`"),
    (b'{"prompt": "x", "structured_outputs": {"json": "{bad"}}', "structured_outputs",
     "structured_outputs.json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1) - at `$.structured_outputs`"),
], ids=lambda v: v.decode() if isinstance(v, bytes) else None)
def test_a_bad_completion_body_is_a_400_naming_the_field(raw: bytes, param: str | None, message: str) -> None:
    assert_400(error_of(lambda: decode_request(raw, CompletionRequest)), param, message)


@pytest.mark.parametrize(("raw", "param", "message"), [
    (b'{"model": "m"}', "messages", "Object missing required field `messages`"),
    (b'{"messages": [{}]}', "messages[0].role", "Object missing required field `role` - at `$.messages[0]`"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content",
     "Expected `str | array | null`, got `int` - at `$.messages[0].content`"),
    (b'{"messages": [{"role": "user", "content": [{"text": "a"}]}]}', "messages[0].content[0].type",
     "Object missing required field `type` - at `$.messages[0].content[0]`"),
    (b'{"messages": [], "top_logprobs": 21}', "top_logprobs", "Expected `int` <= 20 - at `$.top_logprobs`"),
    (b'{"messages": [], "logprobs": 2}', "logprobs", "Expected `bool | null`, got `int` - at `$.logprobs`"),
    (b'{"messages": [], "max_completion_tokens": -1}', "max_completion_tokens",
     "Expected `int` >= 0 - at `$.max_completion_tokens`"),
], ids=lambda v: v.decode() if isinstance(v, bytes) else None)
def test_a_bad_chat_body_is_a_400_naming_the_field(raw: bytes, param: str | None, message: str) -> None:
    assert_400(error_of(lambda: decode_request(raw, ChatCompletionRequest)), param, message)


# ---- sampling_params -----------------------------------------------------------------------


def test_defaults_when_nothing_is_set() -> None:
    for req in (completion(), chat()):
        params = sampling_params(req, max_tokens=16, logprobs=None)
        assert fields_of(params) == DEFAULTS
        assert params == SamplingParams(max_tokens=16)


# (body, what changes in SamplingParams)
FIELDS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"n": 3}, {"n": 3}),
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": 2}, {"temperature": 2.0}),
    ({"top_p": 0.5}, {"top_p": 0.5}),
    ({"top_k": 5}, {"top_k": 5}),
    ({"top_k": -1}, {"top_k": -1}),
    ({"min_p": 0.05}, {"min_p": 0.05}),
    ({"seed": 1234}, {"seed": 1234}),
    ({"seed": 0}, {"seed": 0}),
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"frequency_penalty": -2}, {"frequency_penalty": -2.0}),
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"logit_bias": {"5": 10, "7": -100}}, {"logit_bias": {5: 10.0, 7: -100.0}}),
    ({"logit_bias": {}}, {"logit_bias": None}),
    ({"stop": "###"}, {"stop": ["###"]}),
    ({"stop": ["a", "bc"]}, {"stop": ["a", "bc"]}),
    ({"stop": []}, {"stop": []}),
    ({"stop_token_ids": [3, 4]}, {"stop_token_ids": [3, 4]}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
    ({"min_tokens": 4}, {"min_tokens": 4}),
    ({"min_tokens": 16}, {"min_tokens": 16}),
    ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True}),
    ({"skip_special_tokens": False}, {"skip_special_tokens": False}),
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}},
     {"structured_outputs": StructuredOutputsParams(json_object=True)}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     {"structured_outputs": StructuredOutputsParams(json=compact(PERSON))}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": StructuredOutputsParams(regex="[a-z]+")}),
    ({"vllm_xargs": {"deadline_s": 2.5, "tier": "gold"}}, {"extra_args": {"deadline_s": 2.5, "tier": "gold"}}),
    ({"vllm_xargs": {}}, {"extra_args": None}),
    # fields the engine does not take: accepted, and nothing changes
    ({"user": "u", "priority": 3, "stream": False, "model": "m"}, {}),
]


@pytest.mark.parametrize(("body", "expected"), FIELDS, ids=[json.dumps(body) for body, _ in FIELDS])
def test_each_field_sets_its_sampling_param_and_only_it(body: dict[str, Any], expected: dict[str, Any]) -> None:
    for req in (completion(**body), chat(**body)):
        constraint = structured_outputs(req)
        params = sampling_params(req, max_tokens=16, logprobs=None, constraint=constraint[0] if constraint else None)
        assert fields_of(params) == {**DEFAULTS, **expected}


def test_max_tokens_and_logprobs_are_the_callers() -> None:
    req = completion(max_tokens=3, logprobs=5)  # the endpoint resolves max_tokens with max_tokens_for first
    assert fields_of(sampling_params(req, max_tokens=7, logprobs=req.logprobs)) == {
        **DEFAULTS, "max_tokens": 7, "logprobs": 5}
    assert sampling_params(completion(logprobs=0), max_tokens=16, logprobs=0).logprobs == 0  # 0: the chosen token only
    assert sampling_params(chat(logprobs=True, top_logprobs=2), max_tokens=16, logprobs=2).logprobs == 2


def test_every_field_at_once() -> None:
    body = {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.01, "seed": 7, "presence_penalty": 0.25,
            "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"9": 5}, "stop": ["\n\n", "END"],
            "stop_token_ids": [0, 2], "ignore_eos": True, "min_tokens": 1, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "structured_outputs": {"choice": ["yes", "no"]}}
    expected = {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.01, "seed": 7,
                "presence_penalty": 0.25, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {9: 5.0},
                "max_tokens": 20, "min_tokens": 1, "stop": ["\n\n", "END"], "stop_token_ids": [0, 2],
                "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False, "logprobs": 3,
                "prompt_logprobs": None,
                "structured_outputs": StructuredOutputsParams(choice=["yes", "no"]), "extra_args": None}
    for req in (completion(**body), chat(**body)):
        constraint = structured_outputs(req)
        assert constraint is not None
        assert fields_of(sampling_params(req, max_tokens=20, logprobs=3, constraint=constraint[0])) == expected


@pytest.mark.parametrize(("body", "max_tokens", "param", "message"), [
    ({"top_k": -2}, 16, "top_k", "top_k must be -1 (disable), 0 (disable) or positive, got -2"),
    ({"top_p": 0}, 16, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"repetition_penalty": 0}, 16, "repetition_penalty", "repetition_penalty must be > 0, got 0.0"),
    ({"stop": ""}, 16, "stop", "stop strings must not be empty"),
    ({"stop": ["a", ""]}, 16, "stop", "stop strings must not be empty"),
    ({"logit_bias": {"1": 100.5}}, 16, "logit_bias", "logit_bias values must be in [-100, 100]"),
    ({"min_tokens": 17}, 16, "min_tokens", "min_tokens (17) must not exceed max_tokens (16)"),
    ({}, 0, "max_tokens", "max_tokens must be at least 1, got 0"),
])
def test_a_value_sampling_params_rejects_is_a_400_naming_the_field(body: dict[str, Any], max_tokens: int, param: str,
                                                                   message: str) -> None:
    for req in (completion(**body), chat(**body)):
        assert_400(error_of(partial(sampling_params, req, max_tokens=max_tokens, logprobs=None)), param, message)


# ---- structured_outputs ----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "expected", "param"), [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
    # A schema becomes its compact text: what the engine core gets is a string, whatever numbers it holds.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     StructuredOutputsParams(json=compact(PERSON)), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": PERSON}}, StructuredOutputsParams(json=compact(PERSON)),
     "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(PERSON, indent=2)}}, StructuredOutputsParams(json=compact(PERSON)),
     "structured_outputs.json"),
    ({"structured_outputs": {"json": {"maxLength": 2**80}}},
     StructuredOutputsParams(json='{"maxLength":' + str(2**80) + "}"), "structured_outputs.json"),
    ({"structured_outputs": {"regex": r"\d{3}"}}, StructuredOutputsParams(regex=r"\d{3}"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["red", "blue"]}}, StructuredOutputsParams(choice=["red", "blue"]),
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredOutputsParams(grammar='root ::= "a" | "b"'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True),
     "structured_outputs.json_object"),
    # a text response_format is no constraint, so structured_outputs may come with it
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+"),
     "structured_outputs.regex"),
])
def test_the_constraint_comes_from_either_field(body: dict[str, Any], expected: StructuredOutputsParams | None,
                                                param: str | None) -> None:
    for req in (completion(**body), chat(**body)):
        assert structured_outputs(req) == (None if expected is None else (expected, param))


def checked(req: CompletionRequest | ChatCompletionRequest) -> None:
    """The request's constraint checked as the handlers check it."""
    constraint = structured_outputs(req)
    assert constraint is not None
    asyncio.run(ConstraintChecks(timeout_s=30).check(*constraint))


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "give response_format or structured_outputs, not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
      "structured_outputs": {"json": PERSON}}, "structured_outputs",
     "give response_format or structured_outputs, not both"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema",
     "response_format of type json_schema needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema",
     "response_format of type json_schema needs json_schema.schema"),
])
def test_a_constraint_in_the_wrong_place_is_a_400_naming_the_field(body: dict[str, Any], param: str,
                                                                   message: str) -> None:
    for req in (completion(**body), chat(**body)):
        assert_400(error_of(partial(structured_outputs, req)), param, message)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema",
     "response_format.json_schema.schema: invalid JSON schema: 5 is not valid under any of the given schemas "
     "(at $.type)"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json",
     "structured_outputs.json: invalid JSON schema: 'nonsense' is not valid under any of the given schemas "
     "(at $.type)"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json",
     "structured_outputs.json: invalid JSON schema: a schema must be a JSON object, got [1]"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(body: dict[str, Any], param: str, message: str) -> None:
    for req in (completion(**body), chat(**body)):
        assert_400(error_of(partial(checked, req)), param, message)


@pytest.mark.parametrize(("body", "param", "prefix"), [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "structured_outputs.regex: invalid regex: "),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar",
     "structured_outputs.grammar: invalid grammar: "),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field(body: dict[str, Any], param: str,
                                                                      prefix: str) -> None:
    # The rest of the message is xgrammar's own.
    error = error_of(lambda: checked(completion(**body)))
    assert (error.status, error.param, error.code) == (400, param, None)
    assert error.message.startswith(prefix) and len(error.message) > len(prefix)


# ---- check_stream_options --------------------------------------------------------------------


@pytest.mark.parametrize(("body", "include_usage"), [
    ({}, False),
    ({"stream": False}, False),
    ({"stream": True}, False),
    ({"stream": True, "stream_options": {}}, False),
    ({"stream": True, "stream_options": {"include_usage": False}}, False),
    ({"stream": True, "stream_options": {"include_usage": True}}, True),
    ({"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}, True),
    ({"stream": True, "stream_options": None}, False),
])
def test_usage_is_sent_only_when_streaming_asks_for_it(body: dict[str, Any], include_usage: bool) -> None:
    assert check_stream_options(completion(**body)) is include_usage
    assert check_stream_options(chat(**body)) is include_usage


@pytest.mark.parametrize("body", [
    {"stream_options": {"include_usage": True}},
    {"stream": False, "stream_options": {"include_usage": True}},
    {"stream": None, "stream_options": {}},
])
def test_stream_options_without_stream_is_a_400(body: dict[str, Any]) -> None:
    for req in (completion(**body), chat(**body)):
        assert_400(error_of(partial(check_stream_options, req)), "stream_options",
                   "stream_options is only allowed when stream is true")


# ---- max_tokens_for --------------------------------------------------------------------------


@pytest.mark.parametrize(("requested", "default", "num_prompt", "kv_capacity", "expected"), [
    (None, 16, 10, 160, 16),  # completions' default
    (None, None, 10, 160, 54),  # chat: all the room the context leaves
    (None, 16, 60, 160, 4),  # the default capped by the context
    (None, None, 63, 160, 1),
    (None, None, 10, 20, 10),  # capped by what the KV cache holds
    (None, 16, 10, 20, 10),
    (None, None, 30, 20, 1),  # never below 1 (admission refuses a prompt the cache cannot hold)
    (5, 16, 10, 160, 5),
    (54, None, 10, 160, 54),  # exactly fills the context
    (1, None, 63, 160, 1),
    (40, None, 10, 20, 40),  # as asked: admission checks it against the KV cache
    (0, 16, 10, 160, 0),  # as asked: SamplingParams refuses it (see above)
])
def test_max_tokens(requested: int | None, default: int | None, num_prompt: int, kv_capacity: int,
                    expected: int) -> None:
    limits = ModelLimits(max_model_len=64, vocab_size=320, kv_capacity_tokens=kv_capacity, eos_token_id=0)
    assert max_tokens_for(requested, default, num_prompt, limits) == expected


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_a_400_naming_the_field_given(param: str) -> None:
    assert_400(error_of(lambda: max_tokens_for(55, None, 10, LIMITS, param=param, prompt_param="messages")), param,
               "This model's maximum context length is 64 tokens. However, you requested 65 tokens (10 in the prompt, "
               f"55 for the completion); reduce the prompt or {param}", code="context_length_exceeded")
    assert_400(error_of(lambda: max_tokens_for(2, 16, 63, LIMITS, param=param)), param,
               "This model's maximum context length is 64 tokens. However, you requested 65 tokens (63 in the prompt, "
               f"2 for the completion); reduce the prompt or {param}", code="context_length_exceeded")


def test_the_default_param_names_are_the_completion_endpoints() -> None:
    assert error_of(lambda: max_tokens_for(60, 16, 10, LIMITS)).param == "max_tokens"
    assert error_of(lambda: max_tokens_for(None, 16, 64, LIMITS)).param == "prompt"


@pytest.mark.parametrize(("prompt_param", "num_prompt", "requested"),
                         [("prompt", 64, None), ("prompt", 100, 1), ("messages", 64, 5)])
def test_a_prompt_that_fills_the_context_is_a_400(prompt_param: str, num_prompt: int, requested: int | None) -> None:
    assert_400(error_of(lambda: max_tokens_for(requested, 16, num_prompt, LIMITS, prompt_param=prompt_param)),
               prompt_param, f"This model's maximum context length is 64 tokens, but the prompt has {num_prompt} "
               "tokens; shorten it to at most 63 tokens", code="context_length_exceeded")


# ---- completion_prompts ----------------------------------------------------------------------


def test_a_text_prompt_is_tokenized(tokenizer: Any) -> None:
    ids = tokenizer("Hello world").input_ids
    assert tokenizer.decode(ids) == "Hello world" and len(ids) > 1
    assert completion_prompts(completion(prompt="Hello world"), tokenizer) == [(ids, "Hello world")]
    assert completion_prompts(completion(prompt="Hello world", echo=True), tokenizer) == [(ids, "Hello world")]


def test_a_batch_of_text_prompts(tokenizer: Any) -> None:
    prompts = completion_prompts(completion(prompt=["Hello", "world", "Hello"]), tokenizer)
    hello, world = tokenizer("Hello").input_ids, tokenizer("world").input_ids
    assert prompts == [(hello, "Hello"), (world, "world"), (hello, "Hello")]


def test_add_special_tokens_reaches_the_tokenizer() -> None:
    tokenizer = build_tiny_tokenizer()  # with a BOS added on encoding, which the tiny one does not have
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    plain = tokenizer("Hi", add_special_tokens=False).input_ids
    assert completion_prompts(completion(prompt="Hi"), tokenizer) == [([0, *plain], "Hi")]
    assert completion_prompts(completion(prompt="Hi", add_special_tokens=False), tokenizer) == [(plain, "Hi")]
    assert completion_prompts(completion(prompt=[5, 6], add_special_tokens=True), tokenizer) == [([5, 6], "")]


def test_token_id_prompts_are_taken_as_they_are(tokenizer: Any) -> None:
    assert completion_prompts(completion(prompt=[5, 6, 7]), tokenizer) == [([5, 6, 7], "")]
    assert completion_prompts(completion(prompt=[[5, 6], [7]]), tokenizer) == [([5, 6], ""), ([7], "")]
    # echo: the text is decoded, for the response
    assert tokenizer.decode([5, 6, 7]) == "#$%"
    assert completion_prompts(completion(prompt=[5, 6, 7], echo=True), tokenizer) == [([5, 6, 7], "#$%")]
    assert completion_prompts(completion(prompt=[[5, 6], [7]], echo=True), tokenizer) == [([5, 6], "#$"), ([7], "%")]


def test_token_ids_outside_the_vocabulary_are_left_to_admission(tokenizer: Any) -> None:
    assert len(tokenizer) == 320
    assert completion_prompts(completion(prompt=[5, 320], echo=True), tokenizer) == [([5, 320], "")]
    assert completion_prompts(completion(prompt=[[999], [5]], echo=True), tokenizer) == [([999], ""), ([5], "#")]


def test_prompts_with_no_tokens_are_left_to_admission(tokenizer: Any) -> None:
    # Admission (validate_request) refuses an empty token list with a 400 naming the prompt.
    assert completion_prompts(completion(prompt=""), tokenizer) == [([], "")]
    assert completion_prompts(completion(prompt=[[]]), tokenizer) == [([], "")]
    assert completion_prompts(completion(prompt=["Hi", ""]), tokenizer) == [(tokenizer("Hi").input_ids, "Hi"),
                                                                           ([], "")]


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "prompt must not be empty"),
    (["a", [1]], "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"),
    ([1, [2]], "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"),
    (["Hello", 5], "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"),
    ([[1], "a", 2], "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"),
])
def test_an_empty_or_mixed_prompt_is_a_400(tokenizer: Any, prompt: Any, message: str) -> None:
    req = completion(prompt=prompt)  # the body decodes: the union allows each item
    assert_400(error_of(lambda: completion_prompts(req, tokenizer)), "prompt", message)


def test_prompts_sharing_a_long_start_get_the_same_ids_through_a_prefix_tokenizer(tokenizer: Any) -> None:
    """As the server tokenizes them (APIState.prompt_tokens): the shared start's ids reused."""
    prefixed = PrefixTokenizer(tokenizer)
    system = "Answer briefly and cite sources. " * 60
    for question in ("Where is Paris?", "Why is the sky blue?"):
        for special in (True, False):
            req = completion(prompt=system + question, add_special_tokens=special)
            assert completion_prompts(req, tokenizer, encode=prefixed.encode) == completion_prompts(req, tokenizer)
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        messages = chat(messages=conversation).messages
        assert chat_prompt(messages, tokenizer, encode=prefixed.encode) == tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert prefixed.reused_tokens > 0


# ---- chat_prompt -----------------------------------------------------------------------------


def rendered(tokenizer: Any, ids: list[int]) -> str:
    """The template's text, checked to be exactly what the ids encode."""
    text = tokenizer.decode(ids)
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    return str(text)


def test_one_user_message(tokenizer: Any) -> None:
    ids = chat_prompt(chat().messages, tokenizer)
    assert rendered(tokenizer, ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = chat_prompt(chat().messages, tokenizer, ChatTemplateArgs(add_generation_prompt=False))
    assert rendered(tokenizer, ids) == "<|im_start|>user\nHi<|im_end|>\n"


def test_every_role_and_developer_as_system(tokenizer: Any) -> None:
    messages = chat(messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"},
    ]).messages
    assert rendered(tokenizer, chat_prompt(messages, tokenizer)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined_by_newlines_and_no_content_is_empty(tokenizer: Any) -> None:
    messages = chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": ""}, {"role": "user"},
    ]).messages
    assert rendered(tokenizer, chat_prompt(messages, tokenizer)) == (
        "<|im_start|>user\na\nb c<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")


def test_the_template_sees_exactly_role_content_and_name() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}[{{ m | dictsort | map('first') | join(',') }}|{{ m['role'] }}|"
                               "{{ m['name'] | default('-') }}|{{ m['content'] }}]{% endfor %}")
    messages = chat(messages=[{"role": "developer", "content": "d"}, {"role": "user", "content": "u", "name": "bob"}])
    assert rendered(tokenizer, chat_prompt(messages.messages, tokenizer)) == (
        "[content,role|system|-|d][content,name,role|user|bob|u]")


@pytest.mark.parametrize(("messages", "param", "message"), [
    ([], "messages", "messages must not be empty"),
    ([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}], "messages[1].role",
     "messages[1].role must be one of assistant, developer, system, tool, user, got 'robot'"),
    ([{"role": "function", "content": "x"}], "messages[0].role",
     "messages[0].role must be one of assistant, developer, system, tool, user, got 'function'"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}], "messages[0].content",
     "messages[0].content[1] is of type 'image_url'; this server takes only text parts"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "input_audio"}]}],
     "messages[1].content", "messages[1].content[0] is of type 'input_audio'; this server takes only text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content",
     "messages[0].content[0] is of type 'text'; this server takes only text parts"),
])
def test_bad_messages_are_a_400_naming_the_field(tokenizer: Any, messages: list[dict[str, Any]], param: str,
                                                 message: str) -> None:
    req = chat(messages=messages)
    assert_400(error_of(lambda: chat_prompt(req.messages, tokenizer)), param, message)


def test_no_chat_template_is_a_400() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    assert_400(error_of(lambda: chat_prompt(chat().messages, tokenizer)), "messages",
               "this model's tokenizer has no chat template; use /v1/completions")


def test_a_template_that_raises_is_a_400() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be "
                               "the system prompt') }}{% endif %}{{ messages[0]['content'] }}")
    assert_400(error_of(lambda: chat_prompt(chat().messages, tokenizer)), "messages",
               "the chat template rejected the messages: the first message must be the system prompt")
    system = chat(messages=[{"role": "developer", "content": "Hi"}]).messages
    assert rendered(tokenizer, chat_prompt(system, tokenizer)) == "Hi"


def test_echo_may_be_null_as_the_spec_allows() -> None:
    assert not decode_request(b'{"prompt": "x", "echo": null}', CompletionRequest).echo
