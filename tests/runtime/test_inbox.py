"""An actor's inbox: first in first out, bounded sends wait for room in order, closing ends the
reader's loop after the queued messages, a reader that left breaks its senders."""

from __future__ import annotations

import asyncio
import math

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from cadence.runtime.inbox import Inbox

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_messages_come_out_in_order_and_an_empty_inbox_would_block() -> None:
    inbox: Inbox[int] = Inbox(math.inf)
    for i in range(1000):
        inbox.send_nowait(i)
    assert len(inbox) == 1000
    assert [inbox.receive_nowait() for _ in range(1000)] == list(range(1000))
    with pytest.raises(anyio.WouldBlock):
        inbox.receive_nowait()


async def test_a_waiting_reader_wakes_on_a_send() -> None:
    inbox: Inbox[str] = Inbox(4)
    seen: list[str] = []

    async def read() -> None:
        seen.append(await inbox.receive())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            assert not inbox.reader_waiting
            group.start_soon(read)
            await wait_all_tasks_blocked()
            assert seen == [] and inbox.reader_waiting
            inbox.send_nowait("hello")
    assert seen == ["hello"]


async def test_senders_wait_for_room_and_get_it_in_order() -> None:
    inbox: Inbox[str] = Inbox(1)
    inbox.send_nowait("first")
    with pytest.raises(anyio.WouldBlock):
        inbox.send_nowait("too many")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(inbox.send, "a")
            await wait_all_tasks_blocked()
            group.start_soon(inbox.send, "b")
            await wait_all_tasks_blocked()
            received = [inbox.receive_nowait()]
            for _ in range(2):
                await wait_all_tasks_blocked()  # the woken sender puts its message in
                received.append(inbox.receive_nowait())
    assert received == ["first", "a", "b"]


async def test_a_woken_sender_cancelled_before_it_runs_passes_the_room_on() -> None:
    inbox: Inbox[str] = Inbox(1)
    inbox.send_nowait("x")
    # An asyncio task: its cancel() interrupts a wait whose future is already done (anyio's cancel
    # scopes let such a task run on, so it sends).
    first = asyncio.create_task(inbox.send("a"))
    second = asyncio.create_task(inbox.send("b"))
    await wait_all_tasks_blocked()
    assert inbox.receive_nowait() == "x"  # wakes the first sender ...
    first.cancel()  # ... which is cancelled before it sends
    with anyio.fail_after(10):
        await asyncio.wait([first, second])
    assert first.cancelled() and second.done()
    assert inbox.receive_nowait() == "b" and len(inbox) == 0


async def test_close_ends_the_readers_loop_after_what_is_queued() -> None:
    inbox: Inbox[int] = Inbox(8)
    for i in range(3):
        await inbox.send(i)
    inbox.close()
    with pytest.raises(anyio.ClosedResourceError):
        inbox.send_nowait(3)
    with anyio.fail_after(10):
        assert [message async for message in inbox] == [0, 1, 2]
        with pytest.raises(anyio.EndOfStream):
            await inbox.receive()


async def test_close_wakes_a_waiting_reader_with_the_end() -> None:
    inbox: Inbox[int] = Inbox(8)
    ended = False

    async def read() -> None:
        nonlocal ended
        async for _ in inbox:
            pass
        ended = True

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(read)
            await wait_all_tasks_blocked()
            inbox.close()
    assert ended


@pytest.mark.parametrize("reads_first", [True, False])
async def test_senders_fail_once_the_reader_has_left(reads_first: bool) -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.send_nowait(0)
    failures: list[type[BaseException]] = []

    async def send_waiting() -> None:
        try:
            await inbox.send(1)
        except anyio.BrokenResourceError as exc:
            failures.append(type(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(send_waiting)
            await wait_all_tasks_blocked()
            async with inbox:
                if reads_first:
                    assert inbox.receive_nowait() == 0
                    await wait_all_tasks_blocked()  # the waiting sender took the room: 1 is queued
    # A sender that got its room before the reader left has sent; one still waiting fails.
    assert failures == ([] if reads_first else [anyio.BrokenResourceError])
    with pytest.raises(anyio.BrokenResourceError):
        inbox.send_nowait(2)
    with pytest.raises(anyio.ClosedResourceError):
        inbox.receive_nowait()
