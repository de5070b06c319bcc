"""The scheduler actor: the engine core's loop around the scheduler.

Take new messages without blocking while work exists (block when idle, using no CPU), schedule,
hand the step to the executor, apply its result, emit outputs. At most one message per actor pair
per step.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.to_thread

from cadence.core.scheduler import Scheduler
from cadence.core.step_timing import StepTiming
from cadence.executor.base import WorkerError
from cadence.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExecutorFailed,
    ModelRunnerOutput,
    SchedulerInbox,
    SchedulerStats,
)
from cadence.request import Request
from cadence.runtime.actor import UNBOUNDED, Actor, Mailbox

# How long one wait for a compiling grammar may hold off new messages (it ends sooner when a
# compile finishes).
_GRAMMAR_WAIT_S = 0.02


class SchedulerActor(Actor[SchedulerInbox]):
    # Unbounded: the front end bounds admissions; a bound here could deadlock the
    # scheduler -> detokenizer -> scheduler (abort) cycle.
    inbox_size = UNBOUNDED

    def __init__(self, scheduler: Scheduler, max_model_len: int, timing: StepTiming) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.timing = timing
        self.executor: Mailbox[Any]
        self.outputs_to: Mailbox[Any]
        self._pending: list[EngineCoreOutput] = []
        # Wall time each request was first scheduled, until its first output reports its queue time.
        self._first_scheduled: dict[str, float] = {}

    def connect(self, executor: Mailbox[Any], outputs_to: Mailbox[Any]) -> None:
        self.executor = executor
        self.outputs_to = outputs_to

    async def run(self) -> None:
        try:
            while await self._take_messages():
                self._pending.extend(self.scheduler.finish_failed_grammars())
                if self.scheduler.waiting_for_grammars:
                    # Sleep in a thread on the compiles, not on the event loop; then look at the inbox again.
                    await anyio.to_thread.run_sync(self.scheduler.wait_for_grammars, _GRAMMAR_WAIT_S)
                elif self.scheduler.num_unfinished:
                    await self._step()
                if self._pending:
                    await self._emit()
        finally:
            self.executor.close()

    async def _take_messages(self) -> bool:
        """Block for a message when idle, then drain the inbox. False once the inbox is closed."""
        if not self.scheduler.num_unfinished and not self._pending:
            try:
                self._handle(await self.inbox.receive())
            except anyio.EndOfStream:
                return False
        while True:
            try:
                self._handle(self.inbox.receive_nowait())
            except anyio.WouldBlock:
                return True
            except anyio.EndOfStream:  # finish what is left, outputs of the last aborts included
                return bool(self.scheduler.num_unfinished or self._pending)

    def _handle(self, message: SchedulerInbox) -> None:
        if isinstance(message, EngineCoreRequest):
            self.scheduler.add_request(Request(
                request_id=message.request_id,
                prompt_token_ids=message.prompt_token_ids,
                sampling_params=message.sampling_params,
                eos_token_id=message.eos_token_id,
                arrival_time=message.arrival_time,
                max_model_len=self.max_model_len,
                priority=message.priority,
                user=message.user,
            ))
        elif isinstance(message, AbortRequests):
            self._pending.extend(self.scheduler.abort_requests(message.request_ids))
        else:
            raise TypeError(f"engine core got an unexpected {type(message).__name__} outside a step")

    async def _step(self) -> None:
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.num_scheduled_tokens and not self.scheduler.running:
            # Admission checks guarantee the first waiting request fits an empty engine.
            raise RuntimeError(f"no waiting request can be scheduled on an idle engine: {self.scheduler.waiting[0]}")
        now = time.time()
        for new in step.new_requests:
            request = self.scheduler.requests[new.request_id]
            if request.num_output_tokens == 0 and request.num_preemptions == 0:
                self._first_scheduled[new.request_id] = now - request.arrival_time
        await self.executor.send(step)
        while True:
            try:
                message = await self.inbox.receive()
            except anyio.EndOfStream:
                raise RuntimeError("engine core inbox closed while a step was running") from None
            if isinstance(message, ModelRunnerOutput):
                break
            if isinstance(message, ExecutorFailed):
                raise WorkerError(f"step {message.step_id} failed in the worker: {message.error}")
            self._handle(message)
        outputs = self.scheduler.update_from_output(message)
        for output in outputs:
            output.queue_time_s = self._first_scheduled.pop(output.request_id, None)
        self._pending.extend(outputs)
        self.timing.record(len(step.num_scheduled_tokens), time.perf_counter() - started, message.forward_time_s)

    async def _emit(self) -> None:
        outputs, self._pending = self._pending, []
        for output in outputs:
            if output.finish_reason is not None:
                self._first_scheduled.pop(output.request_id, None)
        await self.outputs_to.send(EngineCoreOutputs(outputs, time.time(), self.stats()))

    def stats(self) -> SchedulerStats:
        scheduler, allocator = self.scheduler, self.scheduler.allocator
        return SchedulerStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=allocator.usage,
            num_free_blocks=allocator.num_free_blocks,
            num_blocks=allocator.num_blocks,
            prefix_cache_queries=allocator.prefix_cache_queries,
            prefix_cache_hits=allocator.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.timing.total.num_steps,
            step_time_s=self.timing.total.wall_s,
            forward_time_s=self.timing.total.forward_s,
        )
