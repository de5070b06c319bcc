"""The scheduler actor: the engine core's loop around the scheduler.

Take new messages without blocking while work exists (block when idle, using no CPU), schedule,
hand the step to the executor, apply its result, emit outputs. At most one message per actor pair
per step.

A request reaches the engine core from whatever is connected to its socket, not only from a front
end that checked it: one the engine could not serve (a token id outside the vocabulary would fail
the worker, a prompt that fits no KV cache would stop the loop) is refused here, answered at once
with finish reason "error" and logged, and the engine serves on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.to_thread

from cadence.core.scheduler import Scheduler
from cadence.core.step_timing import StepTiming
from cadence.executor.base import WorkerError
from cadence.lora.adapter import AdapterError, AdapterLimits, check_adapter
from cadence.lora_request import LoRARequest
from cadence.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExecutorFailed,
    LoRAStats,
    ModelRunnerOutput,
    SchedulerInbox,
    SchedulerStats,
)
from cadence.request import Request, RequestStatus
from cadence.runtime.actor import UNBOUNDED, Actor, Mailbox

logger = logging.getLogger(__name__)

# At most this long between two output batches while work is unfinished (see _heartbeat_due).
HEARTBEAT_S = 1.0
# How long one wait for a compiling grammar may hold off new messages (it ends sooner when a
# compile finishes).
_GRAMMAR_WAIT_S = 0.02


class SchedulerActor(Actor[SchedulerInbox]):
    # Unbounded: the front end bounds admissions; a bound here could deadlock the
    # scheduler -> detokenizer -> scheduler (abort) cycle.
    inbox_size = UNBOUNDED

    def __init__(self, scheduler: Scheduler, max_model_len: int, timing: StepTiming, *, vocab_size: int,
                 lora: AdapterLimits | None = None) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.lora = lora  # what a request's LoRA adapter is checked against; None: LoRA is off
        self.vocab_size = vocab_size
        self.timing = timing
        self.executor: Mailbox[Any]
        self.outputs_to: Mailbox[Any]
        self._pending: list[EngineCoreOutput] = []
        self._preempted: list[str] = []  # since the last output batch
        # Wall time each request was first scheduled, until its first output reports its queue time.
        self._first_scheduled: dict[str, float] = {}
        self._last_emit = time.monotonic()

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
                if self._pending or self._preempted or self._heartbeat_due():
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
            self._add(message)
        elif isinstance(message, AbortRequests):
            aborted = self.scheduler.finish_requests(message.request_ids, RequestStatus.FINISHED_ABORTED)
            self._pending.extend(aborted)
        else:
            raise TypeError(f"engine core got an unexpected {type(message).__name__} outside a step")

    def _add(self, message: EngineCoreRequest) -> None:
        if message.request_id in self.scheduler.requests:
            # Not answered: an output under this id would end the live request that holds it.
            logger.warning("dropped a request whose id %r is already in the engine", message.request_id)
            return
        error = request_error(message, self.vocab_size, self.max_model_len,
                              self.scheduler.allocator.capacity_tokens)
        if error is None and message.lora_request is not None:
            error = self._lora_error(message.lora_request)
        if error is None:
            try:
                self.scheduler.add_request(Request(
                    request_id=message.request_id,
                    prompt_token_ids=message.prompt_token_ids,
                    sampling_params=message.sampling_params,
                    eos_token_id=message.eos_token_id,
                    arrival_time=message.arrival_time,
                    max_model_len=self.max_model_len,
                    priority=message.priority,
                    user=message.user,
                    client_id=message.client_id,
                    lora_request=message.lora_request,
                ))
                return
            except ValueError as exc:  # a constrained request without a structured-output manager
                error = str(exc)
        logger.warning("refused request %r: %s", message.request_id, error)
        self._pending.append(EngineCoreOutput(message.request_id, [], finish_reason="error", error=error))

    async def _step(self) -> None:
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.num_scheduled_tokens and not self.scheduler.running:
            # Admission checks guarantee the first waiting request fits an empty engine.
            raise RuntimeError(f"no waiting request can be scheduled on an idle engine: {self.scheduler.waiting[0]}")
        now = time.time()
        self._preempted.extend(step.preempted_request_ids)
        for new in step.new_requests:
            request = self.scheduler.requests[new.request_id]
            if request.first_run:
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
        wall_s = time.perf_counter() - started
        self.scheduler.observe_step_time(wall_s, message.draft_time_s)
        self.timing.record(len(step.num_scheduled_tokens), wall_s, message.forward_time_s)

    def _heartbeat_due(self) -> bool:
        """Whether to report the state without outputs: while work is unfinished, at least every
        ``HEARTBEAT_S`` (long prefills produce no outputs for many steps). The front end's watchdog
        takes silence while requests are pending for a step that never ends."""
        return bool(self.scheduler.num_unfinished) and time.monotonic() - self._last_emit >= HEARTBEAT_S

    async def _emit(self) -> None:
        self._last_emit = time.monotonic()
        outputs, self._pending = self._pending, []
        for output in outputs:
            if output.finish_reason is not None:
                self._first_scheduled.pop(output.request_id, None)
        preempted, self._preempted = self._preempted, []
        await self.outputs_to.send(EngineCoreOutputs(outputs, time.time(), self.stats(), preempted=preempted))

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
            spec_decode=None if scheduler.speculation is None else scheduler.speculation.stats(),
            lora=None if self.lora is None else LoRAStats(scheduler.config.max_loras, _adapters(scheduler.running),
                                                          _adapters(scheduler.waiting)),
        )


    def _lora_error(self, lora: LoRARequest) -> str | None:
        """Why the workers could not run ``lora``'s adapter (checked again here, not only by the front
        end: a worker that fails to read an adapter fails the engine core), or None."""
        if self.lora is None:
            return "model: this engine core serves no LoRA adapter (start it with --enable-lora)"
        try:
            check_adapter(lora.lora_path, self.lora)
        except AdapterError as exc:
            return f"model: LoRA adapter {lora.lora_name!r}: {exc}"
        return None


def _adapters(requests: Iterable[Request]) -> list[str]:
    """The LoRA adapters ``requests`` run with, each once, by name."""
    return sorted({name for r in requests if (name := r.lora_name) is not None})


def request_error(request: EngineCoreRequest, vocab_size: int, max_model_len: int, kv_capacity: int) -> str | None:
    """Why the engine core cannot serve ``request`` (the front end's admission checks, again), or None.

    ``kv_capacity``: the tokens the whole KV pool holds.
    """
    prompt, params = request.prompt_token_ids, request.sampling_params
    if not prompt:
        return "prompt: the prompt is empty"
    if len(prompt) >= max_model_len:
        return f"prompt: the prompt has {len(prompt)} tokens but max_model_len is {max_model_len}"
    for field, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", params.logit_bias or {}),
                       ("eos_token_id", [] if request.eos_token_id is None else [request.eos_token_id])):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # min/max: C loops, a long prompt stays cheap
            outside = next(t for t in ids if not 0 <= t < vocab_size)
            return f"{field}: token id {outside} is outside the vocabulary (size {vocab_size})"
    needed = min(len(prompt) + (params.max_tokens or max_model_len), max_model_len)
    if needed > kv_capacity:
        return (f"max_tokens: the request needs up to {needed} tokens of KV cache but the whole cache holds "
                f"{kv_capacity}")
    if not math.isfinite(request.arrival_time):
        return f"arrival_time must be finite, got {request.arrival_time}"
    return None
