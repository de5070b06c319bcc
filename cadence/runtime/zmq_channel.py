"""Channels over pyzmq sockets: PUSH to send, PULL to receive, one codec per direction.

A frame that does not decode into the channel's message type is logged and dropped: a stray or
malicious sender can never take the engine down.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import anyio
import msgspec
import zmq
import zmq.asyncio

from cadence.runtime.codec import Codec

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ZmqSendChannel(Generic[T]):
    def __init__(self, context: zmq.asyncio.Context, address: str, message_type: Any, *, bind: bool) -> None:
        self._codec: Codec[T] = Codec(message_type)
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address) if bind else self._socket.connect(address)

    async def send(self, message: T) -> None:
        await self._socket.send(self._codec.encode(message), copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class ZmqReceiveChannel(Generic[T]):
    def __init__(self, context: zmq.asyncio.Context, address: str, message_type: Any, *, bind: bool) -> None:
        self._codec: Codec[T] = Codec(message_type)
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address) if bind else self._socket.connect(address)
        self.dropped_frames = 0

    async def receive(self) -> T:
        while True:
            try:
                frame = await self._socket.recv(copy=False)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ENOTSOCK:
                    raise anyio.EndOfStream from None
                raise
            try:
                return self._codec.decode(frame.buffer)
            except (msgspec.DecodeError, ValueError) as exc:
                self.dropped_frames += 1
                logger.warning("dropped a malformed frame of %d bytes: %s", len(frame.buffer), exc)

    def close(self) -> None:
        self._socket.close(linger=0)
