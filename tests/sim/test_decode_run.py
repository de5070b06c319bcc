"""The simulator's fast-forward (``cadence/sim/decode_run.py``): which steps it takes in one call, and
what they are. That the result is the same as step by step is ``property_tests/test_decode_fast_forward.py``."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from cadence.core.cost_model import CostModel, StepShape
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.policies.fcfs import FCFSPolicy
from cadence.policies.loader import load_policy
from cadence.request import Request, RequestView
from cadence.sampling_params import SamplingParams
from cadence.sim import run_loop
from cadence.sim.decode_run import DecodeRun, plan_decode_run
from cadence.sim.runner import SimulatedRunner
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.workload import RequestSpec

COSTS = CostModel({"const": 0.004, "decode_seqs": 0.0007, "kv_tokens": 3.1e-7, "prefill_tokens": 1.3e-4,
                   "sampled": 1e-4})
LIMITS = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                      target_itl_ms=0.0)


def _decoding(prompts: list[int], outputs: list[int], policy: str = "fcfs", limits: EngineLimits = LIMITS,
              costs: CostModel = COSTS) -> Scheduler:
    """A scheduler whose requests have all been prefilled and sampled their first token."""
    allocator = KVCacheManager(limits.num_kv_blocks, limits.block_size, limits.enable_prefix_caching)
    scheduler = Scheduler(limits.scheduler_config(policy), allocator, load_policy(policy, limits.policy_context()),
                          cost_model=costs)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        params = SamplingParams(max_tokens=output, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + prompt)), params, None, 0.0, 256))
    runner = SimulatedRunner(costs)
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        scheduler.update_from_output(runner.execute(scheduler.schedule())[0])
    return scheduler


def _run(scheduler: Scheduler, max_steps: int = 10**6, costs: CostModel = COSTS) -> DecodeRun:
    run = plan_decode_run(scheduler, costs, 1.5, max_steps)
    assert run is not None
    return run


def test_a_run_ends_with_the_step_that_finishes_its_first_request() -> None:
    run = _run(_decoding([10, 7], [40, 25]))
    assert run.num_steps == 25 - 1  # one token sampled at the prefill; the last step finishes r1
    assert [r.request_id for r in run.requests] == ["r0", "r1"]
    assert run.starts[0] == 1.5 and np.all(run.starts[1:] == run.starts[:-1] + run.durations)  # end = start + duration
    assert _run(_decoding([10, 7], [40, 25]), max_steps=5).num_steps == 5


def test_each_step_of_a_run_is_priced_as_its_shape_is_one_by_one() -> None:
    run = _run(_decoding([10, 7, 30], [40, 25, 60]))
    shapes = [StepShape(num_seqs=3, decode_seqs=3, kv_tokens=11 + 8 + 31 + 3 * j, sampled=3) for j in range(24)]
    assert [run.shape(j) for j in range(24)] == shapes
    assert run.durations.tolist() == [COSTS.step_time(s) for s in shapes]  # bit for bit
    assert run.free_blocks.tolist() == [
        64 - 1 - 3 - 2 - 8 - sum(((length + j) % 4 == 1) for length in (11, 8, 31) for j in range(k + 1))
        for k in range(24)]


@pytest.mark.parametrize("limit", [2, 3, 16])
def test_a_run_counts_the_rows_under_the_kernel_s_limit_as_each_step_would(limit: int) -> None:
    costs = CostModel({**COSTS.coefficients, "kernel_rows": 0.0011}, {"kernel_row_limit": limit})
    run = _run(_decoding([10, 7, 30], [40, 25, 60], costs=costs), costs=costs)
    shapes = [StepShape(num_seqs=3, decode_seqs=3, kv_tokens=11 + 8 + 31 + 3 * j, sampled=3,
                        kernel_rows=min(3, limit)) for j in range(24)]
    assert [run.shape(j) for j in range(24)] == shapes
    assert run.durations.tolist() == [costs.step_time(s) for s in shapes]  # bit for bit


def test_a_run_stops_before_the_step_that_finds_no_free_block() -> None:
    limits = EngineLimits(num_kv_blocks=9, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                          target_itl_ms=0.0)
    scheduler = _decoding([9, 5], [20, 20], limits=limits)  # 3 + 2 of the 8 usable blocks held
    run = _run(scheduler)
    # r0 (10 tokens) takes a block at steps 3, 7; r1 (6 tokens) at steps 3, 7: the 4th take is at step 7.
    assert scheduler.allocator.num_free_blocks == 3
    assert run.num_steps == 7 and run.free_blocks.tolist() == [3, 3, 3, 1, 1, 1, 1]


@pytest.mark.parametrize("why", ["waiting", "fair", "trace", "one step left"])
def test_no_run_where_a_step_needs_the_scheduler_or_its_hooks(why: str) -> None:
    scheduler = _decoding([10, 7], [40, 2 if why == "one step left" else 25], "fair" if why == "fair" else "fcfs")
    if why == "waiting":
        scheduler.add_request(Request("late", [1, 2, 3], SamplingParams(max_tokens=4), None, 0.0, 256))
    if why == "trace":
        scheduler.trace = mock.Mock()
    assert plan_decode_run(scheduler, COSTS, 0.0, 10**6) is None


def test_simulate_takes_a_lone_decode_in_one_run_and_an_arrival_cuts_it_at_the_next_step() -> None:
    step = CostModel.constant(0.01)
    with mock.patch.object(run_loop, "commit", wraps=run_loop.commit) as bulk:
        alone = simulate([RequestSpec(0.0, 10, 50)], LIMITS, "fcfs", step)
    # The prefill, then 49 decodes in one run, the last of which finishes the request.
    assert [c.args[1:3] for c in bulk.call_args_list] == [(0, 49)] and alone.num_steps == 50
    assert alone.records[0].chunk_times == pytest.approx([0.01 * (i + 1) for i in range(50)])
    late = [RequestSpec(0.0, 10, 50, request_id="a"), RequestSpec(0.1234, 4, 5, request_id="b")]
    with mock.patch.object(run_loop, "commit", wraps=run_loop.commit) as bulk:
        cut = simulate(late, LIMITS, "fcfs", step)
    # Steps 2-13 began before 0.1234 (the 13th at 0.12, ending at 0.13): "b" joins the 14th, at 0.13.
    # No router hears KV events: the 12 that began are committed in one stretch (a router that follows
    # the prefix caches hears those that ended first: below).
    assert [c.args[1:3] for c in bulk.call_args_list[:1]] == [(0, 12)]
    assert cut.records[1].chunk_times[0] == pytest.approx(0.14)
    assert cut.steps == simulate(late, LIMITS, "fcfs", step, fast_forward=False).steps


def test_a_prefix_aware_router_hears_of_a_runs_evictions_before_it_routes_a_request_they_matter_to() -> None:
    """Engine 0 caches a prefix (a), then decodes a long request (c) whose blocks evict it, in one run;
    a request with that prefix (d) arrives mid-run: it goes to the idle engine 1, as step by step."""
    limits = EngineLimits(num_kv_blocks=18, block_size=4, max_model_len=128, max_num_seqs=8,
                          max_num_batched_tokens=64, target_itl_ms=0.0)
    prefix = tuple(range(101, 109))
    workload = [RequestSpec(0.0, 9, 1, request_id="a", prompt_token_ids=(*prefix, 200)),
                RequestSpec(0.0, 4, 3, request_id="b", prompt_token_ids=(1000, 1001, 1002, 1003)),
                RequestSpec(0.0, 4, 64, request_id="c", prompt_token_ids=(2000, 2001, 2002, 2003)),
                RequestSpec(0.625, 9, 2, request_id="d", prompt_token_ids=(*prefix, 300))]
    step = CostModel.constant(0.01)

    def run(fast_forward: bool) -> list[int]:
        result = simulate(workload, limits, "fcfs", step, engines=2, router="prefix-aware", fast_forward=fast_forward)
        assert result.records[3].completed
        return [s.engine for s in result.steps if s.start > 0.62 and s.prefill_tokens]

    assert run(False) == [1]  # c's takes evicted the prefix at 0.61-0.62: d goes by load
    with mock.patch.object(run_loop, "commit", wraps=run_loop.commit) as bulk:
        assert run(True) == [1]
    c_run = [call.args[1:3] for call in bulk.call_args_list if call.args[0].requests[0].request_id == "c"]
    assert c_run[0] == (0, 61)  # c's run's steps until d's arrival, told first
    with mock.patch.object(run_loop.RunLoop, "_tell_before"):  # not told: the router still sees the prefix
        assert run(True) == [0]


def test_a_policy_that_overrides_a_decode_hook_says_bulk_decodes_again_or_steps_one_by_one() -> None:
    class Counting(FCFSPolicy):
        def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
            pass

    class CountingInBulk(Counting):
        bulk_decodes = True

    class Renamed(FCFSPolicy):  # no decode hook of its own
        name = "renamed"

    context = LIMITS.policy_context()
    assert [p(context).decodes_in_bulk for p in (FCFSPolicy, Counting, CountingInBulk, Renamed)] == [
        True, False, True, True]
    assert not load_policy("fair", context).decodes_in_bulk


def test_a_prompt_whose_last_token_is_still_to_compute_waits_for_its_first_token_before_a_run() -> None:
    """A prefill chunk ending one token before the prompt's end leaves a one-token step that fills the
    prompt's last block: it must reach the prefix-aware router as step by step (Z hits it)."""
    limits = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                          max_num_batched_tokens=4, target_itl_ms=0.0)
    workload = [RequestSpec(0.0, 1, 30, request_id="x", prompt_token_ids=(200,)),
                RequestSpec(0.0, 1, 30, request_id="v", prompt_token_ids=(300,)),
                RequestSpec(0.0, 4, 30, request_id="y", prompt_token_ids=(400, 401, 402, 403)),
                RequestSpec(0.0025, 6, 30, request_id="z", prompt_token_ids=(400, 401, 402, 403, 500, 501))]
    runs = [simulate(workload, limits, "chunked-prefill", CostModel.constant(0.001), engines=2,
                     router="prefix-aware", fast_forward=fast_forward) for fast_forward in (False, True)]
    assert runs[0].steps == runs[1].steps and runs[0].records == runs[1].records


def test_an_arrival_during_a_runs_last_step_leaves_the_run_whole_and_joins_after_its_finish() -> None:
    step = CostModel.constant(0.01)
    workload = [RequestSpec(0.0, 10, 50, request_id="a"), RequestSpec(0.495, 4, 5, request_id="b")]
    with mock.patch.object(run_loop, "commit", wraps=run_loop.commit) as bulk:
        result = simulate(workload, LIMITS, "fcfs", step)
    # a's run (steps 2-50) had begun its last step, which finishes a, at 0.49: nothing is cut, and b
    # is prefilled at the run's end, once a has finished.
    assert [call.args[1:3] for call in bulk.call_args_list][:1] == [(0, 49)]
    assert result.finish_reasons == {"a": "length", "b": "length"}
    assert result.records[1].chunk_times[0] == pytest.approx(0.51)
    assert result.steps == simulate(workload, LIMITS, "fcfs", step, fast_forward=False).steps
