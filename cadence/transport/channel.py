"""The channel contract, and the in-process channel.

A channel moves messages one way. Its sending side is a :class:`cadence.core.actor.Mailbox`
(``send``, ``close``); its receiving side is a :class:`ReceiveChannel`. In one process it passes
Structs as they are; across processes (:mod:`cadence.transport.zmq_channel`) it encodes them with
msgspec. Actors see the same calls either way.
"""

from __future__ import annotations

import math
from typing import Generic, Protocol, TypeVar

import anyio

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ReceiveChannel(Protocol[T_co]):
    async def receive(self) -> T_co:
        """The next message. :raises anyio.EndOfStream: once the channel is closed."""
        ...

    def close(self) -> None: ...


class InProcessChannel(Generic[T]):
    """A memory stream with both halves in one object, for symmetry with the ZMQ pair."""

    def __init__(self, capacity: float = math.inf) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[T](capacity)

    async def send(self, message: T) -> None:
        await self._send.send(message)

    async def receive(self) -> T:
        return await self._receive.receive()

    def close(self) -> None:
        self._send.close()
