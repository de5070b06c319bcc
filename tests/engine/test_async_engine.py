"""The AsyncEngine with its core in a separate process: streaming, cancellation, bad frames, death."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import zmq

from cadence import SamplingParams
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.llm import LLM
from cadence.engine_args import EngineArgs
from cadence.errors import EngineDeadError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_config(make_tiny_model: Callable[..., Path]) -> object:
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_threads=1).create_config()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    async for delta in engine.generate(prompt, params):
        for seq in delta.outputs:
            tokens.extend(seq.token_ids)
            text += seq.text
    return tokens, text


PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11] * 7, [30] * 50]


@pytest.fixture(scope="module")
def offline(make_tiny_model: Callable[..., Path]) -> list:
    return LLM(model=str(make_tiny_model("llama")), dtype="float32").generate(PROMPTS, PARAMS, use_tqdm=False)


async def test_streams_the_same_tokens_as_offline(tiny_config: object, offline: list) -> None:
    params, prompts = PARAMS, PROMPTS
    async with AsyncEngine.launch(tiny_config) as engine:  # type: ignore[arg-type]
        results: dict[int, tuple[list[int], str]] = {}

        async def one(i: int) -> None:
            results[i] = await collect(engine, prompts[i], params)

        async with anyio.create_task_group() as group:
            for i in range(len(prompts)):
                group.start_soon(one, i)
        for i, out in enumerate(offline):
            assert results[i] == (out.outputs[0].token_ids, out.outputs[0].text)
        assert engine.stats is not None and engine.stats.num_running == 0


async def test_cancelling_a_stream_frees_its_blocks(tiny_config: object) -> None:
    async with AsyncEngine.launch(tiny_config) as engine:  # type: ignore[arg-type]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen = 0
        async for _ in engine.generate([5] * 40, params):
            seen += 1
            if seen == 3:
                break
        with anyio.fail_after(10):
            while engine.stats is None or engine.stats.num_running or engine.num_pending_requests:
                await anyio.sleep(0.02)
        assert engine.stats.num_free_blocks == engine.stats.num_blocks - 1


async def test_random_frames_are_dropped_and_the_engine_keeps_serving(tiny_config: object) -> None:
    async with AsyncEngine.launch(tiny_config) as engine:  # type: ignore[arg-type]
        context = zmq.Context()
        rogue = context.socket(zmq.PUSH)
        rogue.connect(engine.cores[0].client.addresses.input)
        for frame in [b"", b"\x00\xff garbage", os.urandom(64), b"\x92\xa3abc\x01"]:
            rogue.send(frame)
        rogue.close(linger=1000)
        context.term()
        tokens, _ = await collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert len(tokens) == 5 and engine.is_healthy


async def test_killing_the_engine_core_fails_in_flight_requests_quickly(tiny_config: object) -> None:
    """The engine core is paused (SIGSTOP) before the requests come, so none can finish before the kill."""
    deaths: list[str] = []
    async with AsyncEngine.launch(tiny_config, on_dead=deaths.append) as engine:  # type: ignore[arg-type]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        errors: list[BaseException] = []

        async def doomed() -> None:
            try:
                await collect(engine, [5] * 30, params)
            except EngineDeadError as exc:
                errors.append(exc)

        pid = engine.cores[0].client.process.pid
        os.kill(pid, signal.SIGSTOP)
        with anyio.fail_after(60):  # a hang guard only
            async with anyio.create_task_group() as group:
                for _ in range(4):
                    group.start_soon(doomed)
                while engine.num_pending_requests < 4:
                    await anyio.sleep(0.01)
                os.kill(pid, signal.SIGKILL)
        assert len(errors) == 4 and all("exited with code -9" in str(e) for e in errors)
        assert not engine.is_healthy and deaths
        with pytest.raises(EngineDeadError):
            await collect(engine, [5], params)
