"""The receiving side of a channel between processes.

A channel moves messages one way. Its sending side is a :class:`cadence.runtime.actor.Mailbox`
(``send``, ``close``), as an actor's inbox is; its receiving side is a :class:`ReceiveChannel`,
which a :class:`~cadence.runtime.forwarder.Forwarder` reads into local inboxes. In one process an
actor sends straight to another's inbox (Structs pass as they are); across processes
(:mod:`cadence.runtime.zmq_channel`) the channel encodes them with msgspec. Actors make the same
calls either way.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

T_co = TypeVar("T_co", covariant=True)


class ReceiveChannel(Protocol[T_co]):
    async def receive(self) -> T_co:
        """The next message. :raises anyio.EndOfStream: once the channel is closed."""
        ...

    def close(self) -> None: ...
