"""The HTTP API against a real ``cadence serve`` process: OpenAI's clients, the spec's schemas,
greedy output equal to the offline ``LLM``, and every error case in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.openai_spec import OpenAISpec
from support.tiny_models import TINY_SPECIAL_TOKENS

from cadence import SamplingParams
from cadence.api.testing import ServerProcess
from cadence.engine.llm import LLM

KEY = "sk-test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world! How are you?"}]


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., ContextManager[ServerProcess]]) -> Iterator[ServerProcess]:
    with serve_tiny("--api-key", KEY, "--served-model-name", MODEL, "tiny-alias") as process:
        yield process


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(model=str(tiny_model), dtype="float32")


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON events of a stream, checking it ends with ``[DONE]``."""
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(item) for item in data[:-1]]


# ---- routes ----------------------------------------------------------------------------------


def test_models_health_version_metrics(http: httpx.Client, spec: OpenAISpec, server: ServerProcess) -> None:
    models = http.get("/v1/models").json()
    spec.validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == [MODEL, "tiny-alias"]
    bare = httpx.Client(base_url=server.url)  # probes need no key
    assert bare.get("/health").status_code == 200
    assert bare.get("/version").json()["version"]
    metrics = bare.get("/metrics")
    assert metrics.status_code == 200 and "cadence:num_requests_running" in metrics.text


def test_tokenize_and_detokenize(http: httpx.Client, offline: LLM) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["tokens"] == offline.tokenizer(PROMPT).input_ids and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == offline.apply_chat_template(CHAT)


# ---- generation --------------------------------------------------------------------------------


def test_greedy_completion_equals_offline(client: openai.OpenAI, http: httpx.Client, spec: OpenAISpec,
                                          offline: LLM) -> None:
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == expected.outputs[0].text
    assert result.usage is not None and result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0}).json()
    spec.validate(body, "CreateCompletionResponse")
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert body["choices"][0]["finish_reason"] == expected.outputs[0].finish_reason


def test_greedy_chat_equals_offline(client: openai.OpenAI, http: httpx.Client, spec: OpenAISpec,
                                    offline: LLM) -> None:
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    result = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10,  # type: ignore[arg-type]
                                            temperature=0)
    assert result.choices[0].message.content == expected.outputs[0].text
    assert result.choices[0].message.role == "assistant"
    body = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0}).json()
    spec.validate(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_streamed_completion_equals_unstreamed(client: openai.OpenAI, http: httpx.Client,
                                               spec: OpenAISpec) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=request).json()
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in streamed)
    assert text == whole["choices"][0]["text"]
    with http.stream("POST", "/v1/completions",
                     json={**request, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    for event in events:
        spec.validate_completion_chunk(event)
    *chunks, last = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all("usage" not in c for c in chunks)


def test_streamed_chat_opens_with_the_role_and_ends_with_usage(http: httpx.Client, spec: OpenAISpec) -> None:
    request = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=request).json()
    with http.stream("POST", "/v1/chat/completions",
                     json={**request, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = sse_events(response)
    for event in events:
        spec.validate(event, "CreateChatCompletionStreamResponse")
    *chunks, last = events
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"].get("content", "") for c in mine) == whole["choices"][index]["message"]["content"]
        assert mine[-1]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16 == whole["usage"]["completion_tokens"]


def test_async_client_n2_logprobs_and_stop(server: ServerProcess, spec: OpenAISpec) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        plain, completion, chat = await asyncio.gather(
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}),
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, logprobs=3, temperature=0.8,
                                      seed=11),
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, logprobs=True,  # type: ignore[arg-type]
                                           top_logprobs=2, seed=3, extra_body={"ignore_eos": True}),
        )
        assert [c.index for c in completion.choices] == [0, 1]
        for choice in completion.choices:
            lp = choice.logprobs
            assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
            assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == len(lp.text_offset or [])
            assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
            assert all(lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
        assert completion.usage is not None
        assert completion.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in completion.choices)  # type: ignore[union-attr,arg-type]
        for choice in chat.choices:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert len(choice.logprobs.content) == 6
            assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
            # The text skips special tokens; the logprobs show every token.
            raw = bytes(b for t in choice.logprobs.content if t.token not in TINY_SPECIAL_TOKENS for b in t.bytes or [])
            assert raw.decode(errors="replace") == choice.message.content
        # A stop string taken from the greedy text cuts it there.
        text = plain.choices[0].text
        stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
        stopped = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                  stop=[stop], extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == text[:text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True)  # type: ignore[arg-type,call-overload]
        chunks = [chunk async for chunk in await streamed]
        assert chunks[0].choices[0].delta.role == "assistant"
        await client.close()

    asyncio.run(run())


def test_usage_echo_and_batched_prompts(http: httpx.Client, spec: OpenAISpec) -> None:
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    single = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0}).json()
    assert single["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                               "total_tokens": len(prompt_ids) + 5, "prompt_tokens_details": single["usage"][
                                   "prompt_tokens_details"]}
    assert len(single["choices"][0]["logprobs"]["tokens"]) == 5
    echo = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True, "echo": True}).json()
    spec.validate(echo, "CreateCompletionResponse")
    assert echo["choices"][0]["text"] == PROMPT + single["choices"][0]["text"]
    batch = http.post("/v1/completions", json={"prompt": [PROMPT, "Hello world"], "n": 2, "max_tokens": 5,
                                               "temperature": 0, "ignore_eos": True}).json()
    spec.validate(batch, "CreateCompletionResponse")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"] == single["choices"][0]["text"]
    assert batch["usage"]["completion_tokens"] == 20


def test_seeded_sampling_repeats(http: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01,
               "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
               "logit_bias": {"5": 2}, "min_tokens": 4, "stop_token_ids": [7], "user": "u1", "priority": 0}
    first, second = (http.post("/v1/completions", json=request).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


# ---- errors ----------------------------------------------------------------------------------

ERROR_CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (name, path, body (bytes: sent raw), status, param, code)
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None, None),
    ("wrong type", "/v1/completions", {"prompt": "x", "n": "two"}, 400, "n", None),
    ("missing field", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("bad message", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role", None),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("temperature out of range", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", None),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("n out of range", "/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n", None),
    ("logprobs out of range", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("bad logit_bias key", "/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", None),
    ("token outside vocab", "/v1/completions", {"prompt": [5, 100000]}, 400, "prompt", None),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("prompt over the context", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt", "context_length_exceeded"),
    ("completion over the context", "/v1/completions", {"prompt": [5] * 10, "max_tokens": 600}, 400, "max_tokens",
     "context_length_exceeded"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "model", "model_not_found"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None, None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "code"), ERROR_CASES,
                         ids=[case[0] for case in ERROR_CASES])
def test_errors_in_openai_shape(http: httpx.Client, spec: OpenAISpec, name: str, path: str, body: Any, status: int,
                                param: str | None, code: str | None) -> None:
    stream = {"stream": True} if isinstance(body, dict) and "stream_options" not in body else {}
    for extra in ({}, stream):  # a bad streaming request is refused before its stream opens
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(path, json={**body, **extra})
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()
        spec.validate(error, "ErrorResponse")
        assert error["error"]["param"] == param and error["error"]["code"] == code
        assert error["error"]["message"]


def test_context_errors_say_the_limit_and_the_length(http: httpx.Client) -> None:
    message = http.post("/v1/completions", json={"prompt": [5] * 600}).json()["error"]["message"]
    assert "512" in message and "600" in message
    message = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 900}).json()["error"]["message"]
    assert re.search(r"\b512\b", message) and "900" in message


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(server: ServerProcess, spec: OpenAISpec, headers: dict[str, str]) -> None:
    for path in ("/v1/models", "/v1/completions"):
        response = httpx.post(f"{server.url}{path}", json={"prompt": "x"}, headers=headers) if path.endswith(
            "completions") else httpx.get(f"{server.url}{path}", headers=headers)
        assert response.status_code == 401
        spec.validate(response.json(), "ErrorResponse")
        assert response.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_nothing_is_left_behind(http: httpx.Client) -> None:
    """After every test above (errors included), no request is pending and the KV pool is free."""
    samples: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("cadence:") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            samples.setdefault(name, value)
    assert samples["cadence:num_requests_running"] == 0
    assert samples["cadence:num_requests_waiting"] == 0
    assert samples["cadence:num_requests_pending"] == 0
    assert samples["cadence:kv_cache_usage_perc"] == 0
    assert samples["cadence:kv_cache_free_blocks"] == samples["cadence:kv_cache_num_blocks"]
    assert samples["cadence:time_to_first_token_seconds_count"] > 0
    assert samples["cadence:generation_tokens_total"] > 0
