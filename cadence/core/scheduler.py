"""The scheduler: continuous batching under a token budget and a seat limit.

There are no prefill or decode phases: each step gives each chosen request some tokens towards
``num_tokens - num_computed_tokens``. Running requests are served first, then waiting ones in the
policy's order; a step that had to preempt admits nobody new. Preemption is by recompute.
The scheduler owns the KV allocator and calls it synchronously (see DESIGN.md, "Processes and actors").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cadence.config import SchedulerConfig
from cadence.core.kv_allocator import KVAllocator
from cadence.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from cadence.policies.base import SchedulingPolicy
from cadence.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: KVAllocator, policy: SchedulingPolicy) -> None:
        self.config = config
        self.allocator = allocator
        self.policy = policy
        self.requests: dict[str, Request] = {}
        # Arrival order; preempted requests go back to the front.
        self.waiting: deque[Request] = deque()
        # Admission order.
        self.running: list[Request] = []
        # Requests the worker holds state for (scheduled at least once since their last admission).
        self._on_worker: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_since_last_step)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.policy.on_arrival(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish these requests as aborted; unknown or already finished ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort"))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.allocator.free(request.request_id)
        del self.requests[request.request_id]
        if request.request_id in self._on_worker:
            self._on_worker.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)
        self.policy.on_finished(request)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []

        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue
            num = self.policy.num_tokens(request, budget)
            if num == 0:
                continue
            blocks = self._allocate_or_preempt(request, num, scheduled, preempted)
            if blocks is None:
                continue
            budget = self._take(request, num, blocks, budget, scheduled, new_blocks)

        # Reclaim what preempted requests had been given earlier in this step.
        for request in preempted:
            budget += scheduled.pop(request.request_id, 0)
            new_blocks.pop(request.request_id, None)

        if not preempted:
            budget = self._admit_waiting(budget, scheduled, new_blocks)
        return self._build_output(scheduled, new_blocks, preempted)

    def _allocate_or_preempt(
        self, request: Request, num: int, scheduled: dict[str, int], preempted: list[Request]
    ) -> list[int] | None:
        """Blocks for ``num`` more tokens of a running request, preempting others until they fit."""
        while True:
            blocks = self.allocator.allocate(request, num)
            if blocks is not None:
                return blocks
            victim = self.requests[self.policy.pick_victim(self.running, request).request_id]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], new_blocks: dict[str, list[int]]) -> int:
        admitted: list[Request] = []
        for view in self.policy.order_waiting(self.waiting):
            if budget == 0 or len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            request = self.requests[view.request_id]
            hit_blocks, hit_tokens = self.allocator.get_computed_blocks(request)
            request.num_computed_tokens = hit_tokens  # the policy sizes what remains after the hit
            num = self.policy.num_tokens(request, budget)
            request.num_computed_tokens = 0  # the allocator counts the hit itself
            blocks = self.allocator.allocate(request, num, hit_blocks, hit_tokens) if num else None
            if blocks is None:
                break
            request.num_computed_tokens = hit_tokens
            request.num_cached_tokens = hit_tokens
            request.status = RequestStatus.RUNNING
            admitted.append(request)
            budget = self._take(request, num, blocks, budget, scheduled, new_blocks)
        for request in admitted:
            self.waiting.remove(request)
            self.running.append(request)
        return budget

    def _take(
        self,
        request: Request,
        num: int,
        blocks: list[int],
        budget: int,
        scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
    ) -> int:
        scheduled[request.request_id] = num
        new_blocks[request.request_id] = blocks
        self.policy.on_scheduled(request, num)
        return budget - num

    def _build_output(
        self, scheduled: dict[str, int], new_blocks: dict[str, list[int]], preempted: list[Request]
    ) -> SchedulerOutput:
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        preempted_ids = [r.request_id for r in preempted if r.request_id in self._on_worker]
        self._on_worker.difference_update(preempted_ids)
        for request_id, num in scheduled.items():
            request = self.requests[request_id]
            if request_id in self._on_worker:
                cached_requests.append(
                    CachedRequestData(request_id, new_blocks[request_id], request.num_computed_tokens))
            else:
                new_requests.append(NewRequestData(
                    request_id=request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    eos_token_id=request.eos_token_id,
                    block_ids=self.allocator.block_ids(request_id),
                    num_computed_tokens=request.num_computed_tokens,
                ))
                self._on_worker.add(request_id)
            request.num_computed_tokens += num
        self._step_id += 1
        output = SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=scheduled,
            finished_request_ids=self._finished_since_last_step,
            preempted_request_ids=preempted_ids,
        )
        self._finished_since_last_step = []
        return output

    # ---- results -----------------------------------------------------------------------------

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free what finished; returns the step's outputs."""
        outputs = []
        logprobs = runner_output.logprobs
        for i, (request_id, token_id) in enumerate(
                zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True)):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.append_output_token(token_id)
            stop = request.check_stop()
            if stop is not None:
                self._finish(request, stop)
            outputs.append(EngineCoreOutput(
                request_id,
                [token_id],
                new_logprobs=None if logprobs is None else [logprobs[i]],
                finish_reason=None if stop is None else stop.finish_reason,
                num_cached_tokens=request.num_cached_tokens,
            ))
        return outputs
