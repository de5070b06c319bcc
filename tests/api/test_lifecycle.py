"""A server's life: overload, graceful shutdown on SIGTERM, and the engine core dying under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from support.openai_spec import OpenAISpec
from support.processes import engine_core_pids

from cadence.api.testing import ServerProcess

# n=4 x 4000 tokens runs for several seconds even on a fast machine: long enough to be in flight.
LONG = {"prompt": "Hello", "max_tokens": 4000, "n": 4, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", max_position_embeddings=4096)


def start(model: Path, tmp_path: Path, *extra: str) -> ServerProcess:
    args = ["--model", str(model), "--dtype", "float32", "--num-threads", "1", *extra]
    return ServerProcess(args, log_path=tmp_path / "server.log").__enter__()


@pytest.fixture(scope="module")
def server(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start(long_model, tmp_path_factory.mktemp("server"), "--max-waiting-requests", "2",
                    "--shutdown-timeout", "2")
    yield process
    process.stop()


class Stream:
    """A streamed completion read in the background: its events, and when it ended."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.done = False
        self.ended_at: float | None = None
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(session, url, body))

    async def _read(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
            assert response.status == 200
            async for raw in response.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[len("data: "):]))
                    self.first.set()
        self.ended_at = time.monotonic()

    @property
    def error(self) -> dict[str, Any] | None:
        return self.events[-1].get("error") if self.events else None


async def wait_until_idle(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "cadence:num_requests_pending{" in (text := httpx.get(f"{url}/metrics").text):
        pending = next(line for line in text.splitlines() if line.startswith("cadence:num_requests_pending{"))
        if float(pending.rsplit(" ", 1)[1]) == 0 or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


def test_overload_is_503(server: ServerProcess, spec: OpenAISpec) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            streams = [Stream(session, server.url, LONG) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert response.status_code == 503
            spec.validate(response.json(), "ErrorResponse")
            assert response.json()["error"]["code"] == "engine_overloaded"
            assert response.headers["Retry-After"] == "1"
            for s in streams:
                s.task.cancel()
        await wait_until_idle(server.url)
        body = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
        assert body["usage"]["completion_tokens"] == 2

    asyncio.run(run())


def test_sigterm_finishes_short_requests_and_aborts_long_ones(server: ServerProcess) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            long = Stream(session, server.url, LONG)
            short = Stream(session, server.url, {**LONG, "max_tokens": 40, "n": 1})
            await asyncio.wait_for(asyncio.gather(long.first.wait(), short.first.wait()), 30)
            signalled = time.monotonic()
            server.signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(long.task, short.task), 15)
            assert short.done and short.events[-1]["choices"][0]["finish_reason"] == "length"
            assert not long.done and long.error is not None and long.error["code"] == "shutting_down"
            assert long.ended_at is not None and long.ended_at - signalled < 5
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{server.url}/health")

    asyncio.run(run())
    assert server.wait(20) == 0, server.log()


@pytest.mark.parametrize("stay_up", [True, False], ids=["stay-up", "exit"])
def test_killing_the_engine_core_fails_in_flight_requests(long_model: Path, tmp_path: Path, spec: OpenAISpec,
                                                          stay_up: bool) -> None:
    extra = ["--stay-up-on-engine-death"] if stay_up else []
    process = start(long_model, tmp_path, *extra)
    try:
        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                streams = [Stream(session, process.url, LONG) for _ in range(3)]

                async def unstreamed() -> aiohttp.ClientResponse:
                    response = await session.post(f"{process.url}/v1/completions", json=LONG)
                    await response.read()
                    return response

                whole = asyncio.ensure_future(unstreamed())
                await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
                killed = time.monotonic()
                os.kill(engine_core_pids(process.pid)[0], signal.SIGKILL)
                await asyncio.wait_for(asyncio.gather(whole, *(s.task for s in streams)), 5)
                assert time.monotonic() - killed < 5
                for s in streams:
                    assert not s.done and s.error is not None and s.error["code"] == "engine_dead", s.events[-1]
                    spec.validate({"error": s.error}, "ErrorResponse")
                response = whole.result()
                assert response.status == 503
                spec.validate(await response.json(), "ErrorResponse")

        asyncio.run(run())
        if stay_up:
            assert process.health() == 503
            health = httpx.get(f"{process.url}/health")
            spec.validate(health.json(), "ErrorResponse")
            refused = httpx.post(f"{process.url}/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            process.signal(signal.SIGTERM)
        assert process.wait(20) != 0, process.log()
    finally:
        process.stop()
