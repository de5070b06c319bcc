"""The actor runtime: actors run until their inboxes close, a crash is reported once through
``on_crash`` and cancels the others, ``started`` is set once all run, and inboxes are bounded."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from cadence.runtime.actor import UNBOUNDED, Actor, run_actors

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Collector(Actor[Any]):
    """Keeps every message; ends when its inbox is closed and drained."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []
        self.ended = False
        self.cancelled = False

    async def run(self) -> None:
        try:
            async with self.inbox:
                async for message in self.inbox:
                    self.seen.append(message)
            self.ended = True
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise


class Bomb(Collector):
    """Raises on the message "boom"."""

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                if message == "boom":
                    raise RuntimeError("simulated failure")
                self.seen.append(message)


class Renamed(Bomb):
    @property
    def name(self) -> str:
        return "scheduler-7"


class Small(Collector):
    inbox_size = 2


class Unbounded(Collector):
    inbox_size = UNBOUNDED


async def test_actors_run_until_their_inboxes_close() -> None:
    first, second = Collector(), Collector()
    done = anyio.Event()
    crashes: list[str] = []

    async def run() -> None:
        await run_actors([first, second], crashes.append)
        done.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            for i in range(5):
                await first.send(("first", i))
                second.send_nowait(("second", i))
            await wait_all_tasks_blocked()
            assert first.seen == [("first", i) for i in range(5)]
            assert second.seen == [("second", i) for i in range(5)]
            assert not done.is_set()  # both are waiting for more
            first.close()
            await wait_all_tasks_blocked()
            assert first.ended and not second.ended and not done.is_set()
            second.close()
            await done.wait()
    assert second.ended and crashes == []


async def test_a_closed_inbox_is_drained_before_run_ends() -> None:
    actor = Collector()
    for i in range(10):
        actor.send_nowait(i)
    actor.close()
    with anyio.fail_after(10):
        await run_actors([actor], lambda error: None)
    assert actor.seen == list(range(10)) and actor.ended


async def test_no_actors_return_at_once_and_set_started() -> None:
    started = anyio.Event()
    with anyio.fail_after(10):
        await run_actors([], lambda error: None, started)
    assert started.is_set()


async def test_started_is_set_once_every_actor_runs() -> None:
    actors = [Collector() for _ in range(3)]
    started = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(run_actors, actors, lambda error: None, started)
            await started.wait()
            for i, actor in enumerate(actors):
                await actor.send(i)
            await wait_all_tasks_blocked()
            assert [a.seen for a in actors] == [[0], [1], [2]]
            for actor in actors:
                actor.close()


@pytest.mark.parametrize("handler", ["sync", "async"])
async def test_a_crash_is_reported_once_and_cancels_the_others(handler: str) -> None:
    bomb, bystanders = Bomb(), [Collector(), Collector()]
    reports: list[str] = []

    def report(error: str) -> None:
        reports.append(error)

    async def report_async(error: str) -> None:
        await anyio.sleep(0)
        reports.append(error)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            started = anyio.Event()
            group.start_soon(run_actors, [bystanders[0], bomb, bystanders[1]],
                             report if handler == "sync" else report_async, started)
            await started.wait()
            await bomb.send("fine")
            await bystanders[0].send("also fine")
            await wait_all_tasks_blocked()
            await bomb.send("boom")
    # run_actors itself returned: the crash is reported only through on_crash.
    assert reports == ["Bomb crashed: RuntimeError: simulated failure"]
    assert bomb.seen == ["fine"]
    assert all(b.cancelled and not b.ended for b in bystanders)
    assert bystanders[0].seen == ["also fine"]


async def test_the_report_names_the_actor_by_its_name() -> None:
    actor = Renamed()
    reports: list[str] = []
    actor.send_nowait("boom")
    with anyio.fail_after(10):
        await run_actors([actor, Collector()], reports.append)
    assert reports == ["scheduler-7 crashed: RuntimeError: simulated failure"]


async def test_a_crash_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    actor = Bomb()
    actor.send_nowait("boom")
    with anyio.fail_after(10):
        await run_actors([actor], lambda error: None)
    [record] = [r for r in caplog.records if r.name == "cadence.runtime.actor"]
    assert record.getMessage() == "Bomb crashed: RuntimeError: simulated failure"
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError


def test_an_actor_is_named_after_its_class() -> None:
    assert Collector().name == "Collector" and Renamed().name == "scheduler-7"


def test_the_default_inbox_holds_256_messages() -> None:
    actor = Collector()
    assert Actor.inbox_size == 256
    for i in range(256):
        actor.send_nowait(i)
    with pytest.raises(anyio.WouldBlock):
        actor.send_nowait(256)


def test_an_unbounded_inbox_never_refuses() -> None:
    actor = Unbounded()
    assert math.inf == UNBOUNDED
    for i in range(10_000):
        actor.send_nowait(i)
    assert len(actor.inbox) == 10_000


async def test_send_waits_for_room_in_a_full_inbox() -> None:
    actor = Small()
    actor.send_nowait(0)
    actor.send_nowait(1)
    with pytest.raises(anyio.WouldBlock):
        actor.send_nowait(2)
    sent = anyio.Event()

    async def send_third() -> None:
        await actor.send(2)
        sent.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(send_third)
            await wait_all_tasks_blocked()
            assert not sent.is_set()
            assert actor.inbox.receive_nowait() == 0
            await sent.wait()
    assert [actor.inbox.receive_nowait() for _ in range(2)] == [1, 2]


async def test_sending_to_a_closed_inbox_fails() -> None:
    actor = Collector()
    actor.close()
    with pytest.raises(anyio.ClosedResourceError):
        actor.send_nowait(1)
    with pytest.raises(anyio.ClosedResourceError):
        await actor.send(1)
