"""The forwarder: reads a channel until it ends, sends each message to the mailbox routed for its
type, and drops (with a warning) what has no route."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from cadence import messages as m
from cadence.runtime.actor import Actor, run_actors
from cadence.runtime.channel import ReceiveChannel
from cadence.runtime.forwarder import Forwarder

pytestmark = pytest.mark.anyio

LOGGER = "cadence.runtime.forwarder"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeChannel:
    """A receive channel over a fixed list of messages; ends when they run out."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = list(messages)
        self.received = 0
        self.closed = False

    async def receive(self) -> Any:
        if not self.messages:
            raise anyio.EndOfStream
        self.received += 1
        return self.messages.pop(0)

    def close(self) -> None:
        self.closed = True


class Recorder:
    """A mailbox that keeps what it is sent."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.closed = False

    async def send(self, message: Any) -> None:
        self.messages.append(message)

    def close(self) -> None:
        self.closed = True


REQUEST = m.EngineCoreRequest("r", [1], m.SamplingParams(), eos_token_id=0, arrival_time=0.0)


async def test_routes_each_message_by_its_type_in_order() -> None:
    requests, aborts = Recorder(), Recorder()
    stream = [REQUEST, m.AbortRequests(["a"]), m.AbortRequests(["b"]), REQUEST, m.AbortRequests(["c"])]
    forwarder = Forwarder(FakeChannel(stream), {m.EngineCoreRequest: requests, m.AbortRequests: aborts}, "input")
    with anyio.fail_after(10):
        await forwarder.run()
    assert requests.messages == [REQUEST, REQUEST]
    assert aborts.messages == [m.AbortRequests(["a"]), m.AbortRequests(["b"]), m.AbortRequests(["c"])]


async def test_one_mailbox_may_take_several_types() -> None:
    scheduler = Recorder()
    stream = [REQUEST, m.AbortRequests(["a"])]
    routes = {m.EngineCoreRequest: scheduler, m.AbortRequests: scheduler}
    with anyio.fail_after(10):
        await Forwarder(FakeChannel(stream), routes, "input").run()
    assert scheduler.messages == stream


async def test_an_unroutable_message_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    outputs = Recorder()
    stream = [m.EngineDead("x"), m.EngineCoreOutputs([], 1.0), "a string", m.EngineCoreOutputs([], 2.0)]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with anyio.fail_after(10):
        await Forwarder(FakeChannel(stream), {m.EngineCoreOutputs: outputs}, "engine-output-3").run()
    assert outputs.messages == [m.EngineCoreOutputs([], 1.0), m.EngineCoreOutputs([], 2.0)]
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "engine-output-3 dropped an unexpected EngineDead", "engine-output-3 dropped an unexpected str"]


async def test_routing_is_by_exact_type() -> None:
    class Special(m.AbortRequests):
        pass

    aborts = Recorder()
    with anyio.fail_after(10):
        await Forwarder(FakeChannel([Special(["x"]), m.AbortRequests(["y"])]), {m.AbortRequests: aborts}, "f").run()
    assert aborts.messages == [m.AbortRequests(["y"])]


async def test_any_receive_channel_will_do() -> None:
    """A ReceiveChannel is ``receive`` (EndOfStream once the sender closed) and ``close``: an anyio
    memory stream is one."""
    send, receive = anyio.create_memory_object_stream[Any](10)
    channel: ReceiveChannel[Any] = receive
    target = Recorder()
    await send.send(m.AbortRequests(["a"]))
    await send.send(m.AbortRequests(["b"]))
    send.close()
    with anyio.fail_after(10):
        await Forwarder(channel, {m.AbortRequests: target}, "f").run()
    assert target.messages == [m.AbortRequests(["a"]), m.AbortRequests(["b"])]
    channel.close()


async def test_ends_when_the_channel_ends() -> None:
    channel = FakeChannel([])
    target = Recorder()
    with anyio.fail_after(10):
        await Forwarder(channel, {m.AbortRequests: target}, "f").run()
    assert channel.received == 0 and target.messages == []


def test_takes_its_name_and_a_copy_of_its_routes() -> None:
    target = Recorder()
    routes: dict[type, Any] = {m.AbortRequests: target}
    forwarder = Forwarder(FakeChannel([]), routes, "engine-input")
    routes[m.EngineDead] = Recorder()
    assert forwarder.name == "engine-input"
    assert forwarder.routes == {m.AbortRequests: target}


class Collector(Actor[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                self.seen.append(message)


async def test_feeds_actor_inboxes_under_run_actors() -> None:
    """As the engine wires it: the forwarder is one actor among those it feeds."""
    collector = Collector()
    stream = [m.AbortRequests([str(i)]) for i in range(300)]  # more than a bounded inbox holds
    forwarder = Forwarder(FakeChannel(stream), {m.AbortRequests: collector}, "f")
    crashes: list[str] = []

    async def forward_then_close() -> None:
        await forwarder.run()
        collector.close()

    class Wrapper(Actor[Any]):
        async def run(self) -> None:
            await forward_then_close()

    with anyio.fail_after(10):
        await run_actors([Wrapper(), collector], crashes.append)
    assert collector.seen == stream and crashes == []
