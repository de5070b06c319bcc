"""``POST /v1/chat/completions`` (``cadence/api/chat.py``) through the app over a scripted engine: what
each engine delta becomes, unstreamed and streamed (the role chunk first for every choice, content
deltas, finish reasons, the usage chunk), ``n`` > 1, logprobs, and ``max_completion_tokens`` against
``max_tokens``; every body is checked against OpenAI's published schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from support.openai_spec import OpenAISpec
from support.scripted_engine import Call, ScriptedEngine, out, post_json, step

from cadence.api.chat import create_chat_completion
from cadence.api.serving import APIState, ServerSettings
from cadence.messages import RequestOutput, TokenLogprobs

HI = [{"role": "user", "content": "hi"}]
# The tiny tokenizer's ChatML rendering of HI, with and without the assistant's opening.
HI_IDS = [1, 87, 85, 71, 84, 201, 74, 75, 2, 201, 1, 67, 85, 85, 266, 86, 260, 86, 201]
HI_IDS_NO_GENERATION_PROMPT = HI_IDS[:10]
MAX_MODEL_LEN = 64
# Tiny-tokenizer ids: "Par", "is", "He", "llo", "P".
PAR, IS, HE, LLO, P = 279, 266, 276, 295, 50


def scripted(deltas: list[RequestOutput]) -> ScriptedEngine:
    """An engine whose every request plays ``deltas``."""
    return ScriptedEngine(lambda _: deltas, max_model_len=MAX_MODEL_LEN)


def post(engine: ScriptedEngine, body: dict[str, Any], names: tuple[str, ...] = ("m",)) -> tuple[int, str]:
    reply = post_json(engine, "/v1/chat/completions", body, ServerSettings(served_model_names=names))
    return reply.status, reply.text


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def streamed(engine: ScriptedEngine, body: dict[str, Any], spec: OpenAISpec) -> list[dict[str, Any]]:
    """The chunks of a streamed request (checked against the spec), after checking it ends with [DONE]."""
    status, text = post(engine, {**body, "stream": True})
    assert status == 200, text
    *chunks, done = events(text)
    assert done == "[DONE]"
    decoded = [json.loads(chunk) for chunk in chunks]
    for chunk in decoded:
        spec.validate(chunk, "CreateChatCompletionStreamResponse")
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in decoded}) == 1
    assert decoded[0]["id"].startswith("chatcmpl-") and decoded[0]["object"] == "chat.completion.chunk"
    return decoded


# Two choices that end differently, interleaved; the middle step holds back text (a partial character).
TWO_CHOICES = [step(out(0, "Pa", [PAR]), out(1, "He", [HE])),
               step(out(1, "", [7])),
               step(out(1, "llo", [LLO], "length")),
               step(out(0, "ris", [IS], "stop"), cached=16)]


def test_an_unstreamed_chat_joins_the_deltas_and_counts_usage(spec: OpenAISpec) -> None:
    engine = scripted([step(out(0, "Pa", [PAR])), step(out(0, "", [7])),
                       step(out(0, "ris", [IS], "stop"), cached=16)])
    status, text = post(engine, {"model": "alias", "messages": HI, "user": "ann", "priority": 2},
                        names=("m", "alias"))
    assert status == 200, text
    body = json.loads(text)
    spec.validate(body, "CreateChatCompletionResponse")
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion" and body["model"] == "m"  # the first served name
    assert body["choices"] == [{"index": 0, "message": {"content": "Paris", "role": "assistant", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": len(HI_IDS), "completion_tokens": 3,
                             "total_tokens": len(HI_IDS) + 3, "prompt_tokens_details": {"cached_tokens": 16}}
    [call] = engine.calls
    assert call.request_id == body["id"] + "-0" and (call.priority, call.user) == (2, "ann")
    assert call.request.prompt_token_ids == HI_IDS
    params = call.request.params
    assert (params.n, params.max_tokens, params.logprobs) == (1, MAX_MODEL_LEN - len(HI_IDS), None)


def test_n_choices_unstreamed_are_indexed_with_their_own_finish_reasons(spec: OpenAISpec) -> None:
    engine = scripted(TWO_CHOICES)
    status, text = post(engine, {"messages": HI, "n": 2})
    assert status == 200, text
    body = json.loads(text)
    spec.validate(body, "CreateChatCompletionResponse")
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Paris", "stop"), (1, "Hello", "length")]
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert engine.calls[0].request.params.n == 2  # one engine request with two sequences


def test_a_stream_opens_with_each_choices_role_then_sends_content_deltas(spec: OpenAISpec) -> None:
    chunks = streamed(scripted(TWO_CHOICES), {"messages": HI, "n": 2}, spec)
    assert all(len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    assert [c["choices"][0] for c in chunks] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "Pa"}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None},
        # the step that held its text back sends its token's chunk without text, as vLLM does
        {"index": 1, "delta": {"content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": "llo"}, "logprobs": None, "finish_reason": "length"},
        {"index": 0, "delta": {"content": "ris"}, "logprobs": None, "finish_reason": "stop"},
    ]


def test_a_held_back_token_of_a_parsed_choice_sends_nothing(spec: OpenAISpec) -> None:
    """With a reasoning parser the stream's deltas are the parser's: a token whose text is held back
    changes nothing a client sees (vLLM sends no chunk either), only its plain twin gets an empty one."""
    deltas = [step(out(0, "Pa", [PAR])), step(out(0, "", [7])), step(out(0, "ris", [IS], "stop"))]
    for parser, held_back in ((None, [{"content": ""}]), ("deepseek_r1", [])):
        settings = ServerSettings(served_model_names=("m",), reasoning_parser=parser)
        reply = post_json(scripted(deltas), "/v1/chat/completions", {"messages": HI, "stream": True}, settings)
        assert reply.status == 200, reply.text
        *chunks, done = events(reply.text)
        assert done == "[DONE]"
        decoded = [json.loads(chunk) for chunk in chunks]
        for chunk in decoded:
            spec.validate(chunk, "CreateChatCompletionStreamResponse")
        field = "content" if parser is None else "reasoning_content"
        assert [c["choices"][0]["delta"] for c in decoded[1:]] == [{field: "Pa"}, *held_back, {field: "ris"}]


def test_a_finish_without_text_still_sends_its_finish_reason(spec: OpenAISpec) -> None:
    chunks = streamed(scripted([step(out(0, "Pa", [PAR])), step(out(0, "", [0], "stop"))]),
                      {"messages": HI}, spec)
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Pa"},
                                                          {"content": ""}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_include_usage_puts_null_usage_on_every_chunk_and_ends_with_a_usage_chunk(spec: OpenAISpec) -> None:
    request = {"messages": HI, "n": 2, "stream_options": {"include_usage": True}}
    *chunks, last = streamed(scripted(TWO_CHOICES), request, spec)
    assert len(chunks) == 7 and all(c["usage"] is None for c in chunks)  # the held-back token's chunk too
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": len(HI_IDS), "completion_tokens": 5, "total_tokens": len(HI_IDS) + 5,
                             "prompt_tokens_details": {"cached_tokens": 16}}
    # include_usage false: no usage anywhere, no usage chunk.
    plain = streamed(scripted(TWO_CHOICES), {**request, "stream_options": {"include_usage": False}}, spec)
    assert len(plain) == 7 and all("usage" not in c for c in plain)


def test_add_generation_prompt_false_renders_without_the_assistant_opening() -> None:
    engine = scripted([step(out(0, "x", [5], "stop"))])
    status, text = post(engine, {"messages": HI, "add_generation_prompt": False})
    assert status == 200, text
    assert engine.calls[0].request.prompt_token_ids == HI_IDS_NO_GENERATION_PROMPT
    assert json.loads(text)["usage"]["prompt_tokens"] == len(HI_IDS_NO_GENERATION_PROMPT)
    assert engine.calls[0].request.params.max_tokens == MAX_MODEL_LEN - len(HI_IDS_NO_GENERATION_PROMPT)


@pytest.mark.parametrize(("fields", "max_tokens"), [
    ({}, MAX_MODEL_LEN - len(HI_IDS)),  # all the room the context leaves
    ({"max_tokens": 9}, 9),
    ({"max_completion_tokens": 5}, 5),
    ({"max_completion_tokens": 5, "max_tokens": 9}, 5),
    ({"max_completion_tokens": 1, "max_tokens": 900}, 1),  # max_tokens is not even checked
    ({"max_tokens": MAX_MODEL_LEN - len(HI_IDS)}, MAX_MODEL_LEN - len(HI_IDS)),
])
def test_max_completion_tokens_wins_over_max_tokens(fields: dict[str, int], max_tokens: int) -> None:
    engine = scripted([step(out(0, "x", [5], "length"))])
    status, text = post(engine, {"messages": HI, **fields})
    assert status == 200, text
    assert engine.calls[0].request.params.max_tokens == max_tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": MAX_MODEL_LEN - len(HI_IDS) + 1}, "max_tokens"),
    ({"max_completion_tokens": MAX_MODEL_LEN - len(HI_IDS) + 1}, "max_completion_tokens"),
    ({"max_completion_tokens": 100, "max_tokens": 1}, "max_completion_tokens"),
])
def test_a_completion_over_the_context_names_the_field_that_asked(spec: OpenAISpec, fields: dict[str, int],
                                                                  param: str) -> None:
    for stream in (False, True):  # refused before a stream opens
        engine = scripted([])
        status, text = post(engine, {"messages": HI, **fields, "stream": stream})
        assert status == 400
        error = json.loads(text)
        spec.validate(error, "ErrorResponse")
        assert (error["error"]["param"], error["error"]["code"]) == (param, "context_length_exceeded")
        assert error["error"]["message"].endswith(f"reduce the prompt or {param}")
        assert engine.calls == []


# The sampled token first, then the top 3 in rank order.
ENTRY = TokenLogprobs(token_ids=[PAR, IS, P, HE], logprobs=[-0.5, -1.0, -2.0, -3.0], sampled_rank=1)
ENTRY_2 = TokenLogprobs(token_ids=[IS, IS, P, HE], logprobs=[-0.25, -0.25, -4.0, -5.0], sampled_rank=1)


def _token(text: str, logprob: float, top: list[dict[str, Any]]) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": top}


def _top(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


LOGPROB_SCRIPT = [step(out(0, "Par", [PAR], logprobs=[ENTRY])), step(out(0, "is", [IS], "stop", logprobs=[ENTRY_2]))]


@pytest.mark.parametrize(("top_logprobs", "expected_top"), [
    (None, [[], []]),
    (0, [[], []]),
    (2, [[_top("is", -1.0), _top("P", -2.0)], [_top("is", -0.25), _top("P", -4.0)]]),
])
def test_logprobs_list_each_token_with_its_top_alternatives(spec: OpenAISpec, top_logprobs: int | None,
                                                            expected_top: list[list[dict[str, Any]]]) -> None:
    engine = scripted(LOGPROB_SCRIPT)
    request: dict[str, Any] = {"messages": HI, "logprobs": True}
    if top_logprobs is not None:
        request["top_logprobs"] = top_logprobs
    status, text = post(engine, request)
    assert status == 200, text
    body = json.loads(text)
    spec.validate(body, "CreateChatCompletionResponse")
    assert engine.calls[0].request.params.logprobs == (top_logprobs or 0)
    assert body["choices"][0]["logprobs"] == {
        "content": [_token("Par", -0.5, expected_top[0]), _token("is", -0.25, expected_top[1])], "refusal": None}


def test_streamed_logprobs_come_with_their_chunk(spec: OpenAISpec) -> None:
    script = [step(out(0, "Par", [PAR], logprobs=[ENTRY])),
              step(out(0, "", [IS], logprobs=[ENTRY_2])),  # no text yet, but logprobs: still a chunk
              step(out(0, "is", [], "stop", logprobs=[]))]
    chunks = streamed(scripted(script), {"messages": HI, "logprobs": True, "top_logprobs": 1}, spec)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["logprobs"] is None  # the role chunk
    assert [(c["delta"], c["logprobs"], c["finish_reason"]) for c in choices[1:]] == [
        ({"content": "Par"}, {"content": [_token("Par", -0.5, [_top("is", -1.0)])], "refusal": None}, None),
        ({"content": ""}, {"content": [_token("is", -0.25, [_top("is", -0.25)])], "refusal": None}, None),
        ({"content": "is"}, {"content": [], "refusal": None}, "stop"),
    ]


def test_without_logprobs_no_chunk_carries_them(spec: OpenAISpec) -> None:
    engine = scripted(LOGPROB_SCRIPT)  # the engine's logprobs are dropped when none were asked
    chunks = streamed(engine, {"messages": HI, "logprobs": False}, spec)
    assert [c["choices"][0]["logprobs"] for c in chunks] == [None, None, None]
    assert engine.calls[0].request.params.logprobs is None


def test_the_handler_runs_over_a_state_of_its_own_and_counts_itself_in_flight(spec: OpenAISpec) -> None:
    """``create_chat_completion(request, state)`` without the app's routes and middlewares."""
    deltas = [step(out(0, "Paris", [PAR, IS], "stop"))]
    in_flight: list[int] = []

    def script(call: Call) -> list[RequestOutput]:
        in_flight.append(state.num_in_flight)
        return deltas

    engine = ScriptedEngine(script, max_model_len=MAX_MODEL_LEN)
    state = APIState(engine, ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await create_chat_completion(request, state)

    app = web.Application()
    app.router.add_post("/chat", handler)
    reply = post_json(app, "/chat", {"messages": HI})
    status, text = reply.status, reply.text
    assert status == 200, text
    spec.validate(json.loads(text), "CreateChatCompletionResponse")
    assert json.loads(text)["choices"][0]["message"]["content"] == "Paris"
    assert in_flight == [1] and state.num_in_flight == 0
