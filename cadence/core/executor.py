"""The executor actor: hands each scheduled step to the executor and returns the sampled tokens.

The executor (see :mod:`cadence.executor`) runs the step in a thread: the in-process model (torch
releases the GIL), or a wait on the worker processes. Either way the event loop stays free to take
new requests and emit outputs while the forward pass computes.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from cadence.core.actor import Actor, Mailbox
from cadence.executor.base import Executor
from cadence.messages import ExecutorFailed, SchedulerOutput


class ExecutorActor(Actor[SchedulerOutput]):
    """Runs each step on the executor's workers; replies to the scheduler actor."""

    def __init__(self, executor: Executor, reply_to: Mailbox[Any]) -> None:
        super().__init__()
        self.executor = executor
        self.reply_to = reply_to

    async def run(self) -> None:
        async with self.inbox:
            async for step in self.inbox:
                try:
                    result = await anyio.to_thread.run_sync(self.executor.execute_model, step)
                except Exception as exc:
                    await self.reply_to.send(ExecutorFailed(step.step_id, f"{type(exc).__name__}: {exc}"))
                    raise
                await self.reply_to.send(result)
