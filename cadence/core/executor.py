"""The executor actor: hands each scheduled step to the worker and returns the sampled tokens.

The model runs in a worker thread (torch releases the GIL), so the event loop stays free to take
new requests and emit outputs while the forward pass computes.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from cadence.core.actor import Actor, Mailbox
from cadence.core.worker import Worker
from cadence.messages import ExecutorFailed, SchedulerOutput


class ExecutorActor(Actor[SchedulerOutput]):
    """In-process executor over one worker; replies to the scheduler actor."""

    def __init__(self, worker: Worker, reply_to: Mailbox[Any]) -> None:
        super().__init__()
        self.worker = worker
        self.reply_to = reply_to

    async def run(self) -> None:
        async with self.inbox:
            async for step in self.inbox:
                try:
                    result = await anyio.to_thread.run_sync(self.worker.execute_model, step)
                except Exception as exc:
                    await self.reply_to.send(ExecutorFailed(step.step_id, f"{type(exc).__name__}: {exc}"))
                    raise
                await self.reply_to.send(result)
