"""The EngineCoreClient interface: what it asks of an implementation, and its defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from cadence.engine.core_client import EngineCoreClient
from cadence.messages import EngineCoreInput, EngineCoreOutputs
from cadence.runtime.actor import Actor, Mailbox

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Minimal(EngineCoreClient):
    rank = 0
    num_blocks = 8

    def connect(self, outputs_to: Mailbox[EngineCoreOutputs], on_dead: Callable[[str], None]
                ) -> tuple[Mailbox[EngineCoreInput], list[Actor[Any]]]:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


def test_connect_and_shutdown_are_required() -> None:
    class Partial(EngineCoreClient):
        def shutdown(self) -> None:
            pass

    with pytest.raises(TypeError, match="connect"):
        Partial()  # type: ignore[abstract]


def test_a_client_is_alive_until_told_otherwise() -> None:
    client = Minimal()
    assert client.dead is None
    client.disconnect()  # the default does nothing
    assert client.dead is None


async def test_the_default_watch_waits_without_reporting_a_death() -> None:
    deaths: list[str] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(Minimal().watch, deaths.append)
            await wait_all_tasks_blocked()
            group.cancel_scope.cancel()
    assert deaths == []
