"""The engine core in the caller's process, on a tiny model: each run connects fresh scheduler and
executor actors over the same engine core, a disconnect aborts what the run left unfinished, and a
dead client refuses to connect."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from cadence.config import EngineConfig
from cadence.core.scheduler_actor import SchedulerActor
from cadence.engine.inproc_client import InProcessCoreClient
from cadence.engine_args import EngineArgs
from cadence.errors import EngineDeadError
from cadence.executor.actor import ExecutorActor
from cadence.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest
from cadence.runtime.actor import run_actors
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def config(make_tiny_model: Callable[..., Path]) -> EngineConfig:
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_threads=1,
                      num_kv_blocks=33).create_config()


@pytest.fixture(scope="module")
def client(config: EngineConfig) -> Any:
    client = InProcessCoreClient.start(config)
    yield client
    client.shutdown()


class Outputs:
    """Collects the engine core's outputs; ``finished`` is set once every id in ``expected`` finished."""

    def __init__(self, *expected: str) -> None:
        self.expected = set(expected)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.finished = anyio.Event()
        self.first = anyio.Event()

    async def send(self, message: EngineCoreOutputs) -> None:
        for output in message.outputs:
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finish[output.request_id] = output.finish_reason
        if self.tokens:
            self.first.set()
        if self.expected <= set(self.finish):
            self.finished.set()

    def close(self) -> None:
        pass


def request(request_id: str, params: SamplingParams = GREEDY) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [5, 6, 7, 8], params, eos_token_id=0, arrival_time=time.time())


def test_the_client_holds_a_built_engine_core(client: Any, config: EngineConfig) -> None:
    assert client.rank == 0 and client.dead is None
    assert client.num_blocks == client.core.executor.num_blocks == 33
    assert client.core.config is config


def test_each_connect_gives_fresh_actors_over_the_same_core(client: Any) -> None:
    first_inbox, first = client.connect(Outputs(), lambda error: None)
    second_inbox, second = client.connect(Outputs(), lambda error: None)
    assert [type(a) for a in first] == [SchedulerActor, ExecutorActor]
    assert first_inbox is first[0] and second_inbox is second[0]  # requests go to the scheduler
    assert first[0] is not second[0] and first[1] is not second[1]
    assert first[0].scheduler is second[0].scheduler is client.core.scheduler


async def test_requests_run_on_the_connected_actors(client: Any) -> None:
    runs = []
    for _ in range(2):  # two runs over the same engine core: the same greedy tokens
        outputs = Outputs("a", "b")
        inbox, actors = client.connect(outputs, lambda error: None)
        crashes: list[str] = []
        with anyio.fail_after(60):  # a hang guard only
            async with anyio.create_task_group() as group:
                group.start_soon(run_actors, actors, crashes.append)
                await inbox.send(request("a"))
                await inbox.send(request("b", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
                await outputs.finished.wait()
                inbox.close()  # the scheduler ends, and closes the executor's inbox
        client.disconnect()
        assert crashes == []
        assert len(outputs.tokens["a"]) == 6 and outputs.tokens["b"] == outputs.tokens["a"][:3]
        assert outputs.finish == {"a": "length", "b": "length"}
        runs.append(outputs.tokens)
    assert runs[0] == runs[1]
    assert client.core.scheduler.num_unfinished == 0


async def test_an_abort_finishes_the_request(client: Any) -> None:
    outputs = Outputs("long")
    inbox, actors = client.connect(outputs, lambda error: None)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run_actors, actors, lambda error: None)
            await inbox.send(request("long", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
            await outputs.first.wait()
            await inbox.send(AbortRequests(["long", "unknown"]))
            await outputs.finished.wait()
            inbox.close()
    client.disconnect()
    assert outputs.finish == {"long": "abort"} and len(outputs.tokens["long"]) < 400


async def test_a_disconnect_aborts_what_the_run_left(client: Any) -> None:
    outputs = Outputs()
    inbox, actors = client.connect(outputs, lambda error: None)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(run_actors, actors, lambda error: None)
            for i in range(3):
                await inbox.send(request(f"left-{i}", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
            await outputs.first.wait()
            group.cancel_scope.cancel()  # the run ends with its requests unfinished
    scheduler, allocator = client.core.scheduler, client.core.allocator
    assert scheduler.num_unfinished == 3
    client.disconnect()
    assert scheduler.num_unfinished == 0 and scheduler.requests == {}
    assert allocator.num_free_blocks == allocator.num_blocks - 1  # all but the null block


def test_a_dead_client_refuses_to_connect(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "dead", "ExecutorActor crashed: RuntimeError: boom")
    with pytest.raises(EngineDeadError, match="ExecutorActor crashed: RuntimeError: boom"):
        client.connect(Outputs(), lambda error: None)


def test_a_bad_configuration_fails_to_start(make_tiny_model: Callable[..., Path]) -> None:
    config = EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", policy="no-such-policy").create_config()
    with pytest.raises(ValueError, match="unknown scheduling policy 'no-such-policy'"):
        InProcessCoreClient.start(config)


def test_shutdown_is_idempotent(config: EngineConfig) -> None:
    client = InProcessCoreClient.start(config)
    client.shutdown()
    client.shutdown()
