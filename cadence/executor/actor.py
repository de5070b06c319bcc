"""The executor actor: hands each scheduled step to the executor and returns the sampled tokens.

The executor (see :mod:`cadence.executor`) runs the step in a thread: the in-process model (torch
releases the GIL), or a wait on the worker processes. Either way the event loop stays free to take
new requests and emit outputs while the forward pass computes. Alongside, the actor watches the
workers between steps (:meth:`Executor.watch_workers`): a worker that dies while the engine is idle
crashes the actor at once, as a failed step would, instead of going unnoticed until the next step.
"""

from __future__ import annotations

from typing import Any

import anyio

from cadence.executor.base import Executor, WorkerError
from cadence.messages import ExecutorFailed, SchedulerOutput
from cadence.runtime.actor import Actor, Mailbox


class ExecutorActor(Actor[SchedulerOutput]):
    """Runs each step on the executor's workers; replies to the scheduler actor."""

    def __init__(self, executor: Executor, reply_to: Mailbox[Any]) -> None:
        super().__init__()
        self.executor = executor
        self.reply_to = reply_to

    async def run(self) -> None:
        """Run steps until the inbox closes, watching the workers meanwhile.

        :raises WorkerError: a worker died between steps.
        """
        # Both raise out of the task group as themselves, not wrapped in an ExceptionGroup.
        failures: list[Exception] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch, failures, group.cancel_scope)
            try:
                await self._run_steps()
            except Exception as exc:
                failures.append(exc)
            group.cancel_scope.cancel()
        if failures:
            raise failures[0]

    async def _watch(self, failures: list[Exception], scope: anyio.CancelScope) -> None:
        try:
            await self.executor.watch_workers()
        except WorkerError as exc:
            failures.append(exc)
            scope.cancel()

    async def _run_steps(self) -> None:
        async with self.inbox:
            async for step in self.inbox:
                try:
                    # Abandoned, not awaited, when the run is cancelled (Executor.run_step).
                    result = await self.executor.run_step(step)
                except Exception as exc:
                    await self.reply_to.send(ExecutorFailed(step.step_id, f"{type(exc).__name__}: {exc}"))
                    raise
                await self.reply_to.send(result)
