"""Exact, step-by-step tests of the scheduler through its public interface, without a model.

Each test builds ``Scheduler(SchedulerConfig, KVCacheManager, policy)`` directly, adds requests, and
plays the model: after every ``schedule()`` it samples one token for each request whose scheduled
tokens reached its end and feeds it back with ``update_from_output``. Every step also checks the
token budget, the seat limit and the block accounting (each running request holds exactly
``ceil(num_computed_tokens / block_size)`` blocks, waiting ones none, and the free count is the
rest), and the allocator's integrity. The property tests (``property_tests/``) explore random
workloads; these pin the exact values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from cadence.config import SchedulerConfig
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.chunked_prefill import ChunkedPrefillPolicy
from cadence.policies.fcfs import FCFSPolicy
from cadence.policies.loader import load_policy
from cadence.policies.priority import PriorityPolicy
from cadence.request import Request, RequestStatus, RequestView
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

BS = 4  # tokens per block
EOS = 0
TOKEN = 7  # what the fake model samples unless a test says otherwise
MAX_MODEL_LEN = 64


def toks(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start``: requests built from disjoint ranges never share a prefix."""
    return list(range(start, start + n))


# Whole prefills: the default follows the engine's chunked-prefill flag, which is on.
WHOLE = {"chunked": "false"}


def make_scheduler(policy: str | type[SchedulingPolicy] = "fcfs", *, budget: int = 64, seats: int = 8,
                   num_blocks: int = 33, options: dict[str, str] | None = None, engine_chunked: bool = True,
                   threshold: int = 0, caching: bool = True, max_prompts: int = 0) -> Scheduler:
    name = policy if isinstance(policy, str) else policy.name
    config = SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget, enable_chunked_prefill=engine_chunked,
                             long_prefill_token_threshold=threshold, max_prompts_per_step=max_prompts, policy=name,
                             policy_options=options or {})
    context = PolicyContext(budget, seats, engine_chunked, threshold)
    instance = load_policy(policy, context, options) if isinstance(policy, str) else policy(context, options)
    return Scheduler(config, KVCacheManager(num_blocks, BS, caching), instance)


def request(request_id: str, prompt: list[int], max_tokens: int | None = 16, *, priority: int = 0,
            arrival: float = 0.0, max_model_len: int = MAX_MODEL_LEN, **params: Any) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), EOS, arrival,
                   max_model_len, priority=priority)


@dataclass
class Step:
    out: SchedulerOutput
    sampled: list[str]  # requests that got a token from this step, in batch order
    outputs: list[EngineCoreOutput]

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        """``num_scheduled_tokens`` as pairs: its order is the batch order."""
        return list(self.out.num_scheduled_tokens.items())

    def finish_reasons(self) -> dict[str, str | None]:
        return {o.request_id: o.finish_reason for o in self.outputs}


def check_accounting(scheduler: Scheduler, out: SchedulerOutput | None = None) -> None:
    config, allocator = scheduler.config, scheduler.allocator
    if out is not None:
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        assert set(out.num_scheduled_tokens) <= {r.request_id for r in scheduler.running}
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert len(scheduler.running) <= config.max_num_seqs
    held: set[int] = set()
    for r in scheduler.running:
        (ids,) = allocator.block_ids(r.request_id)  # one KV cache group
        assert len(ids) == -(-r.num_computed_tokens // BS), f"{r} holds {len(ids)} blocks"
        held.update(ids)
    for r in scheduler.waiting:
        assert allocator.block_ids(r.request_id) == [[]], f"waiting {r} holds blocks"
        assert r.num_computed_tokens == 0
    assert set(scheduler.requests) == {r.request_id for r in [*scheduler.running, *scheduler.waiting]}
    assert allocator.num_free_blocks == allocator.num_blocks - 1 - len(held)
    allocator.check_integrity()


def step(scheduler: Scheduler, sample: Mapping[str, int] | None = None) -> Step:
    """One engine step with the fake model: ``sample`` overrides the token a request gets."""
    out = scheduler.schedule()
    check_accounting(scheduler, out)
    sampled = [rid for rid in out.num_scheduled_tokens
               if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens]
    tokens = [(sample or {}).get(rid, TOKEN) for rid in sampled]
    outputs = scheduler.update_from_output(ModelRunnerOutput(out.step_id, sampled, tokens))
    assert [o.request_id for o in outputs] == sampled
    check_accounting(scheduler)
    return Step(out, sampled, outputs)


def run_to_end(scheduler: Scheduler, max_steps: int = 200) -> list[Step]:
    steps = []
    while scheduler.num_unfinished:
        steps.append(step(scheduler))
        assert len(steps) < max_steps, "no progress"
    assert scheduler.allocator.num_free_blocks == scheduler.allocator.num_blocks - 1
    return steps


def ids(requests: Sequence[RequestView]) -> list[str]:
    return [r.request_id for r in requests]


# ---- token budget ----------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_into_what_the_decodes_leave() -> None:
    scheduler = make_scheduler("chunked-prefill", budget=8)
    assert isinstance(scheduler.policy, ChunkedPrefillPolicy) and scheduler.policy.chunked
    scheduler.add_request(request("x", toks(1, 2), max_tokens=4))
    scheduler.add_request(request("y", toks(100, 20), max_tokens=3))
    steps = run_to_end(scheduler)
    assert [s.scheduled for s in steps] == [
        [("x", 2), ("y", 6)],  # x's whole prompt, y the rest of the budget
        [("x", 1), ("y", 7)],  # x decodes, y's chunk takes the other 7
        [("x", 1), ("y", 7)],  # y's prompt is done: 6 + 7 + 7 = 20
        [("x", 1), ("y", 1)],
        [("y", 1)],
    ]
    assert [s.sampled for s in steps] == [["x"], ["x"], ["x", "y"], ["x", "y"], ["y"]]
    assert steps[3].finish_reasons() == {"x": "length", "y": None}


def test_chunked_prefill_serves_running_decodes_before_an_earlier_admitted_prefill() -> None:
    # y was admitted first, but once x decodes it draws on the budget before y's next chunk.
    scheduler = make_scheduler("chunked-prefill", budget=8, threshold=6)
    scheduler.add_request(request("y", toks(100, 30), max_tokens=2))
    scheduler.add_request(request("x", toks(1, 2), max_tokens=3))
    steps = run_to_end(scheduler)
    assert [s.scheduled for s in steps] == [
        [("y", 6), ("x", 2)],  # y capped by the threshold, x fills 2 of the remaining 2
        [("x", 1), ("y", 6)],
        [("x", 1), ("y", 6)],
        [("y", 6)],
        [("y", 6)],  # 5 chunks of 6: y's prompt is done and it samples
        [("y", 1)],
    ]
    assert steps[2].finish_reasons() == {"x": "length"}
    assert steps[5].finish_reasons() == {"y": "length"}


def test_whole_prefill_that_does_not_fit_waits_and_blocks_those_behind_it() -> None:
    scheduler = make_scheduler("fcfs", budget=10, options=WHOLE)
    scheduler.add_request(request("a", toks(100, 8), max_tokens=3))
    scheduler.add_request(request("b", toks(200, 5)))
    scheduler.add_request(request("c", toks(300, 1)))  # would fit the 2 left, but b is ahead
    first = step(scheduler)
    assert first.scheduled == [("a", 8)]
    assert ids(scheduler.waiting) == ["b", "c"]
    assert scheduler.allocator.num_free_blocks == 32 - 2
    second = step(scheduler)
    assert second.scheduled == [("a", 1), ("b", 5), ("c", 1)]
    assert scheduler.allocator.num_free_blocks == 32 - 3 - 2 - 1


def test_max_prompts_per_step_admits_a_burst_a_few_prompts_a_step_beside_their_decodes() -> None:
    """Five short prompts that fit one step's budget: with a cap of two, they start two a step and the
    first two decode beside the next ones' prefills; the cap counts admissions, not running requests."""
    def burst(max_prompts: int) -> Scheduler:
        scheduler = make_scheduler("fcfs", budget=64, max_prompts=max_prompts)
        for i, name in enumerate("abcde"):
            scheduler.add_request(request(name, toks(100 * (i + 1), 5), max_tokens=4))
        return scheduler

    steps = run_to_end(burst(2))
    assert [s.scheduled for s in steps[:3]] == [
        [("a", 5), ("b", 5)],
        [("a", 1), ("b", 1), ("c", 5), ("d", 5)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 5)],
    ]
    assert step(burst(0)).scheduled == [(name, 5) for name in "abcde"]


def test_a_negative_prompt_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_prompts_per_step"):
        SchedulerConfig(max_prompts_per_step=-1)


def flood(options: dict[str, str] | None, num_steps: int = 40) -> list[int]:
    """Running requests after each step, with 200 prompts of 508 tokens waiting under a
    512-token budget and room for all of them in the KV cache."""
    scheduler = make_scheduler("fcfs", budget=512, seats=128, num_blocks=1 + 200 * 128, options=options)
    for i in range(200):
        scheduler.add_request(request(f"r{i}", toks(1_000 * i, 508), max_tokens=1_000, max_model_len=2_048))
    running = []
    for _ in range(num_steps):
        step(scheduler)
        running.append(len(scheduler.running))
    return running


def test_a_flood_of_long_prompts_keeps_being_admitted_by_default() -> None:
    """The default (chunked prefill, as the engine's flag says) admits a new prompt every step while
    decodes run; whole prefills stop at 5 running: 508 + 5 decodes no longer fit 512, and the whole
    queue waits behind its head until a decode finishes (a server held at 4 running this way)."""
    # A step whose budget a prefill's last chunk used up exactly admits nobody new (9, 37).
    assert flood(None) == [*range(2, 10), *range(9, 38), 37, 38, 39]
    assert flood(WHOLE) == [1, 2, 3, 4, 5] + [5] * 35


def test_whole_prefill_splits_only_a_prompt_longer_than_the_entire_budget() -> None:
    scheduler = make_scheduler("fcfs", budget=10, options=WHOLE)
    scheduler.add_request(request("d", toks(100, 25), max_tokens=2))
    scheduler.add_request(request("e", toks(200, 3), max_tokens=2))
    steps = run_to_end(scheduler)
    assert [s.scheduled for s in steps] == [
        [("d", 10)],
        [("d", 10)],  # e (3 tokens) waits: nothing is left of the budget
        [("d", 5), ("e", 3)],
        [("d", 1), ("e", 1)],
    ]


def test_without_engine_chunking_a_prompt_longer_than_the_budget_is_never_scheduled() -> None:
    # The front end rejects such prompts; the scheduler itself leaves the request waiting.
    scheduler = make_scheduler("fcfs", budget=10, engine_chunked=False)
    scheduler.add_request(request("d", toks(100, 11)))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    assert ids(scheduler.waiting) == ["d"] and scheduler.running == []
    check_accounting(scheduler)


# ---- seats -----------------------------------------------------------------------------------


def test_seat_limit_admits_the_next_waiting_request_when_one_finishes() -> None:
    scheduler = make_scheduler("fcfs", seats=2)
    scheduler.add_request(request("a", toks(100, 4), max_tokens=2))
    scheduler.add_request(request("b", toks(200, 4), max_tokens=5))
    scheduler.add_request(request("c", toks(300, 4), max_tokens=3))
    first = step(scheduler)
    assert first.scheduled == [("a", 4), ("b", 4)]
    assert ids(scheduler.running) == ["a", "b"] and ids(scheduler.waiting) == ["c"]
    second = step(scheduler)
    assert second.scheduled == [("a", 1), ("b", 1)]
    assert second.finish_reasons() == {"a": "length", "b": None}
    third = step(scheduler)
    assert third.scheduled == [("b", 1), ("c", 4)]
    assert third.out.finished_request_ids == ["a"]
    assert ids(scheduler.running) == ["b", "c"]
    rest = run_to_end(scheduler)
    assert [s.scheduled for s in rest] == [[("b", 1), ("c", 1)], [("b", 1), ("c", 1)]]


# ---- blocks ----------------------------------------------------------------------------------


def test_blocks_follow_the_computed_tokens_and_come_back_on_finish() -> None:
    scheduler = make_scheduler("chunked-prefill", budget=5)
    scheduler.add_request(request("a", toks(100, 9), max_tokens=4))
    free = []
    for _ in range(5):
        step(scheduler)
        free.append(scheduler.allocator.num_free_blocks)
    # computed 5, 9, 10, 11, then the 4th token finishes the request
    assert free == [32 - 2, 32 - 3, 32 - 3, 32 - 3, 32]
    assert scheduler.requests == {}


def test_abort_of_waiting_and_running_requests() -> None:
    scheduler = make_scheduler("fcfs", budget=8, options=WHOLE)
    scheduler.add_request(request("a", toks(100, 6)))
    scheduler.add_request(request("b", toks(200, 6)))  # does not fit the 2 left: waits
    assert step(scheduler).scheduled == [("a", 6)]
    assert scheduler.allocator.num_free_blocks == 30
    outputs = scheduler.finish_requests(["b", "unknown", "a"], RequestStatus.FINISHED_ABORTED)
    assert outputs == [EngineCoreOutput("b", [], finish_reason="abort"),
                       EngineCoreOutput("a", [], finish_reason="abort")]
    assert scheduler.requests == {} and scheduler.running == [] and not scheduler.waiting
    assert scheduler.allocator.num_free_blocks == 32
    check_accounting(scheduler)
    assert scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # already finished
    # Only a request the worker holds is reported as finished, and only once.
    assert scheduler.has_work
    out = scheduler.schedule()
    assert out.finished_request_ids == ["a"] and out.num_scheduled_tokens == {}
    assert not scheduler.has_work
    assert scheduler.schedule().finished_request_ids == []


def test_tokens_of_a_request_aborted_while_its_step_ran_are_dropped() -> None:
    scheduler = make_scheduler("fcfs")
    scheduler.add_request(request("a", toks(100, 3)))
    scheduler.add_request(request("b", toks(200, 3)))
    out = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(ModelRunnerOutput(out.step_id, ["a", "b"], [5, 6]))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [6])]
    check_accounting(scheduler)


# ---- preemption ------------------------------------------------------------------------------


def test_blocks_running_out_preempts_the_most_recently_admitted_to_the_front_of_the_queue() -> None:
    scheduler = make_scheduler("fcfs", num_blocks=1 + 3)
    scheduler.add_request(request("a", toks(100, 8), max_tokens=3))
    scheduler.add_request(request("b", toks(200, 4), max_tokens=5))
    first = step(scheduler)
    assert first.scheduled == [("a", 8), ("b", 4)]
    assert scheduler.allocator.block_ids("a") == [[1, 2]] and scheduler.allocator.block_ids("b") == [[3]]
    assert scheduler.allocator.num_free_blocks == 0

    b = scheduler.requests["b"]
    scheduler.add_request(request("c", toks(300, 2), max_tokens=2))
    # a's 9th token needs a third block: b (admitted last) gives its block up.
    second = step(scheduler)
    assert second.scheduled == [("a", 1)]
    assert second.out.preempted_request_ids == ["b"]
    assert second.out.cached_requests == [CachedRequestData("a", [[3]], 8)]
    assert second.out.new_requests == []
    assert ids(scheduler.waiting) == ["b", "c"]  # back in front; nobody admitted in this step
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.output_token_ids == [TOKEN]
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1

    # b cannot come back while a holds every block; the preemption is reported once.
    third = step(scheduler)
    assert third.scheduled == [("a", 1)]
    assert third.out.preempted_request_ids == []
    assert third.finish_reasons() == {"a": "length"}

    # a's blocks were freed last first (3, 2, 1): b takes 3 and 2, c takes 1. b is sent whole again.
    fourth = step(scheduler)
    assert fourth.out.finished_request_ids == ["a"]
    assert fourth.scheduled == [("b", 5), ("c", 2)]
    assert fourth.out.new_requests[0] == NewRequestData(
        request_id="b", token_ids=[*toks(200, 4), TOKEN], num_prompt_tokens=4, sampling_params=b.sampling_params,
        eos_token_id=EOS, block_ids=[[3, 2]], num_computed_tokens=0)
    assert [n.request_id for n in fourth.out.new_requests] == ["b", "c"]
    assert scheduler.allocator.block_ids("c") == [[1]]
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1
    run_to_end(scheduler)


class NewestFirstPolicy(FCFSPolicy):
    """Admits the most recent arrival first: puts a request that could be admitted ahead of the victim."""

    name = "newest-first"

    def order_waiting(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        return list(reversed(waiting))


def test_a_step_that_preempted_for_a_running_request_admits_nobody_new() -> None:
    scheduler = make_scheduler(NewestFirstPolicy, num_blocks=1 + 4)
    scheduler.add_request(request("b", toks(200, 5), max_tokens=4))
    scheduler.add_request(request("a", toks(100, 8), max_tokens=4))  # admitted first: the newest
    assert step(scheduler).scheduled == [("a", 8), ("b", 5)]
    assert scheduler.allocator.num_free_blocks == 0
    scheduler.add_request(request("c", toks(300, 2)))
    second = step(scheduler)
    # b's two blocks came back and a took one: c (first in the policy's order) would fit, but waits.
    assert second.scheduled == [("a", 1)]
    assert second.out.preempted_request_ids == ["b"]
    assert scheduler.allocator.num_free_blocks == 1
    assert ids(scheduler.waiting) == ["b", "c"]
    third = step(scheduler)
    assert third.scheduled == [("a", 1), ("c", 2)]
    assert ids(scheduler.waiting) == ["b"]


def test_priority_preempts_a_lower_priority_running_request_for_a_higher_waiting_one() -> None:
    scheduler = make_scheduler("priority", seats=1, options=WHOLE)
    assert isinstance(scheduler.policy, PriorityPolicy) and not scheduler.policy.chunked
    scheduler.add_request(request("low", toks(100, 4), max_tokens=8, priority=5))
    assert step(scheduler).scheduled == [("low", 4)]
    low = scheduler.requests["low"]
    scheduler.add_request(request("high", toks(200, 3), max_tokens=2, priority=0, arrival=1.0))
    second = step(scheduler)
    # low's decode token goes back to the budget with its seat and blocks.
    assert second.scheduled == [("high", 3)]
    assert second.out.preempted_request_ids == ["low"]
    assert second.out.cached_requests == []
    assert ids(scheduler.waiting) == ["low"]
    assert low.num_computed_tokens == 0 and low.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.allocator.num_free_blocks == 31
    third = step(scheduler)  # low does not outrank high: no preemption the other way
    assert third.scheduled == [("high", 1)]
    assert third.finish_reasons() == {"high": "length"}
    fourth = step(scheduler)
    assert fourth.out.finished_request_ids == ["high"]
    # low comes back with its first block still in the prefix cache: only its output token is computed.
    assert fourth.scheduled == [("low", 1)]
    assert fourth.out.new_requests[0].token_ids == [*toks(100, 4), TOKEN]
    assert fourth.out.new_requests[0].num_computed_tokens == 4
    assert fourth.out.new_requests[0].block_ids == [[1, 4]]
    # Usage's cached tokens are the prompt's hit at the first admission (none), not the resumption's
    # own blocks (which would count more cached tokens than the prompt has once it has output).
    assert low.num_cached_tokens == 0 and [o.num_cached_tokens for o in fourth.outputs] == [0]
    assert scheduler.num_preemptions == 1


def test_priority_does_not_preempt_for_an_equal_priority_arrival() -> None:
    scheduler = make_scheduler("priority", seats=1)
    scheduler.add_request(request("first", toks(100, 4), max_tokens=2, priority=3))
    step(scheduler)
    scheduler.add_request(request("second", toks(200, 4), max_tokens=2, priority=3, arrival=1.0))
    assert step(scheduler).scheduled == [("first", 1)]
    assert scheduler.num_preemptions == 0
    assert step(scheduler).scheduled == [("second", 4)]


# ---- prefix cache ----------------------------------------------------------------------------


class SpyPolicy(FCFSPolicy):
    """FCFS that records what ``num_tokens`` is asked."""

    name = "spy"

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        super().__init__(context, options)
        self.calls: list[tuple[str, int, int, int, int]] = []

    def num_tokens(self, request: RequestView, token_budget: int, num_cached_tokens: int = 0) -> int:
        num = super().num_tokens(request, token_budget, num_cached_tokens)
        self.calls.append((request.request_id, request.num_computed_tokens, num_cached_tokens, token_budget, num))
        return num


@pytest.mark.parametrize("caching", [True, False])
def test_a_prefix_hit_reaches_the_policy_and_only_the_remainder_is_scheduled(caching: bool) -> None:
    scheduler = make_scheduler(SpyPolicy, budget=12, caching=caching, options=WHOLE)
    policy = scheduler.policy
    assert isinstance(policy, SpyPolicy)
    scheduler.add_request(request("a", toks(1, 10), max_tokens=4))
    assert step(scheduler).scheduled == [("a", 10)]
    # The same two full blocks, then 4 tokens of its own: 12 tokens, more than the 11 a's decode leaves.
    scheduler.add_request(request("b", [*toks(1, 8), *toks(100, 4)], max_tokens=4))
    policy.calls.clear()
    second = step(scheduler)
    b = scheduler.requests["b"]
    if not caching:  # a whole prefill of 12 does not fit 11: b waits
        assert second.scheduled == [("a", 1)]
        assert policy.calls == [("a", 10, 0, 12, 1), ("b", 0, 0, 11, 0)]
        return
    assert policy.calls == [("a", 10, 0, 12, 1), ("b", 0, 8, 11, 4)]
    assert second.scheduled == [("a", 1), ("b", 4)]
    assert second.out.new_requests == [NewRequestData(
        request_id="b", token_ids=b.prompt_token_ids, num_prompt_tokens=12, sampling_params=b.sampling_params,
        eos_token_id=EOS, block_ids=[[1, 2, 4]], num_computed_tokens=8)]
    assert b.num_cached_tokens == 2 * BS
    assert [(o.request_id, o.num_cached_tokens) for o in second.outputs] == [("a", 0), ("b", 8)]
    assert scheduler.allocator.num_free_blocks == 32 - 4  # blocks 1 and 2 are shared
    assert scheduler.allocator.prefix_cache_queries == 10 + 12
    assert scheduler.allocator.prefix_cache_hits == 8


# ---- what the worker is told -----------------------------------------------------------------


def test_new_requests_are_sent_whole_once_then_as_deltas_and_finishes_are_reported_once() -> None:
    scheduler = make_scheduler("chunked-prefill", budget=4)
    a = request("a", toks(1, 10), max_tokens=2)
    scheduler.add_request(a)
    outs = [step(scheduler).out for _ in range(4)]
    assert outs[0].new_requests == [NewRequestData(
        request_id="a", token_ids=toks(1, 10), num_prompt_tokens=10, sampling_params=a.sampling_params,
        eos_token_id=EOS, block_ids=[[1]], num_computed_tokens=0)]
    assert [o.new_requests for o in outs[1:]] == [[], [], []]
    assert [o.cached_requests for o in outs] == [
        [],
        [CachedRequestData("a", [[2]], 4)],
        [CachedRequestData("a", [[3]], 8)],
        [CachedRequestData("a", [[]], 10)],
    ]
    assert [o.num_scheduled_tokens for o in outs] == [{"a": 4}, {"a": 4}, {"a": 2}, {"a": 1}]
    assert [o.step_id for o in outs] == [1, 2, 3, 4]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [TOKEN, TOKEN]
    assert all(o.finished_request_ids == [] and o.preempted_request_ids == [] for o in outs)
    assert scheduler.has_work  # the worker must still be told
    fifth = scheduler.schedule()
    assert (fifth.step_id, fifth.finished_request_ids, fifth.num_scheduled_tokens) == (5, ["a"], {})
    assert not scheduler.has_work
    assert scheduler.schedule().finished_request_ids == []


# ---- stop conditions -------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "sampled", "reasons"), [
    pytest.param({"max_tokens": 3}, [5, 6, 8], [None, None, "length"], id="max_tokens"),
    pytest.param({}, [5, EOS], [None, "stop"], id="eos"),
    pytest.param({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], [None, None, "length"], id="ignore_eos"),
    pytest.param({"stop_token_ids": [9]}, [5, 9], [None, "stop"], id="stop_token_ids"),
    pytest.param({"stop_token_ids": [9], "ignore_eos": True}, [EOS, 9], [None, "stop"], id="stop_ids_ignore_eos"),
    pytest.param({"min_tokens": 2}, [EOS, EOS, EOS], [None, None, "stop"], id="min_tokens_masks_eos"),
    pytest.param({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 9], [None, None, "stop"], id="min_tokens_masks_ids"),
    pytest.param({"max_tokens": 2}, [5, EOS], [None, "length"], id="length_before_eos"),
    pytest.param({"max_tokens": None, "max_model_len": 6}, [5, 6], [None, "length"], id="model_length"),
    pytest.param({"max_tokens": 10, "max_model_len": 6}, [5, 6], [None, "length"], id="model_length_caps"),
])
def test_stop_conditions(params: dict[str, Any], sampled: list[int], reasons: list[str | None]) -> None:
    scheduler = make_scheduler("fcfs")
    params = {"max_tokens": 16, **params}
    r = request("r", toks(100, 4), **params)
    scheduler.add_request(r)
    got = []
    for token in sampled:
        s = step(scheduler, {"r": token})
        assert [(o.request_id, o.new_token_ids) for o in s.outputs] == [("r", [token])]
        got.append(s.outputs[0].finish_reason)
    assert got == reasons
    assert r.output_token_ids == sampled  # the stopping token is part of the output
    assert "r" not in scheduler.requests and r.is_finished
    assert scheduler.allocator.num_free_blocks == 32


# ---- requests the scheduler refuses ----------------------------------------------------------


def test_a_duplicate_request_id_is_refused() -> None:
    scheduler = make_scheduler("fcfs")
    scheduler.add_request(request("a", toks(1, 3)))
    with pytest.raises(ValueError, match="'a' is already in the engine"):
        scheduler.add_request(request("a", toks(1, 3)))
    assert ids(scheduler.waiting) == ["a"]


def test_a_constrained_request_needs_a_structured_output_manager() -> None:
    scheduler = make_scheduler("fcfs")
    constrained = request("a", toks(1, 3), structured_outputs=StructuredOutputsParams(choice=["x"]))
    with pytest.raises(ValueError, match="no structured-output manager"):
        scheduler.add_request(constrained)
    assert scheduler.requests == {}


# ---- LoRA adapters ---------------------------------------------------------------------------


def test_a_request_whose_adapter_would_exceed_max_loras_waits_and_those_behind_it_go_first() -> None:
    from dataclasses import replace

    from cadence.lora_request import LoRARequest

    scheduler = make_scheduler(budget=64)
    scheduler.config = replace(scheduler.config, max_loras=2)
    adapters = {name: LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1)}
    for rid, start, adapter in (("a1", 1, "a"), ("b1", 100, "b"), ("c1", 200, "c"), ("base", 300, None),
                                ("a2", 400, "a")):
        req = request(rid, toks(start, 3), max_tokens=2)
        req.lora_request = None if adapter is None else adapters[adapter]
        scheduler.add_request(req)
    first = step(scheduler)
    # c1 would be a third adapter: passed over, not blocking the base request or a2 (adapter a runs)
    assert [rid for rid, _ in first.scheduled] == ["a1", "b1", "base", "a2"]
    assert [r.lora_name for r in scheduler.running] == ["a", "b", None, "a"]
    step(scheduler)  # every one of them finishes its 2 tokens
    assert [rid for rid, _ in step(scheduler).scheduled] == ["c1"]
    assert scheduler.requests["c1"].lora_name == "c"
