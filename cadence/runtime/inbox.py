"""An actor's inbox: a bounded first-in-first-out queue with one reader, on asyncio.

It keeps the semantics of anyio's memory object streams that the actors use (``send`` waits for
room, ``send_nowait`` raises :class:`anyio.WouldBlock` when full, ``close`` ends the reader's loop
once the queue is drained, a closed reader breaks the senders), at a fifth of their cost per
message: anyio's ``send`` and ``receive`` each pass a cancellation checkpoint (a turn of the event
loop) even when nothing waits, and at batch 1 the engine's step crosses several inboxes. A message
round trip between two actors took 54 us through the memory streams and 12 us through
``asyncio.Queue`` on the 2-core AVX2 machine (docs/performance.md, "The step's messages"). Unlike
anyio's, a ``send`` with room does not yield to the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

import anyio

from cadence.runtime.wakeup import Wakeup

M = TypeVar("M")


class Inbox(Generic[M]):
    """Messages for one reader; any number of senders on the same event loop."""

    def __init__(self, capacity: float) -> None:
        self._items: deque[M] = deque()
        self._capacity = capacity
        self._closed = False  # no more sends: the reader drains, then reads the end
        self._reader_gone = False  # the reader left: sends fail
        self._reader = Wakeup()
        self._senders: deque[asyncio.Future[None]] = deque()  # waiting for room, in order

    def __len__(self) -> int:
        return len(self._items)

    @property
    def reader_waiting(self) -> bool:
        """Whether the reader is blocked in :meth:`receive` for want of a message."""
        return self._reader.waiting

    def send_nowait(self, message: M) -> None:
        """:raises anyio.WouldBlock: full. :raises anyio.ClosedResourceError: after :meth:`close`.
        :raises anyio.BrokenResourceError: the reader has left."""
        if self._reader_gone:
            raise anyio.BrokenResourceError
        if self._closed:
            raise anyio.ClosedResourceError
        if len(self._items) >= self._capacity:
            raise anyio.WouldBlock
        self._items.append(message)
        self._reader.wake()

    async def send(self, message: M) -> None:
        """Waits while the inbox is full; otherwise as :meth:`send_nowait`."""
        while len(self._items) >= self._capacity and not (self._closed or self._reader_gone):
            room = asyncio.get_running_loop().create_future()
            self._senders.append(room)
            try:
                await room
            except BaseException:
                if room in self._senders:
                    self._senders.remove(room)
                elif room.done():  # woken, then cancelled: the room goes to the next sender
                    self._wake_sender()
                raise
        self.send_nowait(message)

    def receive_nowait(self) -> M:
        """:raises anyio.WouldBlock: empty. :raises anyio.EndOfStream: empty and closed."""
        if self._reader_gone:
            raise anyio.ClosedResourceError
        if self._items:
            message = self._items.popleft()
            self._wake_sender()
            return message
        if self._closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> M:
        """The next message, waiting for one. :raises anyio.EndOfStream: empty and closed."""
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                pass
            await self._reader.wait()

    def close(self) -> None:
        """No more sends; the reader gets what is queued, then the end."""
        self._closed = True
        self._reader.wake()
        self._wake_all_senders()

    def __aiter__(self) -> Inbox[M]:
        return self

    async def __anext__(self) -> M:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Inbox[M]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """The reader leaves: later sends raise :class:`anyio.BrokenResourceError`."""
        self._reader_gone = True
        self._items.clear()
        self._wake_all_senders()

    def _wake_sender(self) -> None:
        while self._senders:
            room = self._senders.popleft()
            if not room.done():
                room.set_result(None)
                return

    def _wake_all_senders(self) -> None:
        while self._senders:
            self._wake_sender()
