"""``POST /v1/completions`` (``cadence/api/completions.py``) through the app over a scripted engine: a
batch of prompts gives ``len(prompts) * n`` choices indexed prompt-major, ``echo`` puts the prompt's
text before the first delta, logprobs' ``text_offset`` runs on across deltas, and ``suffix``,
``best_of`` != ``n`` are refused naming the field, ``echo`` with ``logprobs`` asks the engine for the
prompt's logprobs and puts them first (the first token's null); every body is checked against
OpenAI's published schemas (but for that null, which the legacy API sends and the schema omits)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from support.openai_spec import OpenAISpec
from support.scripted_engine import Call, ScriptedEngine, out, post_json, step

from cadence.api.completions import create_completion
from cadence.api.params import DEFAULT_COMPLETION_TOKENS
from cadence.api.serving import APIState, ServerSettings
from cadence.messages import RequestOutput, TokenLogprobs

# Tiny-tokenizer ids: "Paris" is "Par" "is", "Hello" is "He" "llo".
PAR, IS, HE, LLO = 279, 266, 276, 295
PROMPT_IDS = {"Paris": [PAR, IS], "Hello": [HE, LLO], "ab": [67, 68]}


Script = Callable[[int], list[RequestOutput]]


def prompt_index(call: Call) -> int:
    """Which prompt of the batch an engine request is for: its id's suffix."""
    assert call.request_id is not None
    return int(call.request_id.rsplit("-", 1)[1])


def scripted(script: Script) -> ScriptedEngine:
    """An engine whose every request plays ``script(prompt index)``."""
    return ScriptedEngine(lambda call: script(prompt_index(call)))


def post(engine: ScriptedEngine, body: dict[str, Any], max_waiting_requests: int | None = None) -> tuple[int, str]:
    settings = ServerSettings(served_model_names=("m",), max_waiting_requests=max_waiting_requests)
    reply = post_json(engine, "/v1/completions", body, settings)
    return reply.status, reply.text


def complete(engine: ScriptedEngine, body: dict[str, Any], spec: OpenAISpec) -> dict[str, Any]:
    status, text = post(engine, body)
    assert status == 200, text
    decoded: dict[str, Any] = json.loads(text)
    spec.validate(decoded, "CreateCompletionResponse")
    assert decoded["object"] == "text_completion" and decoded["model"] == "m"
    assert decoded["id"].startswith("cmpl-")
    return decoded


def streamed(engine: ScriptedEngine, body: dict[str, Any], spec: OpenAISpec) -> list[dict[str, Any]]:
    status, text = post(engine, {**body, "stream": True})
    assert status == 200, text
    *chunks, done = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert done == "[DONE]"
    decoded = [json.loads(chunk) for chunk in chunks]
    for chunk in decoded:
        spec.validate_completion_chunk(chunk)
    assert len({(c["id"], c["created"], c["object"]) for c in decoded}) == 1
    return decoded


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's streamed parts, in order (prompts run concurrently: their chunks interleave)."""
    parts: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            parts.setdefault(choice["index"], []).append(choice)
    return parts


def two_sequences(prompt: int) -> list[RequestOutput]:
    """Sequence 0 says "<prompt>a" and stops, sequence 1 "<prompt>b!" and hits the length."""
    return [step(out(0, f"{prompt}a", [5]), out(1, f"{prompt}b", [6])),
            step(out(0, "", [7], "stop"), out(1, "!", [8], "length"), cached=prompt)]


def test_a_batch_of_prompts_gives_prompt_major_choices(spec: OpenAISpec) -> None:
    engine = scripted(two_sequences)
    body = complete(engine, {"prompt": ["Paris", "Hello", "ab"], "n": 2}, spec)
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in body["choices"]] == [
        (0, "0a", "stop", None), (1, "0b!", "length", None),
        (2, "1a", "stop", None), (3, "1b!", "length", None),
        (4, "2a", "stop", None), (5, "2b!", "length", None)]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 0 + 1 + 2}}
    # One engine request per prompt, each with n sequences.
    assert sorted((c.request_id, c.request.prompt_token_ids) for c in engine.calls) == [
        (f"{body['id']}-0", PROMPT_IDS["Paris"]), (f"{body['id']}-1", PROMPT_IDS["Hello"]),
        (f"{body['id']}-2", PROMPT_IDS["ab"])]
    assert {(c.request.params.n, c.request.params.max_tokens) for c in engine.calls} == {
        (2, DEFAULT_COMPLETION_TOKENS)}


def test_a_token_whose_text_is_held_back_streams_a_chunk_without_text(spec: OpenAISpec) -> None:
    """As vLLM: every new token has its chunk (a client times each token by one), text or not; a
    delta without tokens (nothing sampled) sends none."""
    def held_back(prompt: int) -> list[RequestOutput]:
        return [step(out(0, "Pa", [PAR])), step(out(0, "", [])), step(out(0, "", [7])),
                step(out(0, "ris", [IS], "stop"))]

    parts = by_choice(streamed(scripted(held_back), {"prompt": "Paris"}, spec))
    assert [(p["text"], p["finish_reason"]) for p in parts[0]] == [("Pa", None), ("", None), ("ris", "stop")]


def test_a_streamed_batch_sends_each_choice_under_its_prompt_major_index(spec: OpenAISpec) -> None:
    request = {"prompt": ["Paris", "Hello", "ab"], "n": 2, "stream_options": {"include_usage": True}}
    *chunks, last = streamed(scripted(two_sequences), request, spec)
    assert all(len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    parts = by_choice(chunks)
    assert sorted(parts) == [0, 1, 2, 3, 4, 5]
    for index, choice_parts in parts.items():
        prompt, seq = divmod(index, 2)
        assert [p["text"] for p in choice_parts] == ([f"{prompt}a", ""] if seq == 0 else [f"{prompt}b", "!"])
        assert [p["finish_reason"] for p in choice_parts] == [None, "stop" if seq == 0 else "length"]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 3}}


@pytest.mark.parametrize(("prompt", "expected"), [
    ([PAR, IS], [[PAR, IS]]),  # token ids: one prompt
    ([[PAR, IS], [HE, LLO]], [[PAR, IS], [HE, LLO]]),  # a batch of token-id prompts
    ("Hello", [[HE, LLO]]),
])
def test_prompts_reach_the_engine_as_token_ids(spec: OpenAISpec, prompt: Any, expected: list[list[int]]) -> None:
    engine = scripted(lambda _: [step(out(0, "x", [5], "length"))])
    body = complete(engine, {"prompt": prompt, "max_tokens": 30}, spec)
    assert [c["text"] for c in body["choices"]] == ["x"] * len(expected)
    assert sorted(c.request.prompt_token_ids for c in engine.calls) == sorted(expected)
    assert {c.request.params.max_tokens for c in engine.calls} == {30}


@pytest.mark.parametrize(("prompt", "echoed"), [
    ("Paris", ["Paris"]),
    ([PAR, IS], ["Paris"]),  # token ids are decoded for the echo
    (["Paris", "Hello"], ["Paris", "Hello"]),
])
def test_echo_puts_the_prompt_before_the_completion(spec: OpenAISpec, prompt: Any, echoed: list[str]) -> None:
    def script(_: int) -> list[RequestOutput]:
        return [step(out(0, "", [5])), step(out(0, " x", [6], "stop"))]  # the first delta holds its text back

    body = complete(scripted(script), {"prompt": prompt, "echo": True}, spec)
    assert [c["text"] for c in body["choices"]] == [f"{text} x" for text in echoed]
    chunks = streamed(scripted(script), {"prompt": prompt, "echo": True}, spec)
    parts = by_choice(chunks)
    for index, text in enumerate(echoed):
        # the echo goes out with the choice's first delta, even one without text of its own
        assert [p["text"] for p in parts[index]] == [text, " x"]


def test_echo_goes_to_every_choice_of_its_prompt(spec: OpenAISpec) -> None:
    body = complete(scripted(two_sequences), {"prompt": ["Paris", "ab"], "n": 2, "echo": True}, spec)
    assert [c["text"] for c in body["choices"]] == ["Paris0a", "Paris0b!", "ab1a", "ab1b!"]


# The sampled token first, then the top k in rank order.
def entry(*pairs: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[t for t, _ in pairs], logprobs=[lp for _, lp in pairs], sampled_rank=1)


def logprob_script(_: int) -> list[RequestOutput]:
    return [
        step(out(0, "Par", [PAR], logprobs=[entry((PAR, -0.5), (IS, -1.0))]),
             out(1, "He", [HE], logprobs=[entry((HE, -0.75), (HE, -0.75))])),
        step(out(0, "isHe", [IS, HE], "length",
                 logprobs=[entry((IS, -0.25), (IS, -0.25)), entry((HE, -2.0), (PAR, -1.5))]),
             out(1, "llo", [LLO], "stop", logprobs=[entry((LLO, -0.125), (PAR, -3.0))])),
    ]


def test_logprobs_offsets_run_on_across_deltas(spec: OpenAISpec) -> None:
    engine = scripted(logprob_script)
    body = complete(engine, {"prompt": "Paris", "n": 2, "logprobs": 1}, spec)
    assert engine.calls[0].request.params.logprobs == 1
    assert [c["logprobs"] for c in body["choices"]] == [
        {"tokens": ["Par", "is", "He"], "token_logprobs": [-0.5, -0.25, -2.0],
         # the sampled token is always among the top entries (k + 1 of them at most)
         "top_logprobs": [{"is": -1.0, "Par": -0.5}, {"is": -0.25}, {"Par": -1.5, "He": -2.0}],
         "text_offset": [0, 3, 5]},
        {"tokens": ["He", "llo"], "token_logprobs": [-0.75, -0.125],
         "top_logprobs": [{"He": -0.75}, {"Par": -3.0, "llo": -0.125}],
         "text_offset": [0, 2]},
    ]


def test_streamed_logprobs_carry_the_offsets_so_far(spec: OpenAISpec) -> None:
    parts = by_choice(streamed(scripted(logprob_script), {"prompt": "Paris", "n": 2, "logprobs": 1}, spec))
    assert [(p["logprobs"]["tokens"], p["logprobs"]["text_offset"]) for p in parts[0]] == [
        (["Par"], [0]), (["is", "He"], [3, 5])]
    assert [(p["logprobs"]["tokens"], p["logprobs"]["text_offset"]) for p in parts[1]] == [
        (["He"], [0]), (["llo"], [2])]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"suffix": "!"}, "suffix", "suffix is not supported"),
    ({"best_of": 2}, "best_of", "best_of must equal n (1): cadence does not rank extra candidates"),
    ({"best_of": 3, "n": 2}, "best_of", "best_of must equal n (2): cadence does not rank extra candidates"),
])
def test_unsupported_fields_are_refused_naming_the_field(spec: OpenAISpec, fields: dict[str, Any], param: str,
                                                         message: str) -> None:
    for stream in (False, True):  # refused before a stream opens
        engine = scripted(two_sequences)
        status, text = post(engine, {"prompt": "Paris", **fields, "stream": stream})
        assert status == 400
        error = json.loads(text)
        spec.validate(error, "ErrorResponse")
        assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(message)
        assert engine.calls == []


def test_echo_with_logprobs_asks_for_the_prompts_and_puts_them_first(spec: OpenAISpec) -> None:
    """Each choice of the prompt gets its logprobs, the first token's null, offsets from 0 on."""
    prompt = [TokenLogprobs(token_ids=[IS, PAR], logprobs=[-0.5, -0.25], sampled_rank=2)]
    first = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], finished=False,
                          outputs=[out(0, "He", [HE], logprobs=[TokenLogprobs([HE], [-1.0], 1)]),
                                   out(1, "llo", [LLO], logprobs=[TokenLogprobs([LLO], [-2.0], 1)])],
                          prompt_logprobs=[None, *prompt])
    engine = scripted(lambda _: [first, step(out(0, "", [7], "length"), out(1, "", [7], "length"))])
    status, text = post(engine, {"prompt": "Paris", "echo": True, "logprobs": 1, "n": 2, "max_tokens": 2})
    assert status == 200, text
    assert engine.calls[0].request.params.prompt_logprobs == 1
    choices = json.loads(text)["choices"]
    assert [c["text"] for c in choices] == ["ParisHe", "Parisllo"]
    logprobs = choices[0]["logprobs"]
    assert logprobs["tokens"][:3] == ["Par", "is", "He"] and logprobs["text_offset"][:3] == [0, 3, 5]
    assert logprobs["token_logprobs"][:3] == [None, -0.5, -1.0]
    assert logprobs["top_logprobs"][:2] == [None, {"Par": -0.25, "is": -0.5}]
    assert choices[1]["logprobs"]["token_logprobs"][:3] == [None, -0.5, -2.0]


@pytest.mark.parametrize("fields", [{"suffix": ""}, {"best_of": 1}, {"best_of": 2, "n": 2}, {"echo": True},
                                    {"logprobs": 0}])
def test_their_harmless_forms_are_accepted(spec: OpenAISpec, fields: dict[str, Any]) -> None:
    n = fields.get("n", 1)
    body = complete(scripted(lambda _: [step(*(out(i, "x", [5], "stop") for i in range(n)))]),
                    {"prompt": "ab", **fields}, spec)
    assert [c["text"] for c in body["choices"]] == ["abx" if fields.get("echo") else "x"] * n


def test_a_batch_is_admitted_as_one_request_per_prompt(spec: OpenAISpec) -> None:
    # With 2 requests pending and a limit of 4, a batch of 2 prompts fits and one of 3 does not (n aside).
    engine = scripted(two_sequences)
    engine.num_pending_requests = 2
    status, text = post(engine, {"prompt": ["Paris", "ab"], "n": 2}, max_waiting_requests=4)
    assert status == 200, text
    status, text = post(engine, {"prompt": ["Paris", "ab", "Hello"], "n": 2}, max_waiting_requests=4)
    assert status == 503
    error = json.loads(text)
    spec.validate(error, "ErrorResponse")
    assert error["error"]["code"] == "engine_overloaded" and "2 requests pending" in error["error"]["message"]
    assert len(engine.calls) == 2  # only the first batch reached the engine


def test_the_handler_runs_over_a_state_of_its_own(spec: OpenAISpec) -> None:
    """``create_completion(request, state)`` without the app's routes and middlewares."""
    engine = scripted(lambda prompt: [step(out(0, f"<{prompt}>", [5], "stop"))])
    state = APIState(engine, ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await create_completion(request, state)

    app = web.Application()
    app.router.add_post("/complete", handler)
    reply = post_json(app, "/complete", {"prompt": ["ab", "ab"]})
    status, text = reply.status, reply.text
    assert status == 200, text
    body = json.loads(text)
    spec.validate(body, "CreateCompletionResponse")
    assert [c["text"] for c in body["choices"]] == ["<0>", "<1>"]
    assert state.num_in_flight == 0
