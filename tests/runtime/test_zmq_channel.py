"""ZMQ channels over ipc://: messages arrive in order and equal, a malformed frame is dropped with a
warning and counted while the channel keeps serving, and a closed receive side ends the stream."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from cadence import messages as m
from cadence.runtime.codec import Codec
from cadence.runtime.zmq_channel import ZmqReceiveChannel, ZmqSendChannel
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

LOGGER = "cadence.runtime.zmq_channel"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short folder of its own: ipc paths are limited to about 100 bytes."""
    with tempfile.TemporaryDirectory(prefix="cadence-zmq-") as name:
        yield Path(name)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open; term() alone would wait for it


def request(i: int) -> m.EngineCoreRequest:
    return m.EngineCoreRequest(f"r{i}", list(range(i + 1)), SamplingParams(seed=i, stop=["\n"]), eos_token_id=0,
                               arrival_time=float(i))


def pair(context: zmq.asyncio.Context, address: str, message_type: Any, *, receiver_binds: bool = True
         ) -> tuple[ZmqSendChannel[Any], ZmqReceiveChannel[Any]]:
    receive: ZmqReceiveChannel[Any] = ZmqReceiveChannel(context, address, message_type, bind=receiver_binds)
    send: ZmqSendChannel[Any] = ZmqSendChannel(context, address, message_type, bind=not receiver_binds)
    return send, receive


@pytest.mark.parametrize("receiver_binds", [True, False], ids=["receiver-binds", "sender-binds"])
async def test_messages_arrive_in_order_and_equal(context: zmq.asyncio.Context, folder: Path,
                                                  receiver_binds: bool) -> None:
    send, receive = pair(context, f"ipc://{folder}/in", m.EngineCoreInput, receiver_binds=receiver_binds)
    sent: list[Any] = []
    for i in range(200):
        sent.append(request(i) if i % 3 else m.AbortRequests([f"r{i - 1}", f"r{i - 2}"]))
    with anyio.fail_after(30):
        for message in sent:
            await send.send(message)
        received = [await receive.receive() for _ in sent]
    assert received == sent
    assert [type(r) for r in received] == [type(s) for s in sent]
    assert receive.dropped_frames == 0
    send.close()
    receive.close()


async def test_a_step_with_a_tensor_crosses_the_channel(context: zmq.asyncio.Context, folder: Path) -> None:
    send, receive = pair(context, f"ipc://{folder}/steps", m.SchedulerOutput)
    bitmask = torch.tensor([[-1, 0], [7, 2**31 - 1]], dtype=torch.int32)
    step = m.SchedulerOutput(3, [], [m.CachedRequestData("a", [[1]], 4)], {"a": 1, "b": 1}, [], [],
                             grammar_bitmask=m.GrammarBitmask(["a", "b"], bitmask))
    with anyio.fail_after(30):
        await send.send(step)
        decoded = await receive.receive()
    assert decoded.cached_requests == step.cached_requests
    assert decoded.num_scheduled_tokens == {"a": 1, "b": 1}
    assert torch.equal(decoded.grammar_bitmask.bitmask, bitmask)
    send.close()
    receive.close()


_HEADER = msgspec.msgpack.encode(["numpy", "nonsense", [1]])
BAD_ARRAY = msgspec.msgpack.Ext(1, len(_HEADER).to_bytes(4, "little") + _HEADER + b"\x00")
MALFORMED = [
    b"",
    b"\x00\xff garbage",
    b"\xc1",
    b"\x92\xa3abc\x01",
    msgspec.msgpack.encode(["EngineDead", "a message of the other direction"]),
    msgspec.msgpack.encode(["AbortRequests", [msgspec.msgpack.Ext(5, b"x")]]),
    # An array of a dtype numpy does not know, where the JSON schema of a request may hold any value.
    msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], {"structured_outputs": {"json": {"a": BAD_ARRAY}}},
                            None, 0.0]),
    # A well-formed array where a JSON schema belongs: refused by the params, not by the codec.
    Codec[Any](m.EngineCoreInput).encode(["EngineCoreRequest", "r", [1],
                                          {"structured_outputs": {"json": {"a": np.zeros(2)}}}, None, 0.0]),
    msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], {"top_p": 1e-50}, None, 0.0]),
]


async def test_malformed_frames_are_dropped_with_a_warning_and_counted(
        context: zmq.asyncio.Context, folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    address = f"ipc://{folder}/in"
    receive: ZmqReceiveChannel[Any] = ZmqReceiveChannel(context, address, m.EngineCoreInput, bind=True)
    rogue = context.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(address)
    good = request(4)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with anyio.fail_after(30):
        for frame in MALFORMED:
            await rogue.send(frame)
        # From the same socket, so after the bad frames.
        await rogue.send(Codec(m.EngineCoreInput).encode(good))
        assert await receive.receive() == good
    assert receive.dropped_frames == len(MALFORMED)
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == len(MALFORMED)
    assert [r.getMessage().split(":")[0] for r in warnings] == [
        f"dropped a malformed frame of {len(frame)} bytes" for frame in MALFORMED]
    rogue.close()
    receive.close()


async def test_the_channel_keeps_serving_between_bad_frames(context: zmq.asyncio.Context, folder: Path) -> None:
    address = f"ipc://{folder}/in"
    receive: ZmqReceiveChannel[Any] = ZmqReceiveChannel(context, address, m.EngineCoreInput, bind=True)
    rogue = context.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(address)
    codec: Codec[Any] = Codec(m.EngineCoreInput)
    with anyio.fail_after(30):
        for i in range(5):
            await rogue.send(b"\xc1" * i)
            await rogue.send(codec.encode(request(i)))
        assert [await receive.receive() for _ in range(5)] == [request(i) for i in range(5)]
    assert receive.dropped_frames == 5
    rogue.close()
    receive.close()


async def test_a_closed_receive_side_ends_the_stream(context: zmq.asyncio.Context, folder: Path) -> None:
    send, receive = pair(context, f"ipc://{folder}/out", m.EngineCoreEvent)
    with anyio.fail_after(30):
        await send.send(m.EngineDead("gone"))
        assert await receive.receive() == m.EngineDead("gone")
    receive.close()
    for _ in range(2):  # and stays ended
        with pytest.raises(anyio.EndOfStream):
            await receive.receive()
    receive.close()  # closing twice is harmless
    send.close()
    send.close()


class _Exploding:
    """A codec whose decode raises what no decoder documents, for frames starting with b"!"."""

    def __init__(self, codec: Codec[Any], error: Exception) -> None:
        self.codec, self.error = codec, error

    def decode(self, frame: memoryview) -> Any:
        if bytes(frame[:1]) == b"!":
            raise self.error
        return self.codec.decode(frame)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("k"), TypeError("t"), RecursionError("deep")],
                         ids=lambda e: type(e).__name__)
async def test_any_decode_error_drops_the_frame(context: zmq.asyncio.Context, folder: Path, error: Exception,
                                                caplog: pytest.LogCaptureFixture) -> None:
    send, receive = pair(context, f"ipc://{folder}/in", m.EngineCoreInput)
    receive._codec = _Exploding(receive._codec, error)  # type: ignore[assignment]
    rogue = context.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"ipc://{folder}/in")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with anyio.fail_after(30):
        await rogue.send(b"!abc")
        await rogue.send(Codec(m.EngineCoreInput).encode(request(1)))
        assert await receive.receive() == request(1)
    assert receive.dropped_frames == 1
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"dropped a malformed frame of 4 bytes: {type(error).__name__}: {error}"]
    rogue.close()
    send.close()
    receive.close()


@pytest.mark.parametrize("receiver_binds", [True, False], ids=["receiver-binds", "sender-binds"])
async def test_a_bound_ipc_socket_is_owner_only_whatever_the_umask(context: zmq.asyncio.Context, folder: Path,
                                                                   receiver_binds: bool) -> None:
    umask = os.umask(0)  # the most permissive: a plain bind would make the file 0777
    try:
        send, receive = pair(context, f"ipc://{folder}/in", m.EngineCoreInput, receiver_binds=receiver_binds)
        assert os.umask(0) == 0  # restored after the bind
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(folder / "in").st_mode) == 0o600
    with anyio.fail_after(30):  # the owner still connects
        await send.send(request(2))
        assert await receive.receive() == request(2)
    send.close()
    receive.close()


async def test_an_abstract_ipc_address_has_no_file_to_restrict(context: zmq.asyncio.Context) -> None:
    send, receive = pair(context, f"ipc://@cadence-test-{uuid.uuid4().hex}", m.EngineCoreInput)
    with anyio.fail_after(30):
        await send.send(request(3))
        assert await receive.receive() == request(3)
    send.close()
    receive.close()
