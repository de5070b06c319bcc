"""One task's wait for another's wake-up, on asyncio: what an actor's inbox and a request's output
collector need from an event, without an anyio Event's cost (a cancellation checkpoint on every
wait, and a new Event after each: docs/performance.md, "The step's messages")."""

from __future__ import annotations

import asyncio


class Wakeup:
    """A wait by one task at a time; a wake with nobody waiting is dropped, so the waiter checks its
    condition before waiting."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    @property
    def waiting(self) -> bool:
        return self._waiter is not None

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
