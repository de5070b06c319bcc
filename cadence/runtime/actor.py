"""A minimal actor runtime on anyio: one task per actor, an inbox (:mod:`cadence.runtime.inbox`),
one task group for them all.

Structured concurrency does the bookkeeping: :func:`run_actors` starts every actor in one task
group; if one raises, ``on_crash`` is told first (so pending requests fail with a clear error
instead of waiting forever) and the group cancels the others. Closing an inbox's send side ends
its actor's ``run`` loop cleanly.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio

from cadence.runtime.inbox import Inbox

logger = logging.getLogger(__name__)

M = TypeVar("M")
M_contra = TypeVar("M_contra", contravariant=True)


class Mailbox(Protocol[M_contra]):
    """Where an actor sends: another actor's inbox, or a channel to another process."""

    async def send(self, message: M_contra) -> None: ...

    def close(self) -> None: ...


class NowaitMailbox(Mailbox[M_contra], Protocol[M_contra]):
    """A mailbox that also takes a message without yielding to the event loop, so that a run of
    sends cannot be cut short by a cancellation (an actor's unbounded inbox, an unbounded channel)."""

    def send_nowait(self, message: M_contra) -> None: ...


class Actor(abc.ABC, Generic[M]):
    """One component of the engine: receives messages of type ``M`` through its inbox."""

    #: Inbox capacity; ``math.inf`` where a bound could deadlock a cycle of actors.
    inbox_size: float = 256

    def __init__(self) -> None:
        self.inbox: Inbox[M] = Inbox(self.inbox_size)

    @property
    def name(self) -> str:
        return type(self).__name__

    async def send(self, message: M) -> None:
        await self.inbox.send(message)

    def send_nowait(self, message: M) -> None:
        self.inbox.send_nowait(message)

    def close(self) -> None:
        """No more messages: ``run`` ends once the inbox is drained."""
        self.inbox.close()

    @abc.abstractmethod
    async def run(self) -> None:
        """Process the inbox until it is closed."""


CrashHandler = Callable[[str], Awaitable[None] | None]


async def run_actors(actors: Sequence[Actor[Any]], on_crash: CrashHandler,
                     started: anyio.Event | None = None) -> None:
    """Run every actor in one task group until all return or one crashes.

    A crash is reported only through ``on_crash``: the callers that own pending requests learn of it
    there, and the other actors are cancelled.
    """

    async def supervise(actor: Actor[Any], scope: anyio.CancelScope) -> None:
        try:
            await actor.run()
        except Exception as exc:
            message = f"{actor.name} crashed: {type(exc).__name__}: {exc}"
            logger.exception(message)
            result = on_crash(message)
            if result is not None:
                await result
            scope.cancel()

    async with anyio.create_task_group() as group:
        for actor in actors:
            group.start_soon(supervise, actor, group.cancel_scope, name=actor.name)
        if started is not None:
            started.set()


UNBOUNDED = math.inf
