"""Slow requests do not hold up the server: tokenizing, chat templates and constraint checks run in
worker threads with deadlines (``offload.py``, ``constraints.py``), a body that trickles in is read
without blocking and refused past its deadline (``request_body.py``).

``/health`` keeps answering while each slow request is in flight: proved by order, not by a clock.
The slow part is made to wait on an event the test holds; ``/health`` must answer 200 while it
waits, and the slow request completes only once released. Every wait is bounded by a generous hang
guard (:data:`HANG_S`)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from support.openai_spec import OpenAISpec
from support.scripted_engine import ScriptedEngine, out, step

from cadence.api import constraints
from cadence.api.app import STATE, build_app
from cadence.api.errors import APIError
from cadence.api.offload import in_thread
from cadence.api.serving import ServerSettings
from cadence.sampling_params import StructuredOutputsParams

HANG_S = 60.0
SLOW_REGEX = "slow+"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class Gate:
    """A point slow work waits at until the test opens it (or the hang guard passes)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.calls = 0

    def wait(self) -> None:
        self.calls += 1
        self.reached.set()
        self.opened.wait(HANG_S)

    async def until_reached(self) -> None:
        for _ in range(int(HANG_S / 0.01)):
            if self.reached.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the slow work never started")


class GatedTokenizer:
    """The tiny tokenizer, whose tokenizing and chat templating wait at ``gate``."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.wait()
        return self._inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.wait()
        return self._inner.apply_chat_template(*args, **kwargs)


def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda call: [step(out(0, "x", [5], "stop"))])


def serve(target: ScriptedEngine, test: Callable[[TestClient[Any, Any]], Awaitable[None]], **settings: Any) -> None:
    async def run() -> None:
        app = build_app(target, ServerSettings(served_model_names=("m",), **settings))  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            await asyncio.wait_for(test(client), HANG_S)
    asyncio.run(run())


async def health_answers_while(client: TestClient[Any, Any], slow: asyncio.Task[Any]) -> None:
    response = await client.get("/health")
    assert response.status == 200
    assert not slow.done()


# ---- tokenizing and chat templates ------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", {"prompt": "Paris"}), ("/v1/chat/completions", CHAT),
                                            ("/tokenize", {"prompt": "Paris"}), ("/tokenize", CHAT)])
def test_health_answers_while_a_prompt_is_tokenized(path: str, body: dict[str, Any]) -> None:
    gate = Gate()
    target = engine()
    target.tokenizer = GatedTokenizer(target.tokenizer, gate)

    async def test(client: TestClient[Any, Any]) -> None:
        slow = asyncio.create_task(client.post(path, json=body))
        await gate.until_reached()
        await health_answers_while(client, slow)
        gate.opened.set()
        assert (await slow).status == 200

    serve(target, test)


def test_tokenizing_past_its_deadline_is_a_400_that_says_so(spec: OpenAISpec) -> None:
    gate = Gate()
    target = engine()
    target.tokenizer = GatedTokenizer(target.tokenizer, gate)

    async def test(client: TestClient[Any, Any]) -> None:
        for path, body, param in [("/v1/completions", {"prompt": "Paris"}, "prompt"),
                                  ("/v1/chat/completions", CHAT, "messages")]:
            response = await client.post(path, json=body)
            error = await response.json()
            assert response.status == 400, error
            spec.validate(error, "ErrorResponse")
            assert (error["error"]["code"], error["error"]["param"]) == ("preprocessing_timeout", param)
            assert "longer than 0.2 s (--preprocess-timeout)" in error["error"]["message"]
        assert target.calls == []
        gate.opened.set()  # the abandoned threads end

    serve(target, test, preprocess_timeout_s=0.2)


# ---- constraint checks ------------------------------------------------------------------------


@pytest.fixture
def slow_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gate, list[str]]]:
    """Constraint checks that wait at a gate for :data:`SLOW_REGEX` (and pass), and record every check."""
    gate = Gate()
    checked: list[str] = []
    real = constraints.check_constraint

    def check(constraint: StructuredOutputsParams) -> None:
        checked.append(constraint.key[1])
        if constraint.regex == SLOW_REGEX:
            gate.wait()
        real(constraint)

    monkeypatch.setattr(constraints, "check_constraint", check)
    yield gate, checked
    gate.opened.set()


def constrained(regex: str) -> dict[str, Any]:
    return {"prompt": "Paris", "structured_outputs": {"regex": regex}}


def test_health_answers_while_a_constraint_compiles(slow_checks: tuple[Gate, list[str]]) -> None:
    gate, _ = slow_checks

    async def test(client: TestClient[Any, Any]) -> None:
        slow = asyncio.create_task(client.post("/v1/completions", json=constrained(SLOW_REGEX)))
        await gate.until_reached()
        await health_answers_while(client, slow)
        gate.opened.set()
        assert (await slow).status == 200

    serve(engine(), test)


def test_a_constraint_past_its_deadline_is_a_400_and_blocks_nothing(spec: OpenAISpec,
                                                                     slow_checks: tuple[Gate, list[str]]) -> None:
    gate, checked = slow_checks

    async def test(client: TestClient[Any, Any]) -> None:
        async def post(regex: str) -> tuple[int, dict[str, Any]]:
            response = await client.post("/v1/completions", json=constrained(regex))
            return response.status, await response.json()

        # Two at once with the slow constraint: one check for both, both refused at the deadline.
        for status, error in await asyncio.gather(post(SLOW_REGEX), post(SLOW_REGEX)):
            assert status == 400, error
            spec.validate(error, "ErrorResponse")
            assert (error["error"]["code"], error["error"]["param"]) == ("grammar_compile_timeout",
                                                                         "structured_outputs.regex")
            assert "did not compile within 0.3 s (--grammar-compile-timeout)" in error["error"]["message"]
        # Meanwhile another constraint is checked and served; the slow one's repeat starts no other check.
        assert (await post("[a-z]+"))[0] == 200
        assert (await post(SLOW_REGEX))[1]["error"]["code"] == "grammar_compile_timeout"
        assert checked == [SLOW_REGEX, "[a-z]+"]
        # Its check passes, late: the constraint stays refused, at once, without another check.
        gate.opened.set()
        checks = client.server.app[STATE].constraints
        for _ in range(int(HANG_S / 0.01)):
            if checks.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert checks.num_running == 0
        assert (await post(SLOW_REGEX))[1]["error"]["code"] == "grammar_compile_timeout"
        assert checked == [SLOW_REGEX, "[a-z]+"]

    serve(engine(), test, grammar_compile_timeout_s=0.3)


def test_a_failed_check_is_kept_and_answered_again_without_checking(slow_checks: tuple[Gate, list[str]]) -> None:
    _, checked = slow_checks

    async def test(client: TestClient[Any, Any]) -> None:
        for _ in range(3):
            response = await client.post("/v1/completions", json=constrained("(a"))
            error = await response.json()
            assert response.status == 400 and error["error"]["param"] == "structured_outputs.regex"
            assert error["error"]["message"].startswith("structured_outputs.regex: invalid regex: ")
        assert checked == ["(a"]

    serve(engine(), test)


@pytest.mark.parametrize("regex", [r"(a+)+$", r"((a|a)*)*b{1000}"])
def test_the_issues_catastrophic_regexes_compile_in_a_thread_and_are_served(regex: str) -> None:
    async def test(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", json=constrained(regex))
        assert response.status == 200, await response.text()

    serve(engine(), test)


# ---- a body that trickles in ------------------------------------------------------------------


async def open_request(client: TestClient[Any, Any], body: bytes, announced: int
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that has sent a request's headers (``announced`` bytes of body) and ``body``."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % announced + body)
    await writer.drain()
    return reader, writer


def test_health_answers_while_a_body_is_still_arriving() -> None:
    body = json.dumps({"prompt": "Paris"}).encode()

    async def test(client: TestClient[Any, Any]) -> None:
        reader, writer = await open_request(client, body[:5], len(body))
        slow = asyncio.create_task(reader.read())  # the whole answer, once the connection closes
        await health_answers_while(client, slow)
        writer.write(body[5:])  # the rest: only now can it be answered, and it is answered in full
        await writer.drain()
        assert (await slow).startswith(b"HTTP/1.1 200 ")
        writer.close()

    serve(engine(), test, request_read_timeout_s=HANG_S)


def test_a_body_shorter_than_announced_is_408_and_its_connection_closed(spec: OpenAISpec) -> None:
    body = json.dumps({"prompt": "Paris"}).encode()

    async def test(client: TestClient[Any, Any]) -> None:
        reader, writer = await open_request(client, body, len(body) + 100)
        answer = await reader.read()  # returns once the server has closed the connection
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
        error = json.loads(payload)
        spec.validate(error, "ErrorResponse")
        assert error["error"]["code"] == "request_timeout"
        assert f"{len(body)} bytes came of the {len(body) + 100} bytes announced" in error["error"]["message"]
        writer.close()
        # The server is none the worse for it.
        assert (await client.get("/health")).status == 200

    serve(engine(), test, request_read_timeout_s=0.3)


def test_a_client_that_leaves_mid_body_costs_nothing() -> None:
    async def test(client: TestClient[Any, Any]) -> None:
        _, writer = await open_request(client, b'{"prompt', 100)
        writer.close()
        await writer.wait_closed()
        response = await client.post("/v1/completions", json={"prompt": "Paris"})
        assert response.status == 200

    serve(engine(), test, request_read_timeout_s=HANG_S)



# ---- in_thread ---------------------------------------------------------------------------------


def test_in_thread_returns_raises_or_times_out() -> None:
    def fail() -> None:
        raise APIError(400, "no", param="prompt")

    async def run() -> None:
        assert await in_thread(lambda: threading.current_thread() is not threading.main_thread(), timeout_s=HANG_S,
                               what="x", param=None)
        with pytest.raises(APIError, match=r"^no$"):
            await in_thread(fail, timeout_s=HANG_S, what="x", param=None)
        gate = Gate()
        with pytest.raises(APIError) as info:
            await in_thread(gate.wait, timeout_s=0.1, what="tokenizing the prompt", param="prompt")
        gate.opened.set()
        assert (info.value.status, info.value.code, info.value.param) == (400, "preprocessing_timeout", "prompt")
        assert info.value.message.startswith("tokenizing the prompt took longer than 0.1 s (--preprocess-timeout)")

    asyncio.run(run())
