"""The aiohttp app in-process over a scripted engine: internal failures (before and mid-stream)
and logprobs formatting, where a real engine cannot be made to misbehave on cue."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from support.openai_spec import OpenAISpec
from support.scripted_engine import ScriptedEngine, post_json
from support.tiny_models import build_tiny_tokenizer

from cadence.api.logprobs import TokenTexts, _bytes_to_unicode
from cadence.errors import EngineDeadError
from cadence.messages import CompletionOutput, RequestOutput, TokenLogprobs
from cadence.sampling_params import SamplingParams

Step = Callable[[SamplingParams], RequestOutput]


def delta(token_ids: list[int], text: str, finish: str | None = None, logprobs: list[TokenLogprobs] | None = None,
          error: str | None = None) -> Step:
    def make(params: SamplingParams) -> RequestOutput:
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], finished=finish is not None,
                             outputs=[CompletionOutput(index=0, text=text, token_ids=token_ids, logprobs=logprobs,
                                                       finish_reason=finish)], error=error)
    return make


def fail(exc: BaseException) -> Step:
    def make(params: SamplingParams) -> RequestOutput:
        raise exc
    return make


def call(script: list[Step], path: str, body: dict[str, Any]) -> tuple[int, str]:
    status, text, _ = call_then_scrape(script, path, body)
    return status, text


def call_then_scrape(script: list[Step], path: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """The response's status and body, then what ``/metrics`` says; the engine runs each step on the
    request's sampling parameters as it comes to it."""
    engine = ScriptedEngine(lambda call: (step(call.request.params) for step in script))
    reply = post_json(engine, path, body, scrape=True)
    return reply.status, reply.text, reply.metrics


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_an_internal_failure_is_500(spec: OpenAISpec) -> None:
    status, text = call([fail(RuntimeError("boom"))], "/v1/completions", {"prompt": "Paris"})
    assert status == 500
    spec.validate(json.loads(text), "ErrorResponse")
    assert json.loads(text)["error"]["code"] == "internal_error" and "boom" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize(("exc", "code"), [(RuntimeError("boom"), "internal_error"),
                                           (EngineDeadError("engine core exited"), "engine_dead")])
def test_a_mid_stream_failure_sends_an_error_event_and_closes(spec: OpenAISpec, exc: BaseException, code: str
                                                              ) -> None:
    status, text = call([delta([5], "ab"), fail(exc)], "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 200
    *chunks, error = events(text)
    assert "[DONE]" not in chunks and len(chunks) == 2  # the role, then "ab"
    spec.validate(json.loads(error), "ErrorResponse")
    assert json.loads(error)["error"]["code"] == code


def test_an_aborted_request_is_an_error_not_a_finish_reason() -> None:
    status, text = call([delta([5], "a"), delta([], "", finish="abort")], "/v1/completions", {"prompt": "Paris"})
    assert status == 503 and json.loads(text)["error"]["code"] == "aborted"


# What the engine sends when it ends a request with finish reason "error" (here its grammar failed to compile).
FAILED_IN_ENGINE = [delta([5], "a"), delta([], "", finish="error", error="the grammar failed to compile: boom")]
FAILED_MESSAGE = "the request failed in the engine: the grammar failed to compile: boom"


def test_a_request_that_fails_in_the_engine_is_a_500_naming_the_reason(spec: OpenAISpec) -> None:
    status, text, metrics = call_then_scrape(FAILED_IN_ENGINE, "/v1/chat/completions",
                                             {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 500
    spec.validate(json.loads(text), "ErrorResponse")
    assert json.loads(text) == {"error": {"message": FAILED_MESSAGE, "type": "server_error", "param": None,
                                          "code": "internal_error"}}
    assert 'cadence:request_success_total{finished_reason="error",model_name="m"} 1.0' in metrics
    assert 'finished_reason="stop"' not in metrics and 'finished_reason="abort"' not in metrics


def test_a_streamed_request_that_fails_in_the_engine_ends_with_an_error_event(spec: OpenAISpec) -> None:
    status, text = call(FAILED_IN_ENGINE, "/v1/completions", {"prompt": "Paris", "stream": True})
    assert status == 200
    chunk, error = events(text)  # "a", then the error instead of a finish reason (and no [DONE])
    assert json.loads(chunk)["choices"][0]["text"] == "a"
    spec.validate(json.loads(error), "ErrorResponse")
    assert json.loads(error)["error"]["message"] == FAILED_MESSAGE


def test_logprobs_formats(spec: OpenAISpec) -> None:
    tokenizer = build_tiny_tokenizer()
    byte_e2 = tokenizer.convert_tokens_to_ids(_bytes_to_unicode()[0xE2])
    paris = tokenizer("Paris").input_ids[0]
    entries = [TokenLogprobs(token_ids=[paris, paris, byte_e2], logprobs=[-0.5, -0.5, -math.inf], sampled_rank=1),
               TokenLogprobs(token_ids=[byte_e2, paris, byte_e2], logprobs=[-2.0, -0.1, -2.0], sampled_rank=2)]
    script = [delta([paris, byte_e2], "P", finish="length", logprobs=entries)]
    status, text = call(script, "/v1/completions", {"prompt": "Paris", "logprobs": 2, "echo": False})
    assert status == 200
    body = json.loads(text)
    spec.validate(body, "CreateCompletionResponse")
    texts = TokenTexts(tokenizer)
    assert texts.text(byte_e2) == "bytes:\\xe2" and texts.bytes(byte_e2) == [0xE2]
    p = texts.text(paris)
    assert body["choices"][0]["logprobs"] == {
        "tokens": [p, "bytes:\\xe2"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{p: -0.5, "bytes:\\xe2": -9999.0}, {p: -0.1, "bytes:\\xe2": -2.0}],
        "text_offset": [0, len(p)]}
    status, text = call(script, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "logprobs": True, "top_logprobs": 1})
    assert status == 200
    body = json.loads(text)
    spec.validate(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["bytes"], len(t["top_logprobs"])) for t in content] == [
        (p, list(p.encode()), 1), ("bytes:\\xe2", [0xE2], 1)]
