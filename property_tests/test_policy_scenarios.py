"""Hand-built situations, one per policy promise, with the fake model (no EOS: lengths are exact)."""

from __future__ import annotations

import pytest
from policy_harness import Arrival, build_scheduler, run
from test_policy_properties import check_fair_bound


def test_whole_prefills_block_the_line() -> None:
    # 10 tokens a step: a (8) runs; b (5) does not fit the 2 left, and c (1) may not jump it.
    workload = [Arrival(0, [1] * 8, 2), Arrival(0, [2] * 5, 2), Arrival(0, [3], 2)]
    scheduler = build_scheduler("fcfs", {"chunked": "false"}, budget=10, max_num_seqs=8, num_blocks=64, block_size=4)
    trace = run(scheduler, workload, eos_rate=0)
    assert trace.steps[0].output.num_scheduled_tokens == {"0": 8}
    assert trace.steps[1].output.num_scheduled_tokens == {"0": 1, "1": 5, "2": 1}


def test_fcfs_chunked_option_fills_the_budget() -> None:
    workload = [Arrival(0, [1] * 8, 2), Arrival(0, [2] * 5, 2), Arrival(0, [3], 2)]
    scheduler = build_scheduler("fcfs", {"chunked": "true"}, budget=10, max_num_seqs=8, num_blocks=64, block_size=4)
    trace = run(scheduler, workload, eos_rate=0)
    assert trace.steps[0].output.num_scheduled_tokens == {"0": 8, "1": 2}


def test_whole_prefills_still_split_a_prompt_longer_than_the_step() -> None:
    trace = run(build_scheduler("fcfs", budget=16, max_num_seqs=4, num_blocks=64, block_size=4),
                [Arrival(0, [1] * 40, 3)], eos_rate=0)
    assert [r.output.num_scheduled_tokens["0"] for r in trace.steps[:4]] == [16, 16, 8, 1]


def test_the_rest_of_a_split_prompt_takes_what_the_decodes_leave() -> None:
    # Twelve decoding requests leave 4 tokens a step; the 40-token prompt must not wait for them to end.
    workload = [Arrival(0, [2, 3], 40) for _ in range(12)] + [Arrival(1, [1] * 40, 2)]
    trace = run(build_scheduler("fcfs", budget=16, max_num_seqs=16, num_blocks=256, block_size=4), workload,
                eos_rate=0)
    assert trace.first_admitted("12") == 2
    assert trace.sampled_steps("12")[0] == 11  # 4 tokens a step: 2 + 36 / 4
    assert max(trace.sampled_steps("0")) == 39


def test_chunked_prefill_serves_decodes_every_step_while_a_long_prompt_fills() -> None:
    # The long prompt arrives first; the short request must still get a token every step.
    workload = [Arrival(0, [1] * 80, 2), Arrival(0, [2] * 4, 12)]
    chunked = run(build_scheduler("chunked-prefill", budget=16, max_num_seqs=4, num_blocks=64, block_size=4,
                                  long_prefill_token_threshold=8), workload, eos_rate=0)
    start = chunked.first_admitted("1")
    assert start == 0
    assert chunked.sampled_steps("1") == list(range(12))  # one token a step from the first
    assert chunked.first_admitted("0") == 0 and len(chunked.sampled_steps("0")) == 2
    # Whole prefills: the 80-token prompt takes the whole step until it is done; the short one waits.
    fcfs = run(build_scheduler("fcfs", budget=16, max_num_seqs=4, num_blocks=64, block_size=4), workload, eos_rate=0)
    assert fcfs.first_admitted("1") == 5


def _priority_workload(late_low: bool = True) -> list[Arrival]:
    low = [Arrival(0, [1, 2, 3, 4], 30, priority=5) for _ in range(2)]
    high = [Arrival(3, [3, 2, 1], 4, priority=0)]
    later = [Arrival(4, [2, 2, 2], 4, priority=5)] if late_low else []
    return low + high + later


@pytest.mark.parametrize("chunked", ["false", "true"])
def test_priority_preempts_the_lowest_for_a_higher_arrival_when_seats_run_out(chunked: str) -> None:
    # Two seats held by priority-5 requests; a priority-0 request arrives at step 3 (vLLM #40004).
    scheduler = build_scheduler("priority", {"chunked": chunked}, budget=64, max_num_seqs=2, num_blocks=64,
                                block_size=4)
    trace = run(scheduler, _priority_workload(), eos_rate=0)
    assert trace.first_admitted("2") == 3
    assert trace.steps[3].output.preempted_request_ids == ["1"]  # the later of two equals
    # The preempted request keeps its place: back before "3", which arrived after it with its priority.
    assert trace.first_admitted("3") > trace.steps.index(next(
        r for r in trace.steps[4:] if any(n.request_id == "1" for n in r.output.new_requests)))
    assert scheduler.num_preemptions == 1


def test_priority_preempts_for_a_higher_arrival_when_kv_blocks_run_out() -> None:
    # Plenty of seats, 9 blocks of 4 tokens: the two low requests grow until nothing is left.
    scheduler = build_scheduler("priority", budget=64, max_num_seqs=8, num_blocks=1 + 9, block_size=4)
    trace = run(scheduler, [Arrival(0, [1] * 14, 6, priority=5), Arrival(0, [2] * 14, 6, priority=5),
                            Arrival(3, [3] * 9, 3, priority=1)], eos_rate=0)
    assert trace.first_admitted("2") == 3
    assert "1" in trace.steps[3].output.preempted_request_ids


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    scheduler = build_scheduler("fcfs", budget=64, max_num_seqs=2, num_blocks=64, block_size=4)
    trace = run(scheduler, _priority_workload(late_low=False), eos_rate=0)
    assert scheduler.num_preemptions == 0 and trace.first_admitted("2") == 30


def test_sjf_with_aging_finishes_a_long_job_under_a_stream_of_short_ones() -> None:
    # One seat; a short job arrives every step, and would always be shorter than the long one.
    long_job = Arrival(0, [1] * 30, 10)
    stream = [Arrival(step, [2, 3], 1) for step in range(300)]

    def admitted_at(aging: str) -> int:
        scheduler = build_scheduler("sjf", {"aging": aging}, budget=64, max_num_seqs=1, num_blocks=64, block_size=4)
        return run(scheduler, [long_job, *stream], eos_rate=0).first_admitted("0")

    assert admitted_at("0") >= 299  # plain SJF: only once the stream stops
    assert admitted_at("1") <= 40  # overtaken by at most len(long) / aging = 40 admissions
    assert admitted_at("4") <= 10


def test_fair_serves_a_late_tenant_at_once_where_fcfs_makes_it_wait() -> None:
    # Tenant "a" queues 30 requests, then "b" queues 30: both stay backlogged for a long time.
    workload = ([Arrival(0, [1] * 8, 4, user="a") for _ in range(30)]
                + [Arrival(0, [2] * 8, 4, user="b") for _ in range(30)])
    fair = run(build_scheduler("fair", budget=32, max_num_seqs=2, num_blocks=64, block_size=4), workload, eos_rate=0)
    assert fair.first_admitted("30") == 0
    gap, bound = check_fair_bound(fair)
    assert gap <= bound
    fcfs = run(build_scheduler("fcfs", budget=32, max_num_seqs=2, num_blocks=64, block_size=4), workload, eos_rate=0)
    with pytest.raises(AssertionError, match="service gap"):
        check_fair_bound(fcfs, w_p=1.0, w_q=2.0)


def test_fair_lifts_a_returning_tenant_so_idle_time_earns_no_credit() -> None:
    # "a" is served alone for a while; "b" then arrives and must not get all the service it missed.
    workload = ([Arrival(0, [1] * 8, 4, user="a") for _ in range(20)]
                + [Arrival(20, [1] * 8, 4, user="a") for _ in range(20)]
                + [Arrival(20, [2] * 8, 4, user="b") for _ in range(20)])
    trace = run(build_scheduler("fair", budget=32, max_num_seqs=2, num_blocks=64, block_size=4), workload,
                eos_rate=0)
    check_fair_bound(trace)
    admitted_after_b = [n.request_id for r in trace.steps[trace.first_admitted("40"):]
                        for n in r.output.new_requests][:10]
    assert {int(i) >= 40 for i in admitted_after_b} == {True, False}  # interleaved, not b only
