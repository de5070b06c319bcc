"""What an API request is known by, and what the server tells its client and its log about it:
``X-Request-Id`` honoured (the response's id and the engine request's carry it, the header comes
back), one made up where none was sent, unknown fields named in a warning, and a chat stream whose
first chunk (the role) goes out with the first token, not before the prefill."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict
from support.scripted_engine import ScriptedEngine, out, step

from cadence.api.app import build_app
from cadence.api.serving import ServerSettings
from cadence.messages import RequestOutput

HI = [{"role": "user", "content": "hi"}]


def request(engine: ScriptedEngine, path: str, body: dict[str, Any],
            headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], str]:
    async def run() -> tuple[int, CIMultiDict[str], str]:
        app = build_app(engine, ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            response = await client.post(path, json=body, headers=headers or {})
            return response.status, CIMultiDict(response.headers), await response.text()
    return asyncio.run(run())


def engine_saying(*deltas: RequestOutput) -> ScriptedEngine:
    return ScriptedEngine(lambda _: list(deltas))


@pytest.mark.parametrize(("path", "body", "prefix"), [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}, "chatcmpl-"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "cmpl-"),
])
def test_x_request_id_names_the_response_and_the_engine_request(path: str, body: dict[str, Any], prefix: str) -> None:
    engine = engine_saying(step(out(0, "Pa", [279], "length")))
    status, headers, text = request(engine, path, body, {"X-Request-Id": "trace-42"})
    assert status == 200, text
    assert headers["X-Request-Id"] == "trace-42"
    assert json.loads(text)["id"] == f"{prefix}trace-42"
    assert [call.request_id for call in engine.calls] == [f"{prefix}trace-42-0"]


def test_without_the_header_the_server_makes_an_id_and_sends_it_back() -> None:
    engine = engine_saying(step(out(0, "Pa", [279], "length")))
    status, headers, text = request(engine, "/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert status == 200 and len(headers["X-Request-Id"]) == 32
    assert json.loads(text)["id"] == f"chatcmpl-{headers['X-Request-Id']}"


def test_errors_carry_the_request_id_too() -> None:
    status, headers, _ = request(engine_saying(), "/v1/chat/completions", {"messages": []}, {"X-Request-Id": "e1"})
    assert (status, headers["X-Request-Id"]) == (400, "e1")


def test_an_overlong_request_id_is_replaced_not_echoed(caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_saying(step(out(0, "Pa", [279], "length")))
    _, headers, _ = request(engine, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, {"X-Request-Id": "x" * 300})
    assert len(headers["X-Request-Id"]) == 32
    assert f"request {headers['X-Request-Id']}: its X-Request-Id header is over 256 characters" in caplog.text


def test_unknown_fields_are_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_saying(step(out(0, "Pa", [279], "length")))
    body = {"messages": HI, "max_tokens": 1, "guided_json": {}, "best_of_n": 2}
    with caplog.at_level(logging.WARNING, logger="cadence.api.request_body"):
        status, _, _ = request(engine, "/v1/chat/completions", body, {"X-Request-Id": "u1"})
    assert status == 200
    assert [r.getMessage() for r in caplog.records] == ["request u1: ignored unknown fields best_of_n, guided_json"]


def test_the_role_chunk_waits_for_the_first_token() -> None:
    """A request that fails in the engine before its first token streams no role chunk, only the error."""
    failed = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], outputs=[], finished=True,
                           error="the engine could not run it")
    status, _, text = request(engine_saying(failed), "/v1/chat/completions", {"messages": HI, "stream": True})
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) == 1 and '"error"' in events[0]
