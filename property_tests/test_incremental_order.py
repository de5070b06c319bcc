"""The orders ``sjf`` and ``priority`` keep as requests come and go (``WaitingQueue``) are, every time
the scheduler asks, a sorted order of exactly the waiting requests by the policy's ranking computed
afresh: through arrivals, admissions, preemptions (the victims come back) and aborts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import Arrival, arrivals, build_scheduler, pool_for, run

from cadence.policies.sjf import ShortestJobFirstPolicy
from cadence.request import RequestStatus, RequestView


def _ranking(policy: Any) -> Callable[[RequestView], tuple[float, float]]:
    if isinstance(policy, ShortestJobFirstPolicy):
        return lambda r: (policy.score(r), r.arrival_time)
    return lambda r: (r.priority, r.arrival_time)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(["sjf", "priority"]), workload=st.lists(arrivals(), min_size=1, max_size=24),
       spare_blocks=st.integers(0, 6), max_num_seqs=st.integers(1, 6), budget=st.integers(4, 64),
       aging=st.sampled_from(["0", "0.5", "3"]), seed=st.integers(0, 2**16))
def test_the_kept_order_is_the_sorted_waiting_queue(policy: str, workload: list[Arrival], spare_blocks: int,
                                                    max_num_seqs: int, budget: int, aging: str, seed: int) -> None:
    options = {"aging": aging} if policy == "sjf" else {}
    scheduler = build_scheduler(policy, options, budget=budget, max_num_seqs=max_num_seqs,
                                num_blocks=pool_for(workload, 2, spare_blocks), block_size=2)
    kept = scheduler.policy
    rank = _ranking(kept)
    order_waiting = kept.order_waiting
    asked = []

    def checked(waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        order = list(order_waiting(waiting))
        # Requests admitted earlier in this step are still queued until the step is final: the
        # scheduler skips them (they are running).
        pending = [r for r in order if r.status != RequestStatus.RUNNING]
        assert sorted(r.request_id for r in pending) == sorted(r.request_id for r in waiting)
        assert [rank(r) for r in pending] == sorted(rank(r) for r in waiting)
        asked.append(len(pending))
        return order

    kept.order_waiting = checked  # type: ignore[method-assign]
    run(scheduler, workload, seed)
    assert asked
