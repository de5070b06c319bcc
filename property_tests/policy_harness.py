"""Drives a real ``Scheduler`` with a fake model over a stream of arrivals, checking the limits.

Every step: the token budget and the seat limit hold, no step idles while work waits, no request is
sent whole twice or updated while the worker does not hold it, every scheduled token has a KV slot,
and the allocator is intact.
At the end every request has finished exactly once and every block is free again. The returned
:class:`Trace` lets a test check a policy's own promise step by step.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from cadence.config import SchedulerConfig
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.scheduling_trace import SchedulingTrace
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.clock import VirtualClock
from cadence.policies.loader import load_policy
from cadence.request import Request, RequestStatus
from cadence.sampling_params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 96
MAX_STEPS = 5000


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    user: str | None = None
    abort_at: int | None = None


def arrivals(users: Sequence[str | None] = (None,)) -> st.SearchStrategy[Arrival]:
    """Random arrivals in the first steps, some aborted later, as every policy test draws them."""
    return st.builds(
        Arrival,
        step=st.integers(0, 6),
        prompt=st.lists(st.integers(1, 3), min_size=1, max_size=40),
        max_tokens=st.integers(1, 24),
        priority=st.integers(0, 3),
        user=st.sampled_from(list(users)),
        abort_at=st.none() | st.none() | st.integers(0, 30),
    )


@dataclass
class StepRecord:
    output: SchedulerOutput
    waiting_before: list[str]  # queue order
    waiting_after: list[str]
    running_after: list[str]
    budget_left: int
    sampled: list[str]  # requests that got a new token from this step
    blocked: str | None = None  # why admission stopped (the scheduling trace's reason), if it did


@dataclass
class Trace:
    """What happened, step by step."""

    scheduler: Scheduler
    policy: SchedulingPolicy
    requests: dict[str, Request]  # every request ever added, by id
    arrived_at_step: dict[str, int]
    steps: list[StepRecord] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)  # id -> finish reason

    def first_admitted(self, request_id: str) -> int:
        return next(i for i, r in enumerate(self.steps) if any(n.request_id == request_id
                                                               for n in r.output.new_requests))

    def sampled_steps(self, request_id: str) -> list[int]:
        return [i for i, r in enumerate(self.steps) if request_id in r.sampled]


def build_scheduler(policy: str, options: dict[str, str] | None = None, *, budget: int, max_num_seqs: int,
                    num_blocks: int, block_size: int, prefix_caching: bool = True,
                    engine_chunked: bool = True, long_prefill_token_threshold: int = 0,
                    target_itl_ms: float = 0.0, max_prompts_per_step: int = 0) -> Scheduler:
    allocator = KVCacheManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=engine_chunked,
                             long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
                             policy_options=options or {}, target_itl_ms=target_itl_ms,
                             max_prompts_per_step=max_prompts_per_step)
    # Arrivals are stamped with their step number, and the clock reads it too. Every run writes its
    # scheduling trace, which :func:`run` checks against the steps and reads the reasons from.
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    return Scheduler(config, allocator, load_policy(policy, PolicyContext.of(config, VirtualClock()), options),
                     trace=SchedulingTrace(path))


def run(scheduler: Scheduler, workload: list[Arrival], seed: int = 0, eos_rate: float = 0.05) -> Trace:
    rng = random.Random(seed)
    allocator = scheduler.allocator
    budget = scheduler.config.max_num_batched_tokens
    trace = Trace(scheduler, scheduler.policy, {}, {})
    on_worker: set[str] = set()
    pending = sorted(enumerate(workload), key=lambda item: item[1].step)
    step = 0
    clock = scheduler.policy.context.clock
    assert isinstance(clock, VirtualClock)
    while pending or scheduler.num_unfinished:
        clock.time = float(step)
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0)
            request = Request(str(index), arrival.prompt, params, EOS, float(arrival.step), MAX_MODEL_LEN,
                              priority=arrival.priority, user=arrival.user)
            trace.requests[request.request_id] = request
            trace.arrived_at_step[request.request_id] = step
            scheduler.add_request(request)
        for index, arrival in enumerate(workload):
            if arrival.abort_at == step and str(index) in scheduler.requests:
                for output in scheduler.finish_requests([str(index)], RequestStatus.FINISHED_ABORTED):
                    _record_finish(trace, output.request_id, output.finish_reason)
        waiting_before = [r.request_id for r in scheduler.waiting]
        out = scheduler.schedule()
        _check_step(scheduler, out, on_worker, budget)
        if scheduler.config.max_prompts_per_step:  # waiting requests admitted, resumed ones included
            admitted = [r for r in waiting_before if r in out.num_scheduled_tokens]
            assert len(admitted) <= scheduler.config.max_prompts_per_step, f"admitted {admitted}"
        model_output = _fake_model(scheduler, out, rng, eos_rate)
        trace.steps.append(StepRecord(
            output=out,
            waiting_before=waiting_before,
            waiting_after=[r.request_id for r in scheduler.waiting],
            running_after=[r.request_id for r in scheduler.running],
            budget_left=budget - out.total_num_scheduled_tokens,
            sampled=list(model_output.request_ids),
        ))
        for output in scheduler.update_from_output(model_output):
            if output.finish_reason is not None:
                _record_finish(trace, output.request_id, output.finish_reason)
        allocator.check_integrity()
        step += 1
        assert step < MAX_STEPS, "the scheduler stopped making progress"

    assert sorted(trace.finished, key=int) == [str(i) for i in range(len(workload))], "a request was lost"
    assert allocator.num_free_blocks == allocator.num_blocks - 1
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    _read_scheduling_trace(scheduler, trace)
    return trace


def _read_scheduling_trace(scheduler: Scheduler, trace: Trace) -> None:
    """The trace holds every step's scheduled tokens exactly and every request's finish once; each
    step learns why its admission stopped."""
    assert scheduler.trace is not None
    scheduler.trace.close()
    path = scheduler.trace.path
    events = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    scheduled: dict[int, dict[str, int]] = {}
    blocked: dict[int, str] = {}
    for e in events:
        if e["event"] == "scheduled":
            scheduled.setdefault(e["step"], {})[e["request"]] = e["tokens"]
        elif e["event"] == "blocked":
            blocked[e["step"]] = e["reason"]
    for record in trace.steps:
        step = record.output.step_id
        assert scheduled.get(step, {}) == record.output.num_scheduled_tokens, f"step {step}: the trace disagrees"
        record.blocked = blocked.get(step)
    finished = [e["request"] for e in events if e["event"] == "finished"]
    assert sorted(finished) == sorted(trace.finished), "the trace has not every finish exactly once"


def pool_for(workload: list[Arrival], block_size: int, spare_blocks: int) -> int:
    """Blocks for the longest request alone plus ``spare_blocks`` (the front end rejects longer ones)."""
    longest = max(len(a.prompt) + a.max_tokens for a in workload)
    return 1 + -(-longest // block_size) + spare_blocks


def _record_finish(trace: Trace, request_id: str, reason: str | None) -> None:
    assert request_id not in trace.finished, f"{request_id} finished twice"
    assert reason is not None
    trace.finished[request_id] = reason


def _check_step(scheduler: Scheduler, out: SchedulerOutput, on_worker: set[str], budget: int) -> None:
    max_num_seqs = scheduler.config.max_num_seqs
    assert out.total_num_scheduled_tokens <= budget
    # The engine core treats an idle step with work waiting as a bug (nothing would ever change).
    assert out.num_scheduled_tokens or scheduler.running or not scheduler.waiting, "an idle step"
    assert len(out.num_scheduled_tokens) <= max_num_seqs
    assert len(scheduler.running) <= max_num_seqs
    assert set(out.num_scheduled_tokens) <= {r.request_id for r in scheduler.running}
    waiting_ids = [r.request_id for r in scheduler.waiting]
    running_ids = [r.request_id for r in scheduler.running]
    assert len(set(waiting_ids)) == len(waiting_ids) and len(set(running_ids)) == len(running_ids)
    assert not set(waiting_ids) & set(running_ids), "a request is both waiting and running"
    assert set(waiting_ids) | set(running_ids) == set(scheduler.requests)
    on_worker.difference_update(out.finished_request_ids)
    on_worker.difference_update(out.preempted_request_ids)
    for new in out.new_requests:
        assert new.request_id not in on_worker, "a request was sent whole twice"
        on_worker.add(new.request_id)
    for cached in out.cached_requests:
        assert cached.request_id in on_worker, "a delta for a request the worker does not hold"
    allocator = scheduler.allocator
    for request_id, num in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        assert num >= 1
        # num_computed_tokens was advanced when the step was built.
        assert request.num_computed_tokens <= request.num_tokens
        assert len(allocator.block_ids(request_id)[0]) * allocator.block_size >= request.num_computed_tokens


def _fake_model(scheduler: Scheduler, out: SchedulerOutput, rng: random.Random,
                eos_rate: float) -> ModelRunnerOutput:
    ids, tokens = [], []
    for request_id in out.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            ids.append(request_id)
            tokens.append(EOS if rng.random() < eos_rate else rng.choice([1, 2, 3]))
    return ModelRunnerOutput(out.step_id, ids, tokens)
