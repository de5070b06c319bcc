"""The step budget's first cost model, timed on this machine before the engine core is ready.

The latency target (``core/step_budget.py``) sizes prefill chunks by what steps cost, and refits
that cost as the engine runs. Until its first refit it used the built-in fit, made on another
machine in bf16: on a 2-core AVX2 CPU in float32 that fit priced a decode at a third of its cost,
so the first burst after start was scheduled as if its streams' steps were short, and the refit
that followed a single request (a prompt, then one stream decoding) could not tell a decode's cost
from a step's. So after the warm-up the engine core times a few steps of the shapes the refit
learns, on its own workers: a prompt alone, one request decoding, and a batch decoding (and, where
the quantized kernel has a row limit, a batch within it, so that the fit learns the rows under the
limit apart: ``kernel_rows`` in ``core/cost_model.py``); and starts
the budget from their fit (the same :func:`~cadence.core.step_budget.refit` the running engine
uses; what these steps cannot separate keeps the built-in coefficients). docs/architecture.md,
"Scheduling".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cadence.config import EngineConfig
from cadence.core.cost_model import CostModel, StepShape
from cadence.core.scheduler import Scheduler
from cadence.core.step_budget import refit
from cadence.core.warm_up import scratch_scheduler
from cadence.executor.base import Executor
from cadence.messages import SchedulerOutput
from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.startup_log import startup

_PROMPT = 256  # the prompt timed alone: a chunk the size serving's steps carry beside decodes
_BATCH = 32  # the decode batch timed: serving's usual concurrency
_BATCH_PROMPT = 4
_NARROW_SHARE = 2  # the batch within the kernel's row limit: half the limit
_DECODES = 4  # decode steps timed of each batch: step times vary a few percent from one to the next
_MAX_STEPS = 64  # a guard: the scratch requests take a dozen steps
SOURCE = "timed at start"  # the fitted model's metadata["source"]


def fit_at_start(executor: Executor, config: EngineConfig, vocab_size: int,
                 windows: Sequence[int | None]) -> CostModel:
    """The cost model timed on ``executor``'s workers (see the module docstring)."""
    started = time.perf_counter()
    limit = executor.kernel_row_limit

    def timed(scheduler: Scheduler) -> tuple[SchedulerOutput, float]:
        begun = time.perf_counter()
        step = scheduler.schedule()
        scheduler.update_from_output(executor.execute_model(step))
        return step, time.perf_counter() - begun

    sched = config.scheduler
    limits = StartLimits(config.model.max_model_len, config.cache.block_size, sched.max_num_batched_tokens,
                         sched.max_num_seqs)
    model = fit_phases(lambda model: scratch_scheduler(executor, config, windows, model),
                       lambda free_blocks: start_phases(limits, vocab_size, free_blocks, limit), timed, limit)
    if model.metadata.get("source") != SOURCE:  # too few steps to fit (a tiny cache), or no convergence
        return model
    model = model.with_metadata(model=config.model.path, dtype=config.model.dtype)
    c = model.coefficients
    narrow = "" if limit is None else f", {1e3 * c['kernel_rows']:.2f} ms more a row up to {limit} rows"
    startup.info("step costs timed in %.1f s: %.1f ms a step, %.2f ms a prompt token, %.2f ms a decode%s",
                 time.perf_counter() - started, 1e3 * c["const"], 1e3 * c["prefill_tokens"], 1e3 * c["decode_seqs"],
                 narrow)
    return model


@dataclass(frozen=True)
class StartLimits:
    """The engine's limits the start fit's requests are sized to."""

    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


def fit_phases(scheduler_of: Callable[[CostModel], Scheduler], phases_of: Callable[[int], list[list[Request]]],
               step: Callable[[Scheduler], tuple[SchedulerOutput, float]], limit: int | None) -> CostModel:
    """The built-in model refitted (``core/step_budget.py``'s refit) to the steps of the phases (of the
    free blocks of a scratch scheduler, ``scheduler_of`` the built-in model) in turn, each run and timed
    by ``step``; the built-in model itself where the steps are too few to fit. The simulator prices the
    same steps with its cost model instead of timing them (``sim/start_model.py``), as its engines start."""
    builtin = CostModel.default().with_metadata(kernel_row_limit=limit)  # the shapes count kernel_rows with it
    scheduler = scheduler_of(builtin)
    shapes: list[StepShape] = []
    times: list[float] = []
    for requests in phases_of(scheduler.allocator.capacity_tokens // scheduler.allocator.block_size):
        for request in requests:
            scheduler.add_request(request)
        for _ in range(_MAX_STEPS):
            if not scheduler.has_work:
                break
            out, seconds = step(scheduler)
            shape = scheduler.last_shape
            # A step of several prompts is left out: its cost is their count's, which the fit does not learn.
            if out.num_scheduled_tokens and shape is not None and shape.prefills <= 1:
                shapes.append(shape)
                times.append(seconds)
    model = refit(builtin, np.array([s.features() for s in shapes]), np.array(times))
    if model is builtin:
        return builtin
    return CostModel(model.coefficients, {"source": SOURCE, "kernel_row_limit": limit})


def start_phases(limits: StartLimits, vocab_size: int, free_blocks: int, limit: int | None) -> list[list[Request]]:
    """A prompt alone (then it decodes alone), then a batch of short prompts that decode together,
    then (with a kernel row ``limit``) a batch of half the limit; sized to the token budget, the seats
    and ``free_blocks``."""
    max_len, block_size = limits.max_model_len, limits.block_size
    out = _DECODES + 1
    prompt = max(1, min(_PROMPT, limits.max_num_batched_tokens, max_len - out, free_blocks * block_size - out))
    per_request = -(-(_BATCH_PROMPT + out) // block_size)
    batch = max(1, min(_BATCH, limits.max_num_seqs, free_blocks // per_request,
                       limits.max_num_batched_tokens // _BATCH_PROMPT))
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)

    def request(i: int, length: int) -> Request:
        return Request(f"fit-{i}", [(11 * j + i + 1) % vocab_size for j in range(length)], params,
                       eos_token_id=None, arrival_time=0.0, max_model_len=max_len)

    sizes = [batch] if limit is None else [batch, max(2, min(batch, limit // _NARROW_SHARE))]
    phases, first = [[request(0, prompt)]], 1
    for size in sizes:
        phases.append([request(first + i, min(_BATCH_PROMPT, max_len - out)) for i in range(size)])
        first += size
    return phases
