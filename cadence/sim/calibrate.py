"""Calibration: time the real engine on a plan of workloads and fit the simulator's cost model.

The engine runs as it serves (actors, detokenizer, streaming clients) while a thin wrapper around
its executor (any of them: in process, or tensor-parallel workers) records when each step starts
and ends and what it computed. The simulator's clock advances by a step's whole cycle, model time
plus the engine loop around it, so the fit's target is the time from one step's start to the
next one's, taken while the engine stays busy.

The default plan covers the shapes a serving run produces in about a minute on SmolLM2 bf16 on
two cores: decode batches from 1 to ``max_num_seqs`` over short and long contexts (long shared
prefixes make big batches over long contexts cheap to set up), full prefill budgets, one long
prompt (the quadratic attention term), a burst with ShareGPT-like lengths (heavy-tailed prompts
and outputs: the varied contexts and prefill chunks beside big decode batches of a loaded server),
and Poisson streams (fast, then slow) that mix prefills with decodes as serving does.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cadence.core.cost_model import (
    DRAFT_FEATURES,
    FEATURES,
    CostModel,
    FitQuality,
    StepShape,
    fit_cost_model,
    fit_quality,
)
from cadence.core.engine_description import engine_description
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.sim.replay import replay
from cadence.sim.runner import ShapeTracker
from cadence.sim.workload import FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, LengthDist, RequestSpec, arrival_times

if TYPE_CHECKING:
    from cadence.engine.llm import LLM
    from cadence.executor import Executor


@dataclass(frozen=True)
class Phase:
    """One workload of the plan; phases run one after another, the engine idle in between."""

    name: str
    requests: list[RequestSpec]


@dataclass(frozen=True)
class TimedStep:
    phase: int
    start: float
    end: float
    shape: StepShape
    draft_s: float = 0.0  # a draft model's proposals, within start..end (ModelRunnerOutput.draft_time_s)


def default_plan(max_num_seqs: int = 128, max_model_len: int = 8192, seed: int = 0, quick: bool = False,
                 vocab_size: int = SYNTHETIC_VOCAB, prefix_caching: bool = True) -> list[Phase]:
    """Bursts of requests (all at once) of chosen shapes, then two Poisson streams.

    With prefix caching, two bursts share a long prompt prefix: big decode batches over long
    contexts (the KV reads of a loaded server) for the price of one prefill. ``quick`` is a plan
    of a few seconds for small models and tests: fewer, shorter requests.
    """

    rng = np.random.default_rng(seed)

    # Lengths vary by up to a quarter within a burst, as they do in serving: a decode batch whose
    # contexts differ takes the sdpa backend's masked (padded) path, as a server's batches do.
    def spread(length: int, count: int) -> list[int]:
        return rng.integers(max(1, length * 3 // 4), length * 5 // 4, size=count, endpoint=True).tolist()

    def burst(count: int, prompt: int, output: int) -> list[RequestSpec]:
        count = min(count, max_num_seqs)
        return [RequestSpec(0.0, max(1, min(p, max_model_len - output - 1)), output) for p in spread(prompt, count)]

    def shared(count: int, prefix: int, output: int) -> list[RequestSpec]:
        prefix = max(1, min(prefix, max_model_len - output - 1 - prefix // 4))
        common = rng.integers(FIRST_ORDINARY_ID, vocab_size, size=prefix).tolist()
        suffixes = spread(prefix // 8 + 1, min(count, max_num_seqs))
        return [RequestSpec(0.0, prefix + n, output, prompt_token_ids=tuple(
                    common + rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist())) for n in suffixes]

    def mixed_lengths(count: int, output_cap: int) -> list[RequestSpec]:
        # ShareGPT-like: lognormal prompts (mean 240) and outputs (mean 160), capped.
        prompts = np.minimum(LengthDist("lognormal", (240.0, 1.0)).sample(count, rng), max_model_len // 4)
        outputs = np.minimum(LengthDist("lognormal", (160.0, 0.8)).sample(count, rng), output_cap)
        return [RequestSpec(0.0, int(p), int(min(o, max_model_len - p - 1)))
                for p, o in zip(prompts, outputs, strict=True)]

    def stream(count: int, rate: float) -> list[RequestSpec]:
        times = arrival_times(count, rate, rng=rng)
        prompts = rng.integers(32, 512, size=count, endpoint=True)
        outputs = rng.integers(16, 96, size=count, endpoint=True)
        return [RequestSpec(float(t), max(1, min(int(p), max_model_len - int(o) - 1)), int(o))
                for t, p, o in zip(times, prompts, outputs, strict=True)]

    if quick:
        return [Phase("warm-up", burst(2, 16, 2)), Phase("decode x1", burst(1, 16, 8)),
                Phase("decode x8", burst(8, 64, 8)), Phase("decode x32", burst(32, 32, 8)),
                Phase("long prompt", burst(1, 400, 2)), Phase("mixed lengths", mixed_lengths(16, 16)),
                Phase("poisson mix", stream(12, 40.0))]
    return [
        Phase("warm-up", burst(2, 64, 4)),
        Phase("decode x1", burst(1, 32, 24)),
        Phase("decode x4", burst(4, 256, 24)),
        Phase("decode x16", burst(16, 128, 32)),
        Phase("decode x48", burst(48, 64, 32)),
        Phase("decode x128", burst(128, 24, 24)),
        Phase("long contexts x16", burst(16, 900, 16)),
        Phase("long prompt", burst(1, 2000, 4)),
        # Sized like a loaded server's decode batches. Much bigger ones (128 x 650 tokens, 83k KV
        # tokens read per step) cost 2x what the linear model says on 1 thread here: the reads
        # fall out of the CPU caches. The model keeps the range serving actually reaches.
        *([Phase("shared context x48", shared(48, 320, 24)), Phase("shared context x96", shared(96, 384, 24))]
          if prefix_caching else []),
        # A loaded server's steps: big decode batches over varied contexts, prefill chunks beside them.
        Phase("mixed lengths x64", mixed_lengths(min(64, max_num_seqs), 384)),
        # Serving-like steps: several prefills with decodes, then one prefill at a time.
        Phase("poisson mix", stream(30, 6.0)),
        Phase("slow poisson mix", stream(24, 2.5)),
    ]


class _TimingExecutor:
    """Stands in for the engine's executor (any of them): times each step and tracks its shape (the
    executor actor awaits its ``run_step``, one step at a time; the time includes the hand-off to
    the executor's thread and back, as the engine's step loop sees it)."""

    def __init__(self, executor: Executor, draft_model: bool) -> None:
        self.executor = executor
        self.tracker = ShapeTracker(draft_model, row_limit=executor.kernel_row_limit)
        self.steps: list[TimedStep] = []
        self.phase = 0

    async def run_step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        shape, _ = self.tracker.step(out)
        start = time.perf_counter()
        result = await self.executor.run_step(out)
        self.steps.append(TimedStep(self.phase, start, time.perf_counter(), shape, result.draft_time_s))
        self.tracker.settle(out, result)
        return result

    async def watch_workers(self) -> None:
        await self.executor.watch_workers()


@contextlib.contextmanager
def timing(engine: LLM) -> Iterator[_TimingExecutor]:
    """Time every step ``engine`` runs while the context is open (``timer.steps``)."""
    speculative = engine.config.speculative
    timer = _TimingExecutor(engine.engine_core.executor, speculative is not None and speculative.uses_draft_model)
    engine.engine_core.executor = cast("Executor", timer)
    try:
        yield timer
    finally:
        engine.engine_core.executor = timer.executor


def time_steps(engine: LLM, plan: Sequence[Phase], seed: int = 0,
               progress: Callable[[str], None] | None = None) -> list[TimedStep]:
    """Run every phase through ``engine`` and return each step's timing (phase 0 is warm-up)."""
    with timing(engine) as timer:
        for index, phase in enumerate(plan):
            timer.phase = index
            started = time.perf_counter()
            replay(engine, phase.requests, seed=seed + index)
            if progress is not None:
                progress(f"{phase.name}: {len(phase.requests)} requests in {time.perf_counter() - started:.1f} s")
    return timer.steps


def cycle_samples(steps: Sequence[TimedStep], skip_phases: Sequence[int] = (0,)) -> tuple[list[StepShape],
                                                                                     list[float], float]:
    """Shapes and cycle times (start to the next step's start) of steps the engine ran back to back.

    A pair whose gap between one step's end and the next one's start is far above the median gap
    spans an idle moment (nothing to run until an arrival) and is left out. Also returns the
    median gap, the engine loop's own time per step.
    """
    kept, cycles, median_gap = _cycles(steps, skip_phases)
    return [step.shape for step in kept], cycles, median_gap


def _cycles(steps: Sequence[TimedStep], skip_phases: Sequence[int]) -> tuple[list[TimedStep], list[float], float]:
    """:func:`cycle_samples` with the steps kept rather than their shapes."""
    pairs = [(a, b) for a, b in itertools.pairwise(steps)
             if a.phase == b.phase and a.phase not in skip_phases]
    gaps = np.array([b.start - a.end for a, b in pairs])
    median_gap = float(np.median(gaps)) if len(gaps) else 0.0
    limit = max(0.05, 10 * median_gap)
    kept = [(a, b) for (a, b), gap in zip(pairs, gaps, strict=True) if gap <= limit]
    return [a for a, _ in kept], [b.start - a.start for a, b in kept], median_gap


def calibrate(engine: LLM, plan: Sequence[Phase] | None = None, seed: int = 0,
              progress: Callable[[str], None] | None = None, quick: bool = False) -> tuple[CostModel, FitQuality]:
    """Time ``engine`` on ``plan`` (default :func:`default_plan`) and fit a cost model to it."""
    config = engine.config
    if plan is None:
        plan = default_plan(config.scheduler.max_num_seqs, config.model.max_model_len, seed, quick,
                            engine.limits.vocab_size, config.cache.enable_prefix_caching)
    started = time.perf_counter()
    steps = time_steps(engine, plan, seed, progress)
    return fit_timed_steps(engine, steps, wall_time_s=time.perf_counter() - started)


def fit_timed_steps(engine: LLM, steps: Sequence[TimedStep],
                    wall_time_s: float | None = None) -> tuple[CostModel, FitQuality]:
    """The cost model of :func:`time_steps`' timings, with where and how they were measured."""
    core = engine.engine_core
    return fit_steps(steps, engine_description(engine.config, core.hf_config, core.executor), wall_time_s)


def fit_steps(steps: Sequence[TimedStep], description: Mapping[str, Any], wall_time_s: float | None = None,
              skip_phases: Sequence[int] = (0,)) -> tuple[CostModel, FitQuality]:
    """The cost model of timed steps (phases in ``skip_phases`` left out: a warm-up), with the
    engine's ``description`` (``core/engine_description.py``) and how they were measured.

    A draft model's proposals are fitted apart, on the time the worker reports for them: the drafts
    asked after a step and those it verified move together (always, with a draft that is always
    right), so one fit of both would split their cost between them at random.

    :raises ValueError: with fewer back-to-back steps than features.
    """
    kept, cycles, median_gap = _cycles(steps, skip_phases)
    metadata = {**description, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "num_steps_timed": len(steps), "median_loop_gap_s": median_gap}
    shapes = [step.shape for step in kept]
    own = [cycle - step.draft_s for step, cycle in zip(kept, cycles, strict=True)]
    model, _ = fit_cost_model(shapes, own, features=[f for f in FEATURES if f not in DRAFT_FEATURES])
    coefficients = dict(model.coefficients)
    proposing = [step for step in kept if step.shape.draft_rounds and step.draft_s > 0]
    if len(proposing) >= len(DRAFT_FEATURES):
        fit, _ = fit_cost_model([step.shape for step in proposing], [step.draft_s for step in proposing],
                                features=DRAFT_FEATURES)
        coefficients.update(fit.coefficients)
    model = CostModel(coefficients)
    quality = fit_quality(model, shapes, cycles)
    metadata["fit"] = quality.to_dict()
    if wall_time_s is not None:
        metadata["calibration_wall_time_s"] = round(wall_time_s, 1)
    return CostModel(model.coefficients, metadata), quality
