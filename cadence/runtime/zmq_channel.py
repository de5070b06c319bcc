"""Channels over pyzmq sockets: PUSH to send, PULL to receive, one codec per direction.

A frame that does not decode into the channel's message type, for whatever reason, is logged and
dropped: a stray or malicious sender can never take the engine down. An ipc socket that a channel
binds is owner-only (mode 0600, created so), so only its own user can connect to it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Generic, TypeVar

import anyio
import zmq
import zmq.asyncio

from cadence.runtime.codec import Codec

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ZmqSendChannel(Generic[T]):
    """``unbounded``: queue frames without limit (no high-water mark), so that :meth:`send_nowait`
    never fails; for a sender whose callers bound what they send (the front end's admission)."""

    def __init__(self, context: zmq.asyncio.Context, address: str, message_type: Any, *, bind: bool,
                 unbounded: bool = False) -> None:
        self._codec: Codec[T] = Codec(message_type)
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        if unbounded:
            self._socket.setsockopt(zmq.SNDHWM, 0)
        _bind_private(self._socket, address) if bind else self._socket.connect(address)
        # The same socket, for sends that must not yield to the event loop.
        self._sync_socket: zmq.Socket[bytes] = zmq.Socket.shadow(self._socket.underlying)

    async def send(self, message: T) -> None:
        await self._socket.send(self._codec.encode(message), copy=False)

    def send_nowait(self, message: T) -> None:
        """Queue ``message`` without yielding (no cancellation can cut a run of these short).

        :raises zmq.Again: the queue is full (never when ``unbounded``).
        """
        self._sync_socket.send(self._codec.encode(message), zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class ZmqReceiveChannel(Generic[T]):
    def __init__(self, context: zmq.asyncio.Context, address: str, message_type: Any, *, bind: bool) -> None:
        self._codec: Codec[T] = Codec(message_type)
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        _bind_private(self._socket, address) if bind else self._socket.connect(address)
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
            except Exception as exc:  # any decode failure (msgspec, an ext hook, __post_init__): the frame's fault
                self.dropped_frames += 1
                logger.warning("dropped a malformed frame of %d bytes: %s: %s", len(frame.buffer),
                               type(exc).__name__, exc)

    def close(self) -> None:
        self._socket.close(linger=0)


def _bind_private(socket: zmq.Socket[Any], address: str) -> None:
    """Bind ``socket``; an ipc socket's file is created owner-only.

    The umask makes the file 0600 from the start, so no other user can connect between the bind
    and the chmod (which keeps it so whatever the umask did); it is the process's umask, restored
    at once, and at worst makes another thread's file created meanwhile owner-only too.
    """
    if not address.startswith("ipc://") or address.startswith("ipc://@"):  # tcp, or Linux's abstract namespace
        socket.bind(address)
        return
    umask = os.umask(0o177)
    try:
        socket.bind(address)
    finally:
        os.umask(umask)
    os.chmod(socket.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("ipc://"), 0o600)
