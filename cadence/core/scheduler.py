"""The scheduler: continuous batching under a token budget and a seat limit.

There are no prefill or decode phases: each step gives each chosen request some tokens towards
``num_tokens - num_computed_tokens``, bounded by ``max_num_batched_tokens`` and ``max_num_seqs``.
Running requests are served first (in the policy's running order), then waiting ones are admitted
in the policy's order until one cannot be (head of line). Preemption is by recompute, and happens
(a) when a running request needs blocks (the policy's ``pick_victim``) and (b) when the policy says
a waiting request outranks a running one and seats or blocks ran out (``preempt_for``); a step
that did (a) admits only requests of kind (b). It owns the KV allocator (docs/architecture.md).

A constrained request is admitted once its grammar has compiled (``structured_output.py``); drafts
(``--speculative-config``) are verified with decodes; ``--trace-scheduling`` records every decision.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from cadence.config import SchedulerConfig
from cadence.core import scheduling_trace as why
from cadence.core.cost_model import CostModel, StepShape
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.speculation import SpecDecoding, logprob_starts
from cadence.core.step_budget import StepBudget
from cadence.core.step_plan import StepPlan
from cadence.core.structured_output import StructuredOutputManager
from cadence.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from cadence.policies.base import SchedulingPolicy
from cadence.request import Request, RequestStatus, RequestView

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: KVCacheManager, policy: SchedulingPolicy,
                 structured_output: StructuredOutputManager | None = None, cost_model: CostModel | None = None,
                 trace: why.SchedulingTrace | None = None, speculation: SpecDecoding | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.policy = policy
        self.structured_output = structured_output  # None where requests carry no constraints (the simulator)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests go back to the front
        self.running: list[Request] = []  # admission order
        self._on_worker: set[str] = set()  # scheduled at least once since their last admission
        self._finished_since_last_step: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0
        # The inter-token latency target sizes prefill chunks, which whole-prefill policies never cut.
        self.step_budget = (StepBudget(config.target_itl_ms / 1000.0, cost_model)
                            if config.target_itl_ms and policy.chunked else None)
        self.last_shape: StepShape | None = None  # what the last step computed (kept under an ITL target)
        self._last_num_tokens = 0
        self.trace = trace  # --trace-scheduling: every decision about each request, on the policy's clock
        self.speculation = speculation  # --speculative-config: drafts verified with decodes

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
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output is None:
                raise ValueError("this scheduler has no structured-output manager for a constrained request")
            self.structured_output.add_request(request.request_id, constraint)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.policy.on_arrival(request)
        if self.trace is not None:
            self.trace.arrival(request, self._step_id + 1, self.policy.now())

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """Finish these requests, in turn, with ``status``; unknown or already finished ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, status)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=status.finish_reason))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.error is not None:
            logger.error("request %s: %s", request.request_id, request.error)
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.allocator.free(request.request_id)
        del self.requests[request.request_id]
        if self.trace is not None:
            self.trace.finished(request.request_id, status.finish_reason, self.policy.now())
        if self.structured_output is not None:
            self.structured_output.remove(request.request_id)
        if request.request_id in self._on_worker:
            self._on_worker.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)
        self.policy.on_finished(request)

    # ---- grammars ----------------------------------------------------------------------------

    @property
    def waiting_for_grammars(self) -> bool:
        """Nothing can be scheduled until a compile ends (see :meth:`StructuredOutputManager.blocks_all`)."""
        grammars = self.structured_output
        return grammars is not None and grammars.blocks_all(self.waiting, self.running)

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a pending compile finishes or ``timeout_s`` passes (run it in a thread)."""
        if self.structured_output is not None:
            self.structured_output.wait(timeout_s)

    def finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Finish, as errors, the requests whose grammar failed to compile; their outputs."""
        grammars = self.structured_output
        if grammars is None or not grammars.num_compiling:
            return []
        outputs = []
        for request_id, error in grammars.take_failures().items():
            request = self.requests[request_id]
            request.error = error
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=request.status.finish_reason, error=error))
        return outputs

    def _grammar_ready(self, request: Request) -> bool:
        return self.structured_output is None or self.structured_output.is_ready(request.request_id)

    def _active_grammars(self) -> StructuredOutputManager | None:
        """The manager while some request has a matcher (checked once per step: no cost per token)."""
        grammars = self.structured_output
        return grammars if grammars is not None and grammars.num_active else None

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.trace is not None:
            self.trace.begin_step(self._step_id + 1, self.policy.now())
        step = StepPlan(self.config.max_num_batched_tokens, self.step_budget, self.running, min(
            len(self.running) + len(self.waiting), self.config.max_num_seqs), self.config.max_prompts_per_step)
        self._serve_running(step)
        if self.speculation is not None:  # with what the running requests' own tokens left
            self.speculation.add_drafts(step, self.requests, self.allocator, self.policy, self._active_grammars())
        self._admit_waiting(step)
        return self._build_output(step)

    def _serve_running(self, step: StepPlan) -> None:
        for view in self.policy.order_running(self.running):
            if step.budget == 0:
                break
            request = self.requests[view.request_id]
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            start = request.num_computed_tokens
            num = self.policy.num_tokens(request, step.token_budget(request, start))
            if num == 0:
                if self.trace is not None:
                    self.trace.event("skipped", request=request.request_id, reason=step.limit(request, start))
                continue
            blocks = self._allocate_or_preempt(request, num, step)
            if blocks is not None:
                step.take(request, num, blocks, start)

    def _allocate_or_preempt(self, request: Request, num: int, step: StepPlan) -> list[list[int]] | None:
        """Blocks for ``num`` more tokens of a running request, preempting others until they fit."""
        while True:
            blocks = self.allocator.allocate(request, num)
            if blocks is not None:
                return blocks
            victim = self._running_request(self.policy.pick_victim(self.running, request), "pick_victim")
            self._preempt(victim, step, request, why.KV_BLOCKS)
            step.preempted_for_running = True
            if victim is request:
                return None

    def _admit_waiting(self, step: StepPlan) -> None:
        """Admit in the policy's order until one request cannot be admitted (head of line).

        After a preemption for a running request, memory is short: only requests the policy would
        preempt for (:meth:`SchedulingPolicy.preempt_for`) are admitted (with the built-in policies
        but ``priority``, nobody). A request preempted in this step is not readmitted in it and
        blocks those behind it; after each preemption for a waiting request the policy re-orders the
        queue, so its victims take their place in that order.
        """
        admitted: list[Request] = []
        # Read lazily, and afresh after a preemption (which changes the queue): a policy may hand
        # out an iterator over an order it keeps up to date (policies/waiting_queue.py).
        order = iter(self.policy.order_waiting(self.waiting))
        while (view := next(order, None)) is not None:
            request = self.requests.get(view.request_id)
            if request is None or request.status == RequestStatus.RUNNING:
                continue  # not waiting: a policy's mistake, not a reason to stop
            waits_for = None if self._grammar_ready(request) else "grammar"  # still compiling
            if waits_for is None and not self._adapter_fits(request, admitted):
                waits_for = "adapter"  # --max-loras others run: it waits for one of theirs to finish
            if waits_for is not None:
                if self.trace is not None:
                    self.trace.event(waits_for, request=request.request_id)
                continue  # those behind it go first
            blocker = step.stop_reason(request)
            if (blocker is None and step.preempted_for_running
                    and self.policy.preempt_for(request, self.running) is None):
                blocker = why.MEMORY
            num_preempted = len(step.preempted)
            if blocker is None:
                blocker = self._admit(request, len(admitted), step)
            if blocker is not None:
                if self.trace is not None:
                    self.trace.event("blocked", head=request.request_id, reason=blocker,
                                     waiting=len(self.waiting))
                break
            self.waiting.remove(request)
            admitted.append(request)
            if len(step.preempted) > num_preempted:
                order = iter(self.policy.order_waiting(self.waiting))
        self.running.extend(admitted)

    def _adapter_fits(self, request: Request, admitted: list[Request]) -> bool:
        """Whether ``request``'s LoRA adapter may join those running: at most ``max_loras`` at once."""
        if request.lora_name is None or not self.config.max_loras:
            return True
        active = {r.lora_name for r in (*self.running, *admitted)} - {None}
        return request.lora_name in active or len(active) < self.config.max_loras

    def _admit(self, request: Request, num_admitted: int, step: StepPlan) -> str | None:
        """Give a waiting request tokens, a seat and blocks, preempting where the policy says so;
        None once admitted, else why not (a ``scheduling_trace`` reason).

        The budget is checked first: preemption makes room for seats and blocks, never for tokens.
        """
        while True:
            # Look up again after every preemption: freeing a victim can drop hashes of blocks it
            # was given in this step, and the lookup must go straight into allocate().
            hit_blocks, hit_tokens = self._prefix_hit(request)
            num = self.policy.num_tokens(request, step.token_budget(request, hit_tokens), hit_tokens)
            if num == 0:
                return step.limit(request, hit_tokens)
            if len(self.running) + num_admitted >= self.config.max_num_seqs:
                if not self._preempt_for(request, step, why.SEATS):
                    return why.SEATS
                continue
            blocks = self.allocator.allocate(request, num, hit_blocks, hit_tokens)
            if blocks is not None:
                break
            if not self._preempt_for(request, step, why.KV_BLOCKS):
                return why.KV_BLOCKS
        request.num_computed_tokens = hit_tokens
        if request.num_preemptions == 0:  # usage counts the prompt's hit, not a resumption's own blocks
            request.num_cached_tokens = hit_tokens
        request.status = RequestStatus.RUNNING
        step.admit(request, num, blocks, hit_tokens)
        return None

    def observe_step_time(self, seconds: float, draft_seconds: float = 0.0) -> None:
        """How long the last step took (wall or modelled), ``draft_seconds`` of it proposing drafts."""
        if self.step_budget is not None and self.last_shape is not None:
            self.step_budget.observe(self.last_shape, seconds)
        if self.speculation is not None:
            self.speculation.observe(self._last_num_tokens, seconds, draft_seconds)

    def _prefix_hit(self, request: Request) -> tuple[list[list[int]], int]:
        """The request's prefix-cache hit; none for one that wants its prompt's logprobs, whose
        every position must be computed (as vLLM)."""
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # allocate() takes no hit lists as no hits
        return self.allocator.get_computed_blocks(request)

    def _preempt_for(self, request: Request, step: StepPlan, reason: str) -> bool:
        view = self.policy.preempt_for(request, self.running)
        if view is None:
            return False
        self._preempt(self._running_request(view, "preempt_for"), step, request, reason)
        return True

    def _running_request(self, view: RequestView, hook: str) -> Request:
        request = self.requests.get(view.request_id)
        if request is None or request not in self.running:
            raise RuntimeError(f"policy {self.policy.name!r}: {hook} returned {view.request_id!r}, "
                               "which is not running")
        return request

    def _preempt(self, request: Request, step: StepPlan, needy: Request, reason: str) -> None:
        """Preempt by recompute, for ``needy``; what the request was given earlier in this step goes back."""
        if self.trace is not None:
            self.trace.event("preempted", request=request.request_id, by=needy.request_id, reason=reason)
        step.drop(request)
        step.preempted.append(request)
        self.running.remove(request)
        self.allocator.free(request.request_id)  # before the reset: free() keeps what was computed
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: in arrival order it came before everything waiting (policies that
        # order otherwise re-rank it, so it keeps its place).
        self.waiting.appendleft(request)
        self.policy.on_preempted(request)

    def _build_output(self, step: StepPlan) -> SchedulerOutput:
        grammars = self._active_grammars()
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        if self.step_budget is not None:
            self.last_shape = step.shape(self.requests)
        self._last_num_tokens = sum(step.scheduled.values())
        preempted_ids = [r.request_id for r in step.preempted if r.request_id in self._on_worker]
        self._on_worker.difference_update(preempted_ids)
        for request_id, num in step.scheduled.items():
            request = self.requests[request_id]
            admitted = request_id not in self._on_worker
            if admitted:
                new_requests.append(request.new_request_data(self.allocator.block_ids(request_id)))
                self._on_worker.add(request_id)
            else:
                cached_requests.append(CachedRequestData(request_id, step.new_blocks[request_id],
                                                         request.num_computed_tokens))
            request.drafts.num_scheduled = step.drafts.get(request_id, 0)
            if self.trace is not None:
                self.trace.scheduled(request, num, admitted)
            # Told once the step is final, so that nothing taken back by a preemption is counted.
            self.policy.on_scheduled(request, num)
            request.num_computed_tokens += num
        self._step_id += 1
        output = SchedulerOutput(
            step_id=self._step_id, new_requests=new_requests, cached_requests=cached_requests,
            num_scheduled_tokens=dict(step.scheduled),
            finished_request_ids=self._finished_since_last_step,
            preempted_request_ids=preempted_ids,
            grammar_bitmask=None if grammars is None else grammars.step_bitmask(step.scheduled, self.requests),
            spec_token_ids={rid: self.requests[rid].drafts.token_ids[:n] for rid, n in step.drafts.items()},
            draft_counts={} if self.speculation is None else self.speculation.draft_counts(step, self.requests))
        self._finished_since_last_step = []
        return output

    def advance_decodes(self, num_steps: int, last_shape: StepShape) -> list[str]:
        """Count ``num_steps`` decode-only steps run in bulk (``sim/decode_run.py``); the ids finished
        since the last step, which the first of them would have told the worker."""
        self._step_id += num_steps
        self.last_shape, self._last_num_tokens = last_shape, len(self.running)
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return finished

    # ---- results -----------------------------------------------------------------------------

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free what finished; returns the step's outputs."""
        outputs = []
        if self.trace is not None:
            self.trace.end_step(self._step_id, self.policy.now())
        logprobs = runner_output.logprobs
        for part in runner_output.prompt_logprobs or ():
            if part.request_id in self.requests:  # not aborted while its step ran
                self.requests[part.request_id].add_prompt_logprobs(part.start, part.entries)
        grammars = self._active_grammars()
        starts = [] if logprobs is None else logprob_starts(runner_output)
        for i, (request_id, token_id) in enumerate(
                zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True)):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            tokens = [token_id] if self.speculation is None else self.speculation.settle(request, runner_output, i)
            for n, token in enumerate(tokens, 1):
                request.append_output_token(token)
                # The grammar's verdict first: a complete constrained output is a stop, even at max_tokens.
                stop = None if grammars is None else grammars.verdict(request, token)
                if stop is None:
                    stop = request.check_stop()
                if stop is not None:
                    self._finish(request, stop)
                    del tokens[n:]
                    break
            outputs.append(EngineCoreOutput(
                request_id,
                tokens,
                new_logprobs=None if logprobs is None else logprobs[starts[i]:starts[i] + len(tokens)],
                prompt_logprobs=request.take_prompt_logprobs(),
                finish_reason=None if stop is None else stop.finish_reason,
                num_cached_tokens=request.num_cached_tokens,
                error=request.error,
            ))
        return outputs
