"""The AsyncEngine with its core in a separate process: streaming, cancellation, bad frames, death."""

from __future__ import annotations

import os
import random
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq

from cadence import SamplingParams
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.llm import LLM
from cadence.engine_args import EngineArgs
from cadence.errors import EngineDeadError
from cadence.messages import EngineCoreEvent, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from cadence.runtime.codec import Codec

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


def _unknown_dtype_request() -> bytes:
    """A request whose JSON schema holds an array extension naming a dtype nobody knows."""
    header = msgspec.msgpack.encode(["numpy", "nonsense", [1]])
    array = msgspec.msgpack.Ext(1, len(header).to_bytes(4, "little") + header + b"\x00")
    params = {"structured_outputs": {"json": {"a": array}}}
    return msgspec.msgpack.encode(["EngineCoreRequest", "rogue-dtype", [5], params, None, 0.0])


async def test_the_issues_frames_and_broken_outputs_are_dropped_and_the_engine_keeps_serving(
        tiny_config: object, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Straight to the engine core's input socket: a frame with an unknown dtype, and a well-formed
    request with token id 10**9 (both once killed the engine core). To the API side's receive
    socket: random bytes and truncated output batches."""
    async with AsyncEngine.launch(tiny_config) as engine:  # type: ignore[arg-type]
        client = engine.cores[0].client
        sockets = [Path(a.removeprefix("ipc://")) for a in (client.addresses.input, client.addresses.output)]
        assert [stat.S_IMODE(path.stat().st_mode) for path in sockets] == [0o600, 0o600]
        context = zmq.Context()
        rogue_in = context.socket(zmq.PUSH)
        rogue_in.connect(client.addresses.input)
        huge_id = EngineCoreRequest("rogue-id", [5, 10**9, 6], SamplingParams(max_tokens=2), eos_token_id=0,
                                    arrival_time=time.time())
        rogue_in.send(_unknown_dtype_request())
        rogue_in.send(Codec(EngineCoreInput).encode(huge_id))
        # The API side's receive socket connects to a second sender: a rogue one.
        rogue_out = context.socket(zmq.PUSH)
        rogue_out.bind(f"ipc://{tmp_path}/rogue")
        client.outputs._socket.connect(f"ipc://{tmp_path}/rogue")
        batch = Codec(EngineCoreEvent).encode(EngineCoreOutputs([EngineCoreOutput("nobody", [1, 2])], 0.0))
        broken = [random.Random(0).randbytes(64), b"", *(batch[:n] for n in (1, len(batch) // 2, len(batch) - 1))]
        for frame in broken:
            rogue_out.send(frame)
        with anyio.fail_after(60):  # a hang guard only
            while client.outputs.dropped_frames < len(broken):
                await anyio.sleep(0.02)
            log = ""  # the engine core's (its stderr is the test's)
            dropped = "engine-core-0 cadence.runtime.zmq_channel: dropped a malformed frame"
            while "refused request 'rogue-id'" not in log or dropped not in log:
                await anyio.sleep(0.05)
                log += capfd.readouterr().err
        assert "prompt: token id 1000000000 is outside the vocabulary (size 320)" in log
        assert "data type 'nonsense' not understood" in log
        tokens, _ = await collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert len(tokens) == 5 and engine.is_healthy and client.process.is_alive()
        assert client.outputs.dropped_frames == len(broken)
        for socket in (rogue_in, rogue_out):
            socket.close(linger=0)
        context.term()


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
