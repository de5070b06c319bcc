"""A wake-up: wakes the task waiting, is dropped when nobody waits, and a cancelled wait leaves it
ready for the next."""

from __future__ import annotations

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from cadence.runtime.wakeup import Wakeup

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_wake_ends_the_wait_and_one_with_nobody_waiting_is_dropped() -> None:
    wakeup = Wakeup()
    wakeup.wake()  # nobody waits: dropped
    woken = 0

    async def wait() -> None:
        nonlocal woken
        await wakeup.wait()
        woken += 1

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(wait)
            await wait_all_tasks_blocked()
            assert wakeup.waiting and woken == 0  # the earlier wake did not carry over
            wakeup.wake()
            wakeup.wake()  # a second wake before the waiter runs changes nothing
    assert woken == 1 and not wakeup.waiting


async def test_a_cancelled_wait_leaves_it_ready_for_the_next() -> None:
    wakeup = Wakeup()
    with anyio.move_on_after(0.01):
        await wakeup.wait()
    assert not wakeup.waiting
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(wakeup.wait)
            await wait_all_tasks_blocked()
            wakeup.wake()
    assert not wakeup.waiting
