"""Load on a real server: 200 concurrent streaming clients, 50 of which leave mid-stream; garbage
on the engine's socket."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import aiohttp
import httpx
import pytest
import zmq

from cadence.api.testing import ServerProcess

PROMPTS = ["The capital of France is", "Hello world!", "A paged KV cache", "0123456789", "How are you today?",
           "Paris", "keys and values in fixed-size blocks", "( ) [ ] { }"]
LENGTHS = [4, 8, 12, 16, 20, 24]
NUM_CLIENTS = 200
NUM_LEAVING = 50


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., ContextManager[ServerProcess]]) -> Iterator[ServerProcess]:
    with serve_tiny() as process:
        yield process


def metrics(url: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("cadence:"):
            name, value = line.split(" ")[0], float(line.rsplit(" ", 1)[1])
            samples[name.split("{")[0] if "{" in name and "finished_reason" not in name else name] = value
    return samples


async def wait_until_idle(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        m = metrics(url)
        idle = (m["cadence:num_requests_running"] == m["cadence:num_requests_waiting"] == 0
                and m["cadence:num_requests_pending"] == 0 and m["cadence:kv_cache_usage_perc"] == 0
                and m["cadence:kv_cache_free_blocks"] == m["cadence:kv_cache_num_blocks"])
        if idle or asyncio.get_running_loop().time() > deadline:
            return m
        await asyncio.sleep(0.05)


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], leave_after: int | None = None
                 ) -> tuple[str, int, int | None]:
    """(text, tokens counted from the logprobs, usage.completion_tokens) of one streamed completion;
    with ``leave_after``, close the connection after that many chunks."""
    text, tokens, usage, seen = "", 0, None, 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                tokens += len(choice["logprobs"]["tokens"])
            seen += 1
            if leave_after is not None and seen >= leave_after:
                response.close()  # drops the connection mid-stream
                return text, tokens, None
    return text, tokens, usage


def test_200_streaming_clients_50_leaving(server: ServerProcess) -> None:
    async def run() -> None:
        base = {"temperature": 0, "ignore_eos": True}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            # The expected text of every (prompt, length), unstreamed.
            async def reference(prompt: str, length: int) -> str:
                async with session.post(f"{server.url}/v1/completions",
                                        json={**base, "prompt": prompt, "max_tokens": length}) as response:
                    return str((await response.json())["choices"][0]["text"])

            pairs = [(p, n) for p in PROMPTS for n in LENGTHS]
            expected = dict(zip(pairs, await asyncio.gather(*(reference(p, n) for p, n in pairs)), strict=True))

            jobs = []
            for i in range(NUM_CLIENTS):
                prompt = PROMPTS[i % len(PROMPTS)]
                if i % 4 == 3:  # 50 clients ask for long answers and leave after 3 chunks
                    body = {**base, "prompt": prompt, "max_tokens": 480, "stream": True, "logprobs": 0}
                    jobs.append(stream(session, server.url, body, leave_after=3))
                else:
                    length = LENGTHS[i % len(LENGTHS)]
                    body = {**base, "prompt": prompt, "max_tokens": length, "stream": True, "logprobs": 0,
                            "stream_options": {"include_usage": True}}
                    jobs.append(stream(session, server.url, body))
            results = await asyncio.gather(*jobs)

        for i, (text, tokens, usage) in enumerate(results):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 4 == 3:
                assert tokens >= 3 and usage is None
                continue
            length = LENGTHS[i % len(LENGTHS)]
            assert (tokens, usage) == (length, length), i
            assert text == expected[(prompt, length)], i
        after = await wait_until_idle(server.url)
        assert after["cadence:num_requests_running"] == 0 and after["cadence:num_requests_pending"] == 0
        assert after["cadence:kv_cache_free_blocks"] == after["cadence:kv_cache_num_blocks"]
        aborted = [v for k, v in after.items() if k.startswith("cadence:request_success_total") and '"abort"' in k]
        assert aborted == [NUM_LEAVING], after

    asyncio.run(run())


def test_garbage_on_the_engine_socket_is_dropped(server: ServerProcess) -> None:
    # The engine core's input socket (see EngineAddresses.fresh); the newest, should a killed process
    # with a reused pid have left one behind.
    address = max(glob.glob(os.path.join(tempfile.gettempdir(), f"cadence-{server.pid}-*-in")), key=os.path.getmtime)
    context = zmq.Context()
    rogue = context.socket(zmq.PUSH)
    rogue.connect(f"ipc://{address}")
    for frame in [b"", b"\x00\xff garbage", os.urandom(64), b"\x92\xa3abc\x01"]:
        rogue.send(frame)
    rogue.close(linger=1000)
    context.term()
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Paris", "max_tokens": 5, "ignore_eos": True},
                      timeout=30).json()
    assert body["usage"]["completion_tokens"] == 5
    assert server.health() == 200
