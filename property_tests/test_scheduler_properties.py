"""Scheduler properties over random workloads, with a fake model that samples random tokens.

For every step: the token budget and the seat limit hold, nothing is scheduled past a request's
known tokens, every scheduled token has a KV slot, and the allocator is intact. At the end every
request has finished exactly once and every block is free again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from cadence.config import SchedulerConfig
from cadence.core.kv_allocator import KVAllocator
from cadence.core.scheduler import Scheduler
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.policies.base import PolicyContext
from cadence.policies.fcfs import FCFSPolicy
from cadence.request import Request
from cadence.sampling_params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 96


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    abort_at: int | None


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 4),
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=40),
    max_tokens=st.integers(1, 24),
    abort_at=st.none() | st.integers(0, 30),
)


@settings(max_examples=150, deadline=None)
@given(
    workload=st.lists(arrivals, min_size=1, max_size=24),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 6),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scheduler_keeps_its_limits_and_finishes_everything(
    workload: list[Arrival], block_size: int, spare_blocks: int, max_num_seqs: int, budget: int,
    chunked: bool, prefix_caching: bool, seed: int,
) -> None:
    rng = random.Random(seed)
    longest = max(len(a.prompt) + a.max_tokens for a in workload)
    if not chunked:
        budget = max(budget, longest)
    # Every request must fit an empty pool on its own (the front end rejects the others).
    num_blocks = 1 + -(-longest // block_size) + spare_blocks
    allocator = KVAllocator(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked)
    policy = FCFSPolicy(PolicyContext(budget, max_num_seqs, chunked, 0))
    scheduler = Scheduler(config, allocator, policy)

    finished: dict[str, str] = {}
    on_worker: set[str] = set()
    step = 0
    pending = sorted(enumerate(workload), key=lambda item: item[1].step)
    while pending or scheduler.num_unfinished:
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0)
            scheduler.add_request(Request(str(index), arrival.prompt, params, EOS, float(step), MAX_MODEL_LEN))
        for index, arrival in enumerate(workload):
            if arrival.abort_at == step and str(index) in scheduler.requests:
                for output in scheduler.abort_requests([str(index)]):
                    _record_finish(finished, output.request_id, output.finish_reason)
        out = scheduler.schedule()
        _check_step(scheduler, allocator, out, on_worker, budget, max_num_seqs)
        result = _fake_model(scheduler, out, rng)
        for output in scheduler.update_from_output(result):
            if output.finish_reason is not None:
                _record_finish(finished, output.request_id, output.finish_reason)
        allocator.check_integrity()
        step += 1
        assert step < 5000, "the scheduler stopped making progress"

    event("preempted" if scheduler.num_preemptions else "no preemption")
    assert sorted(finished, key=int) == [str(i) for i in range(len(workload))]
    assert allocator.num_free_blocks == num_blocks - 1
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def _record_finish(finished: dict[str, str], request_id: str, reason: str | None) -> None:
    assert request_id not in finished, f"{request_id} finished twice"
    assert reason is not None
    finished[request_id] = reason


def _check_step(scheduler: Scheduler, allocator: KVAllocator, out: SchedulerOutput, on_worker: set[str],
                budget: int, max_num_seqs: int) -> None:
    assert out.total_num_scheduled_tokens <= budget
    assert len(out.num_scheduled_tokens) <= max_num_seqs
    assert len(scheduler.running) <= max_num_seqs
    on_worker.difference_update(out.finished_request_ids)
    on_worker.difference_update(out.preempted_request_ids)
    for new in out.new_requests:
        assert new.request_id not in on_worker, "a request was sent whole twice"
        on_worker.add(new.request_id)
    for cached in out.cached_requests:
        assert cached.request_id in on_worker, "a delta for a request the worker does not hold"
    for request_id, num in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        assert num >= 1
        # num_computed_tokens was advanced when the step was built.
        assert request.num_computed_tokens <= request.num_tokens
        assert len(allocator.block_ids(request_id)) * allocator.block_size >= request.num_computed_tokens


def _fake_model(scheduler: Scheduler, out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    ids, tokens = [], []
    for request_id in out.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            ids.append(request_id)
            tokens.append(EOS if rng.random() < 0.05 else rng.choice([1, 2, 3]))
    return ModelRunnerOutput(out.step_id, ids, tokens)
