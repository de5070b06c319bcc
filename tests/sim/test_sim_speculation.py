"""Speculative decoding in the simulator: the tracker's shapes with drafts, the simulated worker's
acceptance, and whole runs under the engine's own scheduler speculation (docs/speculative_decoding.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.cli import build_parser as _cli
from cadence.config import SpeculativeConfig
from cadence.core.cost_model import CostModel, StepShape
from cadence.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from cadence.sampling_params import SamplingParams
from cadence.sim.runner import ShapeTracker, SimulatedDrafts, SimulatedRunner
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.workload import RequestSpec

SPEC = SpeculativeConfig(num_speculative_tokens=4)


def step(step_id: int, num: int, drafts: list[int], new: bool = False, computed: int = 0,
         propose: int = 4) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        new_requests=[NewRequestData("r", list(range(10)), 10, SamplingParams(), 0, [[1]], 0)] if new else [],
        cached_requests=[] if new else [CachedRequestData("r", [[]], computed)],
        num_scheduled_tokens={"r": num}, finished_request_ids=[], preempted_request_ids=[],
        spec_token_ids={"r": drafts} if drafts else {}, draft_counts={"r": propose})


def test_a_verification_is_a_decode_plus_its_drafts_and_rejected_ones_are_taken_back() -> None:
    tracker = ShapeTracker()
    assert tracker.step(step(1, 10, [], new=True))[1] == ["r"]  # the prompt, then its first token
    out = step(2, 4, [7, 7, 7], computed=10)
    shape, sampled = tracker.step(out)  # token 10 and 3 drafts: positions 10..13
    assert sampled == ["r"]
    assert shape == StepShape(num_seqs=1, decode_seqs=1, kv_tokens=11, sampled=1, draft_tokens=3)
    tracker.settle(out, ModelRunnerOutput(2, ["r"], [5], num_accepted_drafts=[1]))
    # 13 tokens known (10 + first token + 1 accepted draft + the sampled one), 12 computed: a decode.
    assert tracker.step(step(3, 1, [], computed=12)) == (
        StepShape(num_seqs=1, decode_seqs=1, kv_tokens=13, sampled=1), ["r"])


def test_the_simulated_worker_accepts_drafts_until_the_first_rejection() -> None:
    for acceptance, expected in ((1.0, [3]), (0.0, [0])):
        runner = SimulatedRunner(CostModel({"const": 0.01, "draft_tokens": 0.002}), SimulatedDrafts(4, acceptance))
        runner.execute(step(1, 10, [], new=True))
        result, shape, seconds = runner.execute(step(2, 4, [1, 1, 1], computed=10))
        assert shape.draft_tokens == 3
        assert result.num_accepted_drafts == expected and result.draft_token_ids == [[1, 1, 1, 1]]
        assert seconds == pytest.approx(0.01 + 3 * 0.002)
        # As many drafts as the scheduler asks, at most num_speculative_tokens.
        computed = 11 + expected[0]  # the prompt, the first token and the accepted drafts
        assert runner.execute(step(3, 1, [], computed=computed, propose=2))[0].draft_token_ids == [[1, 1]]
        assert runner.execute(step(4, 1, [], computed=computed + 1, propose=0))[0].draft_token_ids == [[]]


def run(speculative: SpeculativeConfig | None, acceptance: float = 0.7, output: int = 300):
    workload = [RequestSpec(0.0, 64, output)]
    return simulate(workload, EngineLimits(num_kv_blocks=64), cost_model=CostModel.default(),
                    speculative=speculative, draft_acceptance=acceptance)


def test_a_simulation_with_accepted_drafts_makes_every_token_in_fewer_steps() -> None:
    plain, spec = run(None), run(SPEC, acceptance=0.9)
    assert plain.records[0].output_tokens == spec.records[0].output_tokens == 300
    assert spec.num_steps < 0.6 * plain.num_steps
    assert spec.end_time < plain.end_time
    stats = spec.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts
    assert spec.summary()["spec_decode"]["num_accepted_tokens"] == stats.num_accepted_tokens


def test_drafts_that_are_never_accepted_are_soon_not_verified() -> None:
    spec = run(SPEC, acceptance=0.0)
    stats = spec.spec_decode
    assert spec.records[0].output_tokens == 300 and stats is not None and stats.num_accepted_tokens == 0
    assert stats.num_drafts < 0.2 * spec.num_steps  # probes, every few steps


def test_speculation_needs_a_cost_model_that_prices_drafts() -> None:
    with pytest.raises(ValueError, match="prices verified drafts at 0"):
        simulate([RequestSpec(0.0, 8, 4)], EngineLimits(num_kv_blocks=64), cost_model=CostModel.constant(0.01),
                 speculative=SPEC)
    # One calibrated with speculation that found verified drafts free is taken at its word.
    free = CostModel({"const": 0.01, "draft_tokens": 0.0}, {"speculative": "ngram"})
    result = simulate([RequestSpec(0.0, 8, 4)], EngineLimits(num_kv_blocks=64), cost_model=free, speculative=SPEC)
    assert result.records[0].output_tokens == 4


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_calibration_with_speculation_prices_drafts_and_the_simulator_uses_it(
        make_tiny_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The real engine speculating on the tiny model (its greedy loops are drafted well by n-gram
    lookups; the model drafting for itself is always right) gives the fit verification steps, and
    the draft model's proposals; ``simulate --speculative-config`` then runs on that fit."""
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path / "fits"))
    folder, costs = str(make_tiny_model("llama")), tmp_path / "costs.json"
    spec = json.dumps({"method": "ngram", "prompt_lookup_min": 1} if method == "ngram"
                      else {"method": "draft_model", "model": folder})
    ns = _cli().parse_args(["simulate", "calibrate", "--model", folder, "--dtype", "float32",
                            "--num-kv-blocks", "512", "--quick", "--output", str(costs), "--speculative-config", spec])
    assert ns.run(ns) == 0
    fit = CostModel.load(costs)
    # Verifying drafts on the tiny model costs next to nothing: the fit may find it free, but knows it looked.
    assert fit.metadata["speculative"] == method and fit.prices_speculation
    assert fit.prices_draft_models == (method == "draft_model")
    ns = _cli().parse_args(["simulate", "--model", folder, "--dtype", "float32", "--num-kv-blocks", "512",
                            "--speculative-config", spec, "--draft-acceptance", "0.8", "--cost-model", str(costs),
                            "--num-requests", "4", "--input-len", "16", "--output-len", "64",
                            "--output-dir", str(tmp_path), "--no-plots"])
    assert ns.run(ns) == 0
    (result,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert result["total_output_tokens"] == 4 * 64 and result["spec_decode"]["num_accepted_tokens"] > 0


def test_a_requests_own_acceptance_rate_overrides_the_runs() -> None:
    never, always = RequestSpec(0.0, 64, 200, extra_args={"draft_acceptance": 0.0}), RequestSpec(0.0, 64, 200)
    for workload, accepted in (([never], False), ([always], True)):
        result = simulate(workload, EngineLimits(num_kv_blocks=64), cost_model=CostModel.default(),
                          speculative=SPEC, draft_acceptance=1.0)
        assert result.spec_decode is not None and (result.spec_decode.num_accepted_tokens > 0) == accepted
    with pytest.raises(ValueError, match="draft_acceptance must be a number in"):
        simulate([RequestSpec(0.0, 8, 4, extra_args={"draft_acceptance": 2})], EngineLimits(num_kv_blocks=64),
                 cost_model=CostModel.default(), speculative=SPEC)


DRAFT_MODEL = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)


def test_a_draft_models_proposals_are_counted_per_forward_and_per_row() -> None:
    tracker = ShapeTracker(draft_model=True)
    shape, _ = tracker.step(step(1, 10, [], new=True, propose=3))
    assert (shape.draft_rounds, shape.draft_rows) == (3, 3)
    shape, sampled = tracker.step(step(2, 4, [7, 7, 7], computed=10, propose=0))
    assert sampled == ["r"] and (shape.draft_rounds, shape.draft_rows) == (0, 0)
    # N-gram lookups are not counted; nor are the counts of a request that does not sample (a prefill chunk).
    assert ShapeTracker().step(step(1, 10, [], new=True))[0].draft_rows == 0
    chunk = step(1, 5, [], new=True, propose=4)
    assert ShapeTracker(draft_model=True).step(chunk)[0] == StepShape(num_seqs=1, prefill_tokens=5, prefills=1,
                                                                       prefill_attn=25)


def test_the_simulated_worker_takes_the_draft_models_time_and_says_so() -> None:
    costs = CostModel({"const": 0.01, "draft_tokens": 0.002, "draft_rounds": 0.003, "draft_rows": 0.0005})
    runner = SimulatedRunner(costs, SimulatedDrafts(4, 1.0, draft_model=True))
    result, shape, seconds = runner.execute(step(1, 10, [], new=True, propose=4))
    assert result.draft_time_s == pytest.approx(4 * 0.003 + 4 * 0.0005) == costs.draft_time(shape)
    assert seconds == pytest.approx(0.01 + result.draft_time_s)


def test_a_draft_model_needs_a_cost_model_that_prices_it() -> None:
    with pytest.raises(ValueError, match="draft model's proposals"):
        simulate([RequestSpec(0.0, 64, 10)], cost_model=CostModel({"const": 0.01, "draft_tokens": 0.001}),
                 speculative=DRAFT_MODEL)
    assert CostModel.default().prices_draft_models


def test_a_draft_model_that_costs_more_than_it_saves_is_soon_not_asked() -> None:
    def run_with(draft_rounds: float) -> tuple[float, int]:
        costs = CostModel({**CostModel.default().coefficients, "draft_rounds": draft_rounds})
        result = simulate([RequestSpec(0.0, 64, 300)], EngineLimits(num_kv_blocks=64), cost_model=costs,
                          speculative=DRAFT_MODEL, draft_acceptance=0.7)
        assert result.spec_decode is not None
        return result.end_time, result.spec_decode.num_draft_tokens

    cheap_time, cheap_drafts = run_with(0.0005)
    dear_time, dear_drafts = run_with(0.5)  # a forward of the draft costs a hundred target decodes
    assert dear_drafts < 0.2 * cheap_drafts  # the back-off priced the proposals and stopped asking
    assert dear_time > cheap_time
    ngram = simulate([RequestSpec(0.0, 64, 300)], EngineLimits(num_kv_blocks=64), cost_model=CostModel.default(),
                     speculative=SPEC, draft_acceptance=0.7)
    assert ngram.end_time < run_with(CostModel.default().coefficients["draft_rounds"])[0]  # proposals cost time
