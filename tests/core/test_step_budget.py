"""The inter-token latency target (``--target-itl-ms``): the time a step's prefills get, the chunk that
fits it, the step-time model refitted as the engine runs, and the scheduler and simulator under it.

Step times here come from cost models with round coefficients, so every expected value is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cadence.config import SchedulerConfig
from cadence.core.cost_model import FEATURES, CostModel, StepShape
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.step_budget import ONLINE_FEATURES, StepBudget, refit
from cadence.core.step_plan import StepPlan
from cadence.messages import ModelRunnerOutput
from cadence.policies.base import PolicyContext
from cadence.policies.fcfs import FCFSPolicy
from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.sim import EngineLimits, RequestSpec, simulate

# 10 ms a step, 1 ms a prefill token, 2 ms a decode: a decode of n requests takes 10 + 2n ms.
LINEAR = CostModel({"const": 0.010, "prefill_tokens": 0.001, "decode_seqs": 0.002})


def test_prefill_time_is_what_the_decodes_leave_of_the_target_and_never_less_than_their_own() -> None:
    budget = StepBudget(0.050, LINEAR)
    assert budget.prefill_time([]) == math.inf  # nobody is waiting for a next token
    assert budget.prefill_time([5, 9, 7]) == pytest.approx(0.050 - 0.016)
    # 30 decodes take 70 ms, past the target: the prefills still get as long as the decodes.
    assert budget.prefill_time([3] * 30) == pytest.approx(0.070)


def test_while_a_queue_is_admitted_steps_may_take_twice_the_decodes_of_the_batch_it_will_make() -> None:
    budget = StepBudget(0.050, LINEAR)
    # 3 decodes (16 ms) with 27 requests to join them: 30 decodes will take 70 ms, their steps 140.
    assert budget.prefill_time([5, 9, 7], batch=30) == pytest.approx(0.140 - 0.016)
    assert budget.prefill_time([5, 9, 7], batch=10) == pytest.approx(0.060 - 0.016)
    # A batch whose steps fit the target changes nothing, nor one no larger than the decodes'.
    assert budget.prefill_time([5, 9, 7], batch=7) == budget.prefill_time([5, 9, 7], batch=3) == pytest.approx(0.034)
    # The joining requests' contexts are counted as the decodes' average.
    with_kv = StepBudget(0.050, CostModel({**LINEAR.coefficients, "kv_tokens": 0.001}))
    assert with_kv.prefill_time([6, 6], batch=20) == pytest.approx(2 * (0.050 + 0.120) - (0.014 + 0.012))


def test_the_chunk_fits_the_time_including_attention_over_its_start() -> None:
    linear = StepBudget(0.05, LINEAR)
    assert linear.prefill_tokens(0.0305, start=0) == 30
    assert linear.prefill_tokens(0.030, start=0) == 30  # exactly, despite rounding
    assert linear.prefill_tokens(0.0, start=0) == linear.prefill_tokens(5e-4, start=0) == 0
    quadratic = StepBudget(0.05, CostModel({"prefill_tokens": 1e-4, "prefill_attn": 1e-6, "prefills": 0.002}))
    for seconds, start in ((0.01, 0), (0.01, 500), (0.2, 4000)):
        n = quadratic.prefill_tokens(seconds, start)
        assert quadratic.chunk_time(n, start) <= seconds < quadratic.chunk_time(n + 1, start)
    # The same time buys fewer tokens deep into a long prompt.
    assert quadratic.prefill_tokens(0.01, 500) < quadratic.prefill_tokens(0.01, 0)


# LINEAR with the rows under a quantized kernel's limit of 8 costing 3 ms more each: a decode alone takes
# 15 ms, 8 of them 50, 9 of them 52.
HINGE = CostModel({**LINEAR.coefficients, "kernel_rows": 0.003}, {"kernel_row_limit": 8})


def test_rows_under_the_kernel_s_limit_cost_its_price_as_well() -> None:
    budget = StepBudget(0.05, HINGE)
    assert budget.prefill_time([5, 9, 7]) == pytest.approx(0.050 - 0.025)
    assert budget.prefill_time([5] * 8) == pytest.approx(0.050)  # 50 ms of decodes: as long again
    # Beside 3 decodes a chunk's first 5 tokens cost 4 ms each, the next ones 1 ms.
    assert budget.chunk_time(4, 0, rows=3) == pytest.approx(0.016)
    assert budget.chunk_time(10, 0, rows=3) == pytest.approx(0.010 + 0.015)
    assert budget.chunk_time(10, 0, rows=8) == budget.chunk_time(10, 0, rows=20) == pytest.approx(0.010)
    assert budget.draft_time(2, rows=7) == pytest.approx(0.003)  # no draft price: one row under the limit
    assert budget.prefill_tokens(0.016, 0, rows=3) == 4
    assert budget.prefill_tokens(0.0215, 0, rows=3) == 6  # 5 narrow tokens (20 ms), a wide one
    assert budget.prefill_tokens(0.025, 0, rows=3) == 10
    assert budget.prefill_tokens(0.025, 0, rows=8) == 25
    # Whatever the time and the rows before, the chunk is the longest that fits.
    quadratic = StepBudget(0.05, CostModel({"prefill_tokens": 1e-4, "prefill_attn": 1e-6, "prefills": 0.002,
                                            "kernel_rows": 2e-3}, {"kernel_row_limit": 16}))
    for seconds in (0.0021, 0.005, 0.02, 0.0341, 0.05, 0.3):
        for start, rows in ((0, 0), (0, 9), (500, 3), (4000, 15), (100, 40)):
            n = quadratic.prefill_tokens(seconds, start, rows)
            assert quadratic.chunk_time(n, start, rows) <= seconds + 1e-15 < quadratic.chunk_time(n + 1, start, rows)


def test_a_plan_prices_its_rows_under_the_kernel_s_limit_and_counts_them_in_its_shape() -> None:
    decode, chunk = _request("d", 8, 100), _request("c", 30, 300)
    decode.num_computed_tokens = 8
    decode.append_output_token(7)
    plan = StepPlan(64, StepBudget(0.05, HINGE), [decode])
    assert plan.time_left == pytest.approx(0.050 - 0.015)
    plan.take(decode, 1, [], 8)
    assert plan.token_budget(chunk, 0) == 7 + 7  # 7 tokens under the limit (28 ms), 7 past it (7 ms)
    plan.take(chunk, 10, [], 0)
    assert plan.time_left == pytest.approx(0.035 - 0.010 - 7 * 0.003)
    assert plan.shape({"d": decode, "c": chunk}) == StepShape(
        num_seqs=2, prefill_tokens=10, decode_seqs=1, kv_tokens=9, prefill_attn=100, prefills=1, sampled=1,
        kernel_rows=8)


def test_refit_learns_the_price_of_rows_under_the_kernel_s_limit_from_steps_on_both_sides() -> None:
    truth = CostModel({"const": 0.008, "prefill_tokens": 3e-3, "decode_seqs": 3.5e-3, "kv_tokens": 9e-6,
                       "kernel_rows": 4.5e-3}, {"kernel_row_limit": 16})
    shapes = [StepShape(num_seqs=d, decode_seqs=d, kv_tokens=d * c, sampled=d, kernel_rows=min(d, 16))
              for d in (1, 2, 4, 8, 16, 24, 32) for c in (100, 400)]
    fitted = refit(CostModel.default().with_metadata(kernel_row_limit=16), *_timed(truth, shapes))
    assert fitted.coefficients["kernel_rows"] == pytest.approx(4.5e-3, rel=1e-6)
    assert fitted.coefficients["decode_seqs"] == pytest.approx(3.5e-3, rel=1e-6)
    assert fitted.row_limit == 16  # kept: the shapes it prices are still counted with it


def _shape(prefill: int, decodes: int, context: int) -> StepShape:
    return StepShape(num_seqs=decodes + (prefill > 0), prefill_tokens=prefill, decode_seqs=decodes,
                     kv_tokens=decodes * context, prefill_attn=prefill * prefill, prefills=int(prefill > 0),
                     sampled=decodes)


def _timed(model: CostModel, shapes: list[StepShape]) -> tuple[np.ndarray, np.ndarray]:
    """Steps as :func:`refit` takes them: rows of feature values, and ``model``'s times."""
    return np.array([s.features() for s in shapes]), np.array([model.step_time(s) for s in shapes])


def test_refit_learns_the_running_costs_and_keeps_what_it_never_saw() -> None:
    truth = {"const": 0.02, "prefill_tokens": 7e-4, "decode_seqs": 1e-3, "kv_tokens": 3e-6}
    true_model = CostModel(truth)
    fitted = refit(CostModel.default(), *_timed(true_model, [_shape(p, d, c) for p in (0, 32, 128)
                                                              for d in (1, 8, 32) for c in (64, 200)]))
    assert set(fitted.coefficients) == set(ONLINE_FEATURES)
    for name, value in truth.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6)
    # Decodes only: the prefill cost is not learned as zero but kept.
    decodes = _timed(true_model, [_shape(0, d, 100) for d in (1, 2, 4, 8, 16)])
    kept = refit(CostModel({**truth, "prefill_tokens": 5e-4}), *decodes)
    assert kept.coefficients["prefill_tokens"] == 5e-4
    assert refit(LINEAR, np.zeros((0, len(FEATURES))), np.zeros(0)) is LINEAR


def test_a_window_at_one_batch_size_keeps_the_decodes_price_without_counting_it_twice() -> None:
    """Decodes at one batch size (a steady load): their cost per request is held, not learnt, and the
    constant term must not learn it again, or every later decode step is priced twice."""
    truth = CostModel({"const": 0.006, "decode_seqs": 1e-3, "kv_tokens": 2e-6, "prefill_tokens": 7e-4})
    steady = _timed(truth, [_shape(0, 5, 200 + j) for j in range(64)])
    fitted = refit(truth, *steady)
    for shape in (_shape(0, 5, 200), _shape(0, 5, 900), _shape(0, 9, 300), _shape(64, 5, 300)):
        assert fitted.step_time(shape) == pytest.approx(truth.step_time(shape), rel=1e-9)
    # Prefills at one chunk size beside varied decodes: the chunk's share is held the same way.
    chunks = _timed(truth, [_shape(32, d, 100) for d in (1, 2, 4, 8, 16)])
    assert refit(truth, *chunks).step_time(_shape(32, 3, 100)) == pytest.approx(
        truth.step_time(_shape(32, 3, 100)), rel=1e-9)


def test_a_feature_that_moves_only_with_the_others_keeps_its_price() -> None:
    """A prompt, then its request decoding alone (a first client's request): every step is the
    prompt or one decode, so a decode's cost cannot be told from the step's. It is held, with its
    share of each step, instead of being fitted to whatever the solver picks (it picked none)."""
    truth = CostModel({"const": 0.009, "prefill_tokens": 2e-3, "decode_seqs": 3e-3, "kv_tokens": 2e-6})
    prior = CostModel({**truth.coefficients, "decode_seqs": 1e-3})
    window = _timed(truth, [_shape(131, 0, 0)] + [_shape(0, 1, 131 + j) for j in range(127)])
    fitted = refit(prior, *window)
    assert fitted.coefficients["decode_seqs"] == 1e-3
    for shape in (_shape(131, 0, 0), _shape(0, 1, 140), _shape(0, 1, 250)):  # the window's own steps
        assert fitted.step_time(shape) == pytest.approx(truth.step_time(shape), rel=1e-6)
    # With a second batch size the decode's cost is told apart, and learnt.
    both = _timed(truth, [_shape(131, 0, 0)] + [_shape(0, d, 131 + j) for d in (1, 8) for j in range(20)])
    assert refit(prior, *both).coefficients["decode_seqs"] == pytest.approx(3e-3, rel=1e-6)


def test_a_feature_only_outliers_moved_keeps_its_price() -> None:
    """A first client's long prompt, then its request decoding alone: the prompt's chunks, whose
    attention the online form cannot price, are left out as outliers, and with them every step that
    had prefill tokens. The fit used to price prefill tokens (and a decode, moved only with the
    constant then) at nothing, and the next prompt took the whole token budget beside the stream."""
    truth = CostModel.default()
    last_chunk = StepShape(num_seqs=1, prefill_tokens=8, prefill_attn=8 * 520, prefills=1, sampled=1)  # of 520
    prompts = [_shape(221, 0, 0), _shape(512, 0, 0), last_chunk]
    window = _timed(truth, prompts + [_shape(0, 1, 222 + j) for j in range(125)])
    fitted = refit(truth, *window)
    assert fitted.coefficients["prefill_tokens"] == truth.coefficients["prefill_tokens"]
    assert fitted.coefficients["decode_seqs"] == truth.coefficients["decode_seqs"]
    for shape in (_shape(0, 1, 300), _shape(0, 1, 400)):  # the decodes it kept are priced exactly
        assert fitted.step_time(shape) == pytest.approx(truth.step_time(shape), rel=1e-9)
    budget = StepBudget(0.050, fitted)
    assert budget.prefill_tokens(budget.prefill_time([300]), 0) < 60


def test_a_model_of_the_online_form_that_predicts_every_step_is_kept_as_it_is() -> None:
    online = CostModel({"const": 0.006, "decode_seqs": 1e-3, "kv_tokens": 2e-6, "prefill_tokens": 7e-4})
    steps = _timed(online, [_shape(p, d, 100 + d) for p in (0, 48) for d in (1, 3, 6)])
    assert refit(online, *steps) is online
    # One step off by a thousandth: refitted.
    features, times = steps
    assert refit(online, features, times * np.r_[1.001, np.ones(len(times) - 1)]) is not online
    # The built-in model prices features the online fit has not: it gives way to the first refit even
    # on steps it predicts exactly.
    builtin = CostModel.default()
    refitted = refit(builtin, *_timed(builtin, [_shape(p, d, 100 + d) for p in (0, 48) for d in (1, 3, 6)]))
    assert set(refitted.coefficients) == set(ONLINE_FEATURES)


def test_observing_decodes_in_bulk_is_observing_them_in_turn() -> None:
    truth = CostModel({"const": 0.004, "decode_seqs": 7e-4, "kv_tokens": 3e-7, "prefill_tokens": 1e-4})
    one_by_one, bulk = (StepBudget(0.05, CostModel.default(), window=16, refit_every=8) for _ in range(2))
    for budget in (one_by_one, bulk):  # a prefill first: the windows mix both kinds
        budget.observe(_shape(40, 2, 10), truth.step_time(_shape(40, 2, 10)))
    kv_tokens = 3 * 50 + 3 * np.arange(29)
    seconds = truth.decode_step_times(3, kv_tokens)
    for kv, duration in zip(kv_tokens.tolist(), seconds.tolist(), strict=True):
        one_by_one.observe(StepShape(num_seqs=3, decode_seqs=3, kv_tokens=kv, sampled=3), duration)
    bulk.observe_decodes(3, kv_tokens[:5], seconds[:5])
    bulk.observe_decodes(3, kv_tokens[5:], seconds[5:])
    assert bulk.model == one_by_one.model and bulk.model.metadata["source"] == "refitted while running"
    assert bulk.prefill_time([60, 61]) == one_by_one.prefill_time([60, 61])


def test_observing_steps_refits_every_so_many() -> None:
    budget = StepBudget(0.05, CostModel.default(), refit_every=4)
    truth = CostModel({"const": 0.03, "prefill_tokens": 2e-3, "decode_seqs": 1e-3})
    # Contexts that vary apart from the batch sizes: the KV term is told apart (and learnt as none).
    for prefill, decodes, context in ((16, 1, 10), (64, 2, 30), (0, 4, 10), (8, 8, 20)):
        assert budget.model is not truth
        budget.observe(_shape(prefill, decodes, context), truth.step_time(_shape(prefill, decodes, context)))
    for name in ("const", "prefill_tokens", "decode_seqs", "kv_tokens"):
        assert budget.model.coefficients[name] == pytest.approx(truth.coefficients.get(name, 0.0), abs=1e-9)


def _scheduler(target_ms: float, chunked: bool = True, model: CostModel = LINEAR) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, target_itl_ms=target_ms)
    policy = FCFSPolicy(PolicyContext(256, 16, True, 0), {"chunked": str(chunked).lower()})
    return Scheduler(config, KVCacheManager(num_blocks=257, block_size=4), policy, cost_model=model)


def _request(request_id: str, prompt_len: int, first_token: int) -> Request:
    return Request(request_id, list(range(first_token, first_token + prompt_len)),
                   SamplingParams(max_tokens=50, ignore_eos=True), eos_token_id=None, arrival_time=0.0,
                   max_model_len=512)


def _step(scheduler: Scheduler) -> dict[str, int]:
    out = scheduler.schedule()
    done = [rid for rid, num in out.num_scheduled_tokens.items()
            if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens]
    scheduler.update_from_output(ModelRunnerOutput(out.step_id, done, [7] * len(done)))
    return dict(out.num_scheduled_tokens)


def test_a_step_with_decodes_gives_prefills_only_the_time_the_target_leaves() -> None:
    scheduler = _scheduler(target_ms=40)
    for i in range(4):
        scheduler.add_request(_request(f"d{i}", 8, 100 + 10 * i))
    assert _step(scheduler) == {f"d{i}": 8 for i in range(4)}  # nobody decodes yet: the whole budget
    scheduler.add_request(_request("long", 200, 1000))
    # 4 decodes: 18 ms; the prompt gets 22 ms of 1-ms tokens.
    assert _step(scheduler) == {**{f"d{i}": 1 for i in range(4)}, "long": 22}
    assert _step(scheduler)["long"] == 22
    unbounded = _scheduler(target_ms=0)
    for i in range(4):
        unbounded.add_request(_request(f"d{i}", 8, 100 + 10 * i))
    _step(unbounded)
    unbounded.add_request(_request("long", 200, 1000))
    assert _step(unbounded)["long"] == 200


def test_a_queue_waiting_to_join_the_decodes_gets_the_time_its_batch_will_take() -> None:
    scheduler = _scheduler(target_ms=40)
    for i in range(4):
        scheduler.add_request(_request(f"d{i}", 8, 100 + 10 * i))
    _step(scheduler)
    for i in range(12):
        scheduler.add_request(_request(f"q{i}", 100, 1000 + 100 * i))
    # 16 requests make a batch whose decodes take 42 ms: steps may take 84, 66 of it the prompt's.
    assert _step(scheduler) == {**{f"d{i}": 1 for i in range(4)}, "q0": 66}
    assert _step(scheduler) == {**{f"d{i}": 1 for i in range(4)}, "q0": 34, "q1": 32}


def test_a_prompt_moves_by_a_token_a_step_even_when_no_token_fits() -> None:
    slow_prefill = CostModel({"const": 0.010, "prefill_tokens": 1.0, "decode_seqs": 0.002})
    scheduler = _scheduler(target_ms=40, model=slow_prefill)
    scheduler.add_request(_request("d", 8, 100))
    _step(scheduler)
    scheduler.add_request(_request("a", 50, 1000))
    scheduler.add_request(_request("b", 50, 2000))
    assert _step(scheduler) == {"d": 1, "a": 1}  # the second prompt waits: one token is over time
    assert _step(scheduler) == {"d": 1, "a": 1}


def test_a_plans_shape_counts_what_the_step_computes() -> None:
    decode, prompt_end, chunk = _request("d", 8, 100), _request("p", 10, 200), _request("c", 30, 300)
    decode.num_computed_tokens, prompt_end.num_computed_tokens = 8, 4
    decode.append_output_token(7)  # 9 tokens, 8 computed: a decode
    plan = StepPlan(64, StepBudget(0.05, LINEAR), [decode])
    assert plan.time_left == pytest.approx(0.050 - 0.012)
    plan.take(decode, 1, [], 8)
    plan.take(prompt_end, 6, [], 4)  # the rest of its prompt: it samples
    plan.take(chunk, 12, [], 0)  # a chunk: it does not
    assert plan.time_left == pytest.approx(0.038 - 0.018)
    assert plan.budget == 64 - 19
    requests = {r.request_id: r for r in (decode, prompt_end, chunk)}
    assert plan.shape(requests) == StepShape(num_seqs=3, prefill_tokens=18, decode_seqs=1, kv_tokens=9,
                                                   prefill_attn=6 * 10 + 12 * 12, prefills=2, sampled=2)


def test_drafts_verified_with_a_decode_take_their_time_from_the_prefills() -> None:
    decode = _request("d", 8, 100)
    decode.num_computed_tokens = 8
    decode.append_output_token(7)
    budget = StepBudget(0.05, CostModel({**LINEAR.coefficients, "draft_tokens": 0.003}))
    plan = StepPlan(64, budget, [decode])
    plan.take(decode, 1, [[]], 8)
    plan.add_drafts(decode, 4, [[5]])
    assert plan.time_left == pytest.approx(0.050 - 0.012 - 4 * 0.003)
    assert (plan.budget, plan.scheduled, plan.new_blocks) == (64 - 5, {"d": 5}, {"d": [[5]]})
    assert plan.shape({"d": decode}) == StepShape(num_seqs=1, decode_seqs=1, kv_tokens=9, sampled=1,
                                                        draft_tokens=4)
    truth = CostModel({"const": 0.01, "decode_seqs": 0.002, "draft_tokens": 0.0015})
    samples = _timed(truth, [StepShape(num_seqs=d, decode_seqs=d, sampled=d, draft_tokens=k)
                             for d in (1, 2, 4) for k in (0, 3, 8)])
    assert refit(LINEAR, *samples).coefficients["draft_tokens"] == pytest.approx(0.0015, rel=1e-6)


def test_whole_prefill_policies_ignore_the_target() -> None:
    scheduler = _scheduler(target_ms=40, chunked=False)
    assert scheduler.step_budget is None


def test_in_the_simulator_no_step_with_decodes_outlasts_the_target() -> None:
    """Decodes of 8 requests take 26 ms; long prompts keep arriving. With a 60 ms target every step
    that carries a decode ends within 60 ms (the refits reproduce the simulator's own model); without
    it, steps of the whole 512-token budget take about half a second."""
    workload = [RequestSpec(arrival_time=0.05 * i, prompt_tokens=300 if i % 2 else 16, output_tokens=40)
                for i in range(40)]

    def longest_decode_step(target_ms: float) -> float:
        limits = EngineLimits(num_kv_blocks=2048, block_size=16, max_model_len=1024, max_num_seqs=8,
                              max_num_batched_tokens=512, target_itl_ms=target_ms)
        result = simulate(workload, limits, "fcfs", LINEAR)
        assert all(len(r.chunk_times) == 40 for r in result.records)
        return max(s.duration for s in result.steps if s.decode_seqs)

    assert longest_decode_step(60) <= 0.060 + 1e-9
    assert longest_decode_step(0) > 0.45
