"""ZmqCoreClient while starting: an engine core that fails, exits, or never answers makes
``wait_ready`` raise saying why; the sockets' files are owner-only, and ``shutdown`` removes them.
(A running engine core in its own process is tested end to end in tests/engine/test_async_engine.py.)"""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from cadence.config import EngineConfig
from cadence.engine.zmq_client import ZmqCoreClient
from cadence.engine_args import EngineArgs
from cadence.errors import EngineDeadError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def config(make_tiny_model: Callable[..., Path]) -> EngineConfig:
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_threads=1).create_config()


@pytest.fixture
def make_client() -> Iterator[Callable[..., ZmqCoreClient]]:
    clients: list[ZmqCoreClient] = []

    def make(config: EngineConfig) -> ZmqCoreClient:
        clients.append(ZmqCoreClient(config))
        return clients[-1]

    yield make
    for client in clients:
        client.shutdown()


def socket_files(client: ZmqCoreClient) -> list[Path]:
    return [Path(address.removeprefix("ipc://")) for address in (client.addresses.input, client.addresses.output)]


def replace_process(client: ZmqCoreClient, target: Callable[..., Any], *args: Any) -> None:
    """Run ``target`` instead of the engine core: a process that dies or hangs while starting."""
    client.process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)


async def test_a_process_that_exits_while_starting(config: EngineConfig,
                                                   make_client: Callable[..., ZmqCoreClient]) -> None:
    client = make_client(config)
    replace_process(client, os._exit, 3)
    client.start()
    with anyio.fail_after(60), pytest.raises(RuntimeError, match=r"^engine core exited with code 3 while starting$"):
        await client.wait_ready(60)


async def test_an_engine_core_that_fails_to_start_says_why(config: EngineConfig,
                                                           make_client: Callable[..., ZmqCoreClient]) -> None:
    bad = replace(config, scheduler=replace(config.scheduler, policy="no-such-policy"))
    client = make_client(bad)
    client.start()
    with anyio.fail_after(120), pytest.raises(RuntimeError) as caught:  # a hang guard only
        await client.wait_ready(120)
    assert str(caught.value).startswith(
        "engine core failed to start: ValueError: unknown scheduling policy 'no-such-policy'")
    assert client.exit_code(60) == 1  # 60 s: a hang guard only
    # The engine core exits without removing its sockets' files; shutdown does.
    files = socket_files(client)
    assert all(f.exists() for f in files)
    assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o600, 0o600]  # bound owner-only
    client.shutdown()
    assert not any(f.exists() for f in files)
    client.shutdown()  # twice is harmless


async def test_an_engine_core_that_never_answers_times_out_and_is_stopped(
        config: EngineConfig, make_client: Callable[..., ZmqCoreClient]) -> None:
    client = make_client(config)
    replace_process(client, time.sleep, 120)
    client.start()
    with anyio.fail_after(60), pytest.raises(RuntimeError, match="did not become ready within 1 s"):
        await client.wait_ready(1)
    assert client.process.is_alive()
    client.shutdown(timeout_s=30)
    assert client.exit_code(60) == -15  # SIGTERM sufficed
    assert not any(f.exists() for f in socket_files(client))


def test_a_dead_client_refuses_to_connect(config: EngineConfig, make_client: Callable[..., ZmqCoreClient]) -> None:
    client = make_client(config)  # never started
    client.dead = "engine core process exited with code -9"
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        client.connect(_Sink(), lambda error: None)


def test_each_client_has_sockets_of_its_own(config: EngineConfig, make_client: Callable[..., ZmqCoreClient]) -> None:
    first, second = make_client(config), make_client(config)
    assert len({*socket_files(first), *socket_files(second)}) == 4
    assert first.rank == 0 and first.process.name == "cadence-engine-core-0"


class _Sink:
    async def send(self, message: Any) -> None:
        pass

    def close(self) -> None:
        pass
