"""The simulator's link to the real engine: the step shapes its runner derives from scheduler
outputs (``cadence/sim/runner.py``), the calibration plan and the cycle samples taken from step
timings (``cadence/sim/calibrate.py``), and replaying a workload against the tiny engine
(``cadence/sim/replay.py``). ``tests/sim/test_sim.py`` runs the whole calibration once, through its verb."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cadence.core.cost_model import CostModel, StepShape
from cadence.engine.llm import LLM
from cadence.messages import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.sampling_params import SamplingParams
from cadence.sim.calibrate import Phase, TimedStep, cycle_samples, default_plan, fit_timed_steps, time_steps
from cadence.sim.replay import replay
from cadence.sim.runner import SIMULATED_TOKEN_ID, ShapeTracker, SimulatedRunner
from cadence.sim.workload import RequestSpec

# ---- the simulated runner's shapes ------------------------------------------------------------


def new(request_id: str, num_tokens: int, num_computed: int = 0) -> NewRequestData:
    return NewRequestData(request_id, list(range(10, 10 + num_tokens)), num_tokens, SamplingParams(), 0, [1],
                          num_computed)


def output(step_id: int, scheduled: dict[str, int], new_requests: tuple[NewRequestData, ...] = (),
           cached: dict[str, int] | None = None, finished: tuple[str, ...] = (),
           preempted: tuple[str, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, new_requests=list(new_requests),
                           cached_requests=[CachedRequestData(r, [], n) for r, n in (cached or {}).items()],
                           num_scheduled_tokens=scheduled, finished_request_ids=list(finished),
                           preempted_request_ids=list(preempted))


def steps_and_shapes() -> Iterator[tuple[SchedulerOutput, StepShape, list[str]]]:
    """A hand-run schedule: each step with the shape and the sampling requests it should give."""
    # A: 10-token prompt, chunked 8 + 2. B: 6 tokens, 4 of them from the prefix cache.
    yield (output(0, {"A": 8, "B": 2}, (new("A", 10), new("B", 6, num_computed=4))),
           StepShape(num_seqs=2, prefill_tokens=10, prefill_attn=8 * 8 + 2 * 6, prefills=2, sampled=1), ["B"])
    # B decodes its first token at position 7; A finishes its prompt (2 queries over 10 keys).
    yield (output(1, {"B": 1, "A": 2}, cached={"A": 8, "B": 6}),
           StepShape(num_seqs=2, prefill_tokens=2, decode_seqs=1, kv_tokens=7, prefill_attn=2 * 10, prefills=1,
                     sampled=2), ["B", "A"])
    # Two decodes (contexts 11 and 8: each reads its own) and a new 3-token prompt.
    yield (output(2, {"A": 1, "B": 1, "C": 3}, (new("C", 3),), cached={"A": 10, "B": 7}),
           StepShape(num_seqs=3, prefill_tokens=3, decode_seqs=2, kv_tokens=11 + 8, prefill_attn=3 * 3, prefills=1,
                     sampled=3), ["A", "B", "C"])
    # A finished, B preempted: only C is left, decoding at position 4.
    yield (output(3, {"C": 1}, cached={"C": 3}, finished=("A",), preempted=("B",)),
           StepShape(num_seqs=1, decode_seqs=1, kv_tokens=4, sampled=1), ["C"])
    # B comes back whole (6 prompt + 3 generated tokens), recomputed from scratch, beside C.
    yield (output(4, {"C": 1, "B": 9}, (new("B", 9),), cached={"C": 4}),
           StepShape(num_seqs=2, prefill_tokens=9, decode_seqs=1, kv_tokens=5, prefill_attn=9 * 9, prefills=1,
                     sampled=2), ["C", "B"])


def test_the_tracker_turns_each_step_into_its_shape_and_samplers() -> None:
    tracker = ShapeTracker()
    sizes = []
    for out, shape, sampled in steps_and_shapes():
        assert tracker.step(out) == (shape, sampled), out.step_id
        sizes.append(len(tracker))
    assert sizes == [2, 2, 3, 1, 2]


def test_the_tracker_counts_rows_under_the_kernel_s_limit_and_the_simulated_runner_uses_its_model_s() -> None:
    tracker = ShapeTracker(row_limit=2)
    limited = [dataclasses.replace(shape, kernel_rows=min(shape.num_tokens, 2)) for _, shape, _ in steps_and_shapes()]
    assert [tracker.step(out)[0] for out, _, _ in steps_and_shapes()] == limited
    runner = SimulatedRunner(CostModel({"const": 0.5, "kernel_rows": 0.25}, {"kernel_row_limit": 2}))
    assert [runner.execute(out)[2] for out, _, _ in steps_and_shapes()] == [0.5 + 0.25 * s.kernel_rows
                                                                               for s in limited]


def test_a_step_without_tokens_is_empty() -> None:
    tracker = ShapeTracker()
    tracker.step(output(0, {"A": 3}, (new("A", 3),)))
    assert tracker.step(output(1, {}, finished=("A", "unknown"))) == (StepShape(), [])
    assert len(tracker) == 0


def test_the_simulated_runner_samples_for_the_tracker_and_prices_the_shape() -> None:
    runner = SimulatedRunner(CostModel({"const": 0.5, "prefill_tokens": 0.25, "decode_seqs": 0.125}))
    durations = []
    for out, shape, sampled in steps_and_shapes():
        result, got, duration = runner.execute(out)
        assert got == shape
        assert (result.step_id, result.request_ids, result.sampled_token_ids) == (
            out.step_id, sampled, [SIMULATED_TOKEN_ID] * len(sampled))
        durations.append(duration)
    assert durations == [0.5 + 2.5, 0.5 + 0.5 + 0.125, 0.5 + 0.75 + 0.25, 0.5 + 0.125, 0.5 + 2.25 + 0.125]


# ---- calibration: cycle samples, plan -----------------------------------------------------------


def shape(n: int) -> StepShape:
    return StepShape(num_seqs=1, prefill_tokens=n, prefills=1, sampled=1)


def test_cycle_samples_are_start_to_start_within_a_phase_leaving_out_idle_gaps() -> None:
    steps = [
        TimedStep(0, 0.0, 0.125, shape(1)), TimedStep(0, 0.25, 0.5, shape(2)),  # warm-up
        TimedStep(1, 1.0, 1.5, shape(3)), TimedStep(1, 1.625, 2.0, shape(4)), TimedStep(1, 2.125, 2.5, shape(5)),
        TimedStep(1, 10.0, 10.5, shape(6)),  # after an idle 7.5 s: the pair (5, 6) is left out
        TimedStep(1, 10.625, 11.0, shape(7)),
        TimedStep(2, 20.0, 20.25, shape(8)), TimedStep(2, 20.3125, 20.5, shape(9)),
    ]
    shapes, cycles, median_gap = cycle_samples(steps)
    # Gaps of the pairs within phases 1 and 2: 0.125, 0.125, 7.5, 0.125, 0.0625; the limit is 10x the median.
    assert median_gap == 0.125
    assert shapes == [shape(3), shape(4), shape(6), shape(8)]
    assert cycles == [0.625, 0.5, 0.625, 0.3125]
    # Phase 0 counts when not skipped; a pair across phases never does.
    shapes, cycles, median_gap = cycle_samples(steps, skip_phases=())
    assert shapes[0] == shape(1) and cycles[0] == 0.25 and median_gap == 0.125


def test_cycle_samples_keep_gaps_under_50_ms_however_small_the_median() -> None:
    gaps = [1 / 256, 1 / 256, 3 / 64, 1 / 256, 1 / 16]  # median 1/256: 10x that is under the 50 ms floor
    steps, start = [], 0.0
    for i, gap in enumerate([*gaps, 0.0]):
        steps.append(TimedStep(1, start, start + 0.5, shape(i)))
        start += 0.5 + gap
    shapes, cycles, median_gap = cycle_samples(steps)
    assert median_gap == 1 / 256
    assert shapes == [shape(0), shape(1), shape(2), shape(3)]  # 3/64 s is kept, 1/16 s is not
    assert cycles == [0.5 + g for g in gaps[:4]]


def test_cycle_samples_of_too_few_steps_are_empty() -> None:
    assert cycle_samples([]) == ([], [], 0.0)
    assert cycle_samples([TimedStep(1, 0.0, 1.0, shape(1))]) == ([], [], 0.0)
    assert cycle_samples([TimedStep(0, 0.0, 1.0, shape(1)), TimedStep(0, 1.5, 2.0, shape(1))]) == ([], [], 0.0)


def test_the_quick_plan() -> None:
    plan = default_plan(max_num_seqs=4, max_model_len=256, seed=3, quick=True, vocab_size=320)
    assert [(p.name, len(p.requests)) for p in plan] == [
        ("warm-up", 2), ("decode x1", 1), ("decode x8", 4), ("decode x32", 4), ("long prompt", 1),
        ("mixed lengths", 16), ("poisson mix", 12)]
    bursts = {"warm-up": (16, 2), "decode x1": (16, 8), "decode x8": (64, 8), "decode x32": (32, 8)}
    for phase in plan:
        if phase.name in bursts:
            prompt, output_tokens = bursts[phase.name]
            # Lengths within a quarter of the phase's, all arriving at once.
            assert all(prompt * 3 // 4 <= r.prompt_tokens <= prompt * 5 // 4 for r in phase.requests)
            assert {(r.arrival_time, r.output_tokens, r.prompt_token_ids) for r in phase.requests} == {
                (0.0, output_tokens, None)}
    [long_prompt] = plan[4].requests
    assert (long_prompt.prompt_tokens, long_prompt.output_tokens) == (256 - 2 - 1, 2)  # capped by the context
    mixed = plan[5].requests  # heavy-tailed lengths, capped
    assert len({r.prompt_tokens for r in mixed}) > 2 and max(r.prompt_tokens for r in mixed) == 256 // 4
    assert all(r.arrival_time == 0.0 and 1 <= r.output_tokens <= 16 for r in mixed)
    stream = plan[6].requests
    times = [r.arrival_time for r in stream]
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == 12
    assert all(16 <= r.output_tokens <= 96 and r.prompt_tokens + r.output_tokens < 256 for r in stream)
    assert plan == default_plan(max_num_seqs=4, max_model_len=256, seed=3, quick=True, vocab_size=320)
    assert plan != default_plan(max_num_seqs=4, max_model_len=256, seed=4, quick=True, vocab_size=320)


def test_the_full_plan_shares_long_prefixes_only_with_prefix_caching() -> None:
    plan = default_plan(max_num_seqs=128, max_model_len=8192, seed=0, vocab_size=1000)
    assert [(p.name, len(p.requests)) for p in plan] == [
        ("warm-up", 2), ("decode x1", 1), ("decode x4", 4), ("decode x16", 16), ("decode x48", 48),
        ("decode x128", 128), ("long contexts x16", 16), ("long prompt", 1), ("shared context x48", 48),
        ("shared context x96", 96), ("mixed lengths x64", 64), ("poisson mix", 30), ("slow poisson mix", 24)]
    assert sum(len(p.requests) for p in plan) == 478
    for phase, prefix in ((plan[8], 320), (plan[9], 384)):
        prompts = [r.prompt_token_ids for r in phase.requests]
        assert all(p is not None and len(p) == r.prompt_tokens for p, r in zip(prompts, phase.requests, strict=True))
        assert len({p[:prefix] for p in prompts if p is not None}) == 1  # one shared prefix
        assert all(100 <= t < 1000 for p in prompts if p is not None for t in p)
        suffix = prefix // 8 + 1  # spread by up to a quarter
        assert all(prefix + suffix * 3 // 4 <= r.prompt_tokens <= prefix + suffix * 5 // 4 for r in phase.requests)
    capped = default_plan(max_num_seqs=8, max_model_len=8192, seed=0, prefix_caching=False)
    assert [p.name for p in capped if p.name.startswith("shared")] == []
    assert [len(p.requests) for p in capped] == [2, 1, 4, 8, 8, 8, 8, 1, 8, 30, 24]  # bursts capped at 8 seats


# ---- against the tiny engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(make_tiny_model: Callable[..., Path]) -> LLM:
    return LLM(model=str(make_tiny_model("llama")), dtype="float32", enable_prefix_caching=False)


def test_replay_returns_one_record_per_spec_in_the_specs_order(llm: LLM) -> None:
    specs = [RequestSpec(0.02, 5, 3),
             RequestSpec(0.0, 8, 1, user="ann", priority=1, request_id="x"),
             RequestSpec(0.0, 4, 4, prompt_token_ids=(101, 102, 103, 104))]
    records = replay(llm, specs, seed=1)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens, r.user, r.priority) for r in records] == [
        ("0", 5, 3, None, 0), ("x", 8, 1, "ann", 1), ("2", 4, 4, None, 0)]
    for record in records:
        assert 1 <= len(record.chunk_times) <= record.output_tokens
        assert record.chunk_times == sorted(record.chunk_times)
        assert record.arrival_time <= record.chunk_times[0]
    # Seconds from the first arrival, submitted in arrival order.
    assert records[1].arrival_time <= records[2].arrival_time <= records[0].arrival_time
    assert replay(llm, []) == []


def test_time_steps_times_every_step_of_each_phase(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = [Phase("warm-up", [RequestSpec(0.0, 4, 2)]),
            Phase("burst", [RequestSpec(0.0, 6, 3), RequestSpec(0.0, 5, 2), RequestSpec(0.0, 3, 1)])]
    messages: list[str] = []
    executor = llm.engine_core.executor
    steps = time_steps(llm, plan, seed=0, progress=messages.append)
    assert [m.split(":")[0] for m in messages] == ["warm-up", "burst"]
    assert [s.phase for s in steps] == sorted(s.phase for s in steps) and {s.phase for s in steps} == {0, 1}
    for phase, specs in enumerate(p.requests for p in plan):
        shapes = [s.shape for s in steps if s.phase == phase]
        # Every prompt token once, then one decode per further output token; one sample per output token.
        assert sum(s.num_tokens for s in shapes) == sum(r.prompt_tokens + r.output_tokens - 1 for r in specs)
        assert sum(s.sampled for s in shapes) == sum(r.output_tokens for r in specs)
        assert sum(s.prefills for s in shapes) == len(specs)  # no prompt here needs two chunks
    assert all(s.start <= s.end for s in steps)
    assert all(a.end <= b.start for a, b in itertools.pairwise(steps))
    assert llm.engine_core.executor is executor  # put back afterwards
    # The shapes count rows under the workers' kernel row limit, where they have one.
    monkeypatch.setattr(executor, "kernel_row_limit", 3, raising=False)
    steps = time_steps(llm, plan[1:], seed=0)
    assert [s.shape.kernel_rows for s in steps] == [min(3, s.shape.num_tokens) for s in steps] != [0] * len(steps)


def test_a_draft_models_proposals_are_fitted_on_the_time_the_worker_reports_for_them(llm: LLM) -> None:
    # Each step verifies as many drafts as it asks for next (a draft that is always right): in the
    # cycles alone the two are one feature; the worker's draft time tells them apart.
    def verify(s: StepShape) -> float:
        return 0.01 + 0.002 * s.decode_seqs + 0.001 * s.draft_tokens

    def propose(s: StepShape) -> float:
        return 0.003 * s.draft_rounds + 0.0005 * s.draft_rows

    shapes = [StepShape(num_seqs=d, decode_seqs=d, draft_tokens=d * k, draft_rounds=k, draft_rows=d * k)
              for d in (1, 2, 4, 8) for k in (1, 2, 3, 4)]
    steps, start = [TimedStep(0, 0.0, 0.001, StepShape())], 1.0
    for s in shapes:
        cycle = verify(s) + propose(s)
        steps.append(TimedStep(1, start, start + cycle - 0.0005, s, draft_s=propose(s)))
        start += cycle
    model, quality = fit_timed_steps(llm, steps)
    assert {k: v for k, v in model.coefficients.items() if v} == pytest.approx(
        {"const": 0.01, "decode_seqs": 0.002, "draft_tokens": 0.001, "draft_rounds": 0.003, "draft_rows": 0.0005})
    assert model.prices_draft_models and quality.total_time_ratio == pytest.approx(1.0)


def test_fit_timed_steps_fits_the_cycles_and_says_how_they_were_measured(llm: LLM) -> None:
    def cycle(s: StepShape) -> float:
        return 0.01 + 0.001 * s.prefill_tokens + 0.002 * s.decode_seqs

    shapes = [StepShape(num_seqs=d + int(p > 0), prefill_tokens=p, decode_seqs=d, prefills=int(p > 0))
              for p in (0, 8, 16, 32) for d in (1, 2, 4)]
    steps, start = [TimedStep(0, 0.0, 0.001, StepShape())], 1.0
    for s in shapes:
        steps.append(TimedStep(1, start, start + cycle(s) - 0.0005, s))
        start += cycle(s)
    model, quality = fit_timed_steps(llm, steps, wall_time_s=12.34)
    assert model.coefficients == pytest.approx({"const": 0.01, "prefill_tokens": 0.001, "decode_seqs": 0.002,
                                                "kv_tokens": 0.0, "prefill_attn": 0.0, "prefills": 0.0,
                                                "sampled": 0.0, "draft_tokens": 0.0, "kernel_rows": 0.0}, abs=1e-9)
    assert quality.num_samples == len(shapes) - 1  # pairs: the last step has no next start
    meta = model.metadata
    assert meta["dtype"] == "float32" and meta["device"] == "cpu" and meta["tensor_parallel_size"] == 1
    assert meta["num_steps_timed"] == len(steps) and meta["calibration_wall_time_s"] == 12.3
    assert meta["median_loop_gap_s"] == pytest.approx(0.0005)
    assert meta["max_num_seqs"] == llm.config.scheduler.max_num_seqs
    assert meta["fit"]["num_samples"] == quality.num_samples
    assert meta["model"] == Path(llm.config.model.path).name and meta["attention_backend"] == "sdpa"
    assert meta["kernel_row_limit"] is None  # unquantized weights: every row takes the same GEMM
