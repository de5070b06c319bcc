"""The latency target's first cost model, timed on the engine's own workers before ready."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import cadence.core.start_fit as start_fit
from cadence.config import EngineConfig
from cadence.core.cost_model import CostModel, StepShape, kernel_rows
from cadence.core.engine_core import EngineCore
from cadence.core.scheduler import Scheduler
from cadence.engine_args import EngineArgs
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.models.kv_groups import kv_cache_groups_of
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.start_model import start_model
from cadence.sim.workload import RequestSpec

# 4 ms a step, 1.5 ms a prompt token, 3 ms a decode: nothing like the built-in fit.
TRUTH = CostModel({"const": 0.004, "prefill_tokens": 0.0015, "decode_seqs": 0.003})
# The same with 2 ms more a row up to 8 rows (a quantized kernel's row limit).
LIMITED = CostModel({**TRUTH.coefficients, "kernel_rows": 0.002}, {"kernel_row_limit": 8})


class _TimedExecutor:
    """The tiny model's executor, whose steps take ``truth``'s time on a clock of their own (with its
    row limit as the workers' quantized kernel's)."""

    def __init__(self, executor: Any, truth: CostModel = TRUTH) -> None:
        self.executor, self.num_blocks, self.now = executor, executor.num_blocks, 0.0
        self.truth, self.kernel_row_limit = truth, truth.row_limit
        self.shapes: list[StepShape] = []

    def perf_counter(self) -> float:
        return self.now

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        prompts = [step.num_scheduled_tokens[r.request_id] for r in step.new_requests]
        decodes = [r.num_computed_tokens + 1 for r in step.cached_requests]
        rows = sum(prompts) + len(decodes)
        shape = StepShape(num_seqs=len(prompts) + len(decodes), prefill_tokens=sum(prompts), decode_seqs=len(decodes),
                          kv_tokens=sum(decodes), prefills=len(prompts), sampled=len(prompts) + len(decodes),
                          kernel_rows=kernel_rows(rows, self.kernel_row_limit))
        if shape.num_seqs:
            self.shapes.append(shape)
        self.now += self.truth.step_time(shape)
        return self.executor.execute_model(step)


def _core(make_tiny_model: Callable[..., Path], **overrides: Any) -> EngineCore:
    return EngineCore.build(EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_threads=1,
                                       **overrides).create_config())


def _timed_fit(make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
               truth: CostModel) -> tuple[CostModel, _TimedExecutor, EngineConfig]:
    """The start fit on the tiny model's workers whose steps take ``truth``'s time; their shapes; the config."""
    core = _core(make_tiny_model, target_itl_ms=100.0, num_kv_blocks=64)
    try:
        timed = _TimedExecutor(core.executor, truth)
        monkeypatch.setattr(start_fit, "time", SimpleNamespace(perf_counter=timed.perf_counter))
        groups = kv_cache_groups_of(core.hf_config, core.config.cache.hybrid_kv_cache)
        model = start_fit.fit_at_start(timed, core.config, core.hf_config.vocab_size, groups.windows)  # type: ignore[arg-type]
        return model, timed, core.config
    finally:
        core.shutdown()


def test_the_fit_recovers_the_workers_step_costs_from_a_prompt_and_two_decode_batches(
        make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    core = _core(make_tiny_model, target_itl_ms=100.0, num_kv_blocks=64)
    try:
        timed = _TimedExecutor(core.executor)
        monkeypatch.setattr(start_fit, "time", SimpleNamespace(perf_counter=timed.perf_counter))
        groups = kv_cache_groups_of(core.hf_config, core.config.cache.hybrid_kv_cache)
        model = start_fit.fit_at_start(timed, core.config, core.hf_config.vocab_size, groups.windows)  # type: ignore[arg-type]
        # A 256-token prompt alone, one request decoding, 32 decoding (after their prompts' step).
        assert [(s.prefill_tokens, s.decode_seqs) for s in timed.shapes] == (
            [(256, 0)] + [(0, 1)] * 4 + [(32 * 4, 0)] + [(0, 32)] * 4)
        for name in ("const", "prefill_tokens", "decode_seqs"):
            assert model.coefficients[name] == pytest.approx(TRUTH.coefficients[name], rel=1e-6)
        assert model.coefficients["kv_tokens"] == pytest.approx(0.0, abs=1e-12)
        assert model.metadata["source"] == start_fit.SOURCE
        assert core.executor.worker.runner.states == {}  # the scratch requests are gone
    finally:
        core.shutdown()


def test_under_a_kernel_row_limit_a_batch_within_it_is_timed_too_and_its_rows_priced_apart(
        make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, timed, _ = _timed_fit(make_tiny_model, monkeypatch, LIMITED)
    # Then 4 requests (half the limit) decoding together.
    assert [(s.prefill_tokens, s.decode_seqs) for s in timed.shapes] == (
        [(256, 0)] + [(0, 1)] * 4 + [(32 * 4, 0)] + [(0, 32)] * 4 + [(4 * 4, 0)] + [(0, 4)] * 4)
    for name in ("const", "prefill_tokens", "decode_seqs", "kernel_rows"):
        assert model.coefficients[name] == pytest.approx(LIMITED.coefficients[name], rel=1e-6)
    assert model.row_limit == 8


def test_an_engine_with_a_latency_target_starts_it_from_the_fit_and_one_without_times_nothing(
        make_tiny_model: Callable[..., Path]) -> None:
    targeted = _core(make_tiny_model, target_itl_ms=100.0, num_kv_blocks=64)
    try:
        assert targeted.scheduler.step_budget is not None
        assert targeted.scheduler.step_budget.model.metadata["source"] == start_fit.SOURCE
        assert not targeted.scheduler.requests and targeted.scheduler.allocator.num_free_blocks == 63
    finally:
        targeted.shutdown()
    untargeted = _core(make_tiny_model, num_kv_blocks=64)  # the default: no latency target
    try:
        assert untargeted.scheduler.step_budget is None
    finally:
        untargeted.shutdown()


def test_a_simulated_engine_starts_from_the_model_the_engine_s_start_fit_makes_of_the_same_step_times(
        make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator prices the start fit's steps with its cost model where the engine times them:
    with steps that take the cost model's time, both begin their latency target from one model."""
    engine, _, config = _timed_fit(make_tiny_model, monkeypatch, LIMITED)
    limits = EngineLimits.from_engine_config(config, num_kv_blocks=64)
    simulated = start_model(LIMITED, limits.scheduler_config(), 64, limits.block_size, limits.max_model_len)
    assert simulated.coefficients == pytest.approx(dict(engine.coefficients), rel=1e-9, abs=1e-15)
    assert simulated.row_limit == engine.row_limit == 8 and simulated.metadata["source"] == start_fit.SOURCE
    # And each simulated engine's step budget starts from it.
    first: list[CostModel] = []

    def on_step(scheduler: Scheduler, _: SchedulerOutput) -> None:
        if not first and scheduler.step_budget is not None:
            first.append(scheduler.step_budget.model)

    simulate([RequestSpec(0.0, 40, 4)], limits, "fcfs", LIMITED, on_step=on_step)
    assert first == [simulated]
