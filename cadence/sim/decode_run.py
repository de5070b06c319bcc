"""The simulator's fast-forward: a run of decode-only steps taken in one call, as they would go one by one.

When nothing waits on an engine and every running request decodes (one token a step, ending only by
length), its next steps differ only in their contexts, each a token longer than in the step before:
their shapes, times, block allocations and tokens follow from the requests' lengths. A
:class:`DecodeRun` plans such steps up to the one that finishes a request (at its length) or the one
before a step that would find no free block, and commits its steps in stretches, each at once,
leaving what the steps one by one would have left: the requests' tokens and computed counts, the
allocator calls that do work (a block taken, a block filled and cached; at every other step
``allocate`` changes nothing), the runner's counts, the step budget's samples, the step records and
the chunk times, and at the last step's end the finishes. A request that arrives at the engine cuts
the run: the steps that began before it stand. Where the KV events are recorded (for a router that
follows the prefix caches), the run knows which cached hashes its block takes evict and at which
step, so a router can be told them before an arrival they could matter to. docs/research.md,
"Fast-forward".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cadence.core.cost_model import CostModel, StepShape, decode_shape
from cadence.core.scheduler import Scheduler
from cadence.messages import EngineCoreOutput
from cadence.request import Request, RequestStatus
from cadence.sim.runner import SIMULATED_TOKEN_ID, ShapeTracker

_MIN_STEPS = 2  # a shorter run saves nothing over a step


@dataclass(frozen=True)
class DecodeRun:
    """Up to ``len(durations)`` decode-only steps of ``requests`` (in the policy's running order)
    from ``starts[0]``; ``starts[j + 1]`` is step ``j``'s end."""

    requests: list[Request]
    tokens: np.ndarray  # each request's length when the run began
    starts: np.ndarray
    durations: np.ndarray
    kv_tokens: np.ndarray
    free_blocks: np.ndarray  # free blocks once each step is scheduled
    evictions: dict[int, int]  # cached hash -> the step that evicts it (with KV events recorded only)
    row_limit: int | None = None  # the cost model's (CostModel.row_limit): kernel_rows are counted with it

    @property
    def num_steps(self) -> int:
        return len(self.durations)

    def steps_begun_before(self, time: float) -> int:
        """How many of the run's steps had begun by ``time`` (a request arriving then waits for the next)."""
        return int(np.searchsorted(self.starts[:-1], time, side="left"))

    def steps_ended_before(self, time: float) -> int:
        """How many of the run's steps had ended by ``time`` (an arrival then is routed after their KV events)."""
        return int(np.searchsorted(self.starts[1:], time, side="left"))

    def shape(self, step: int) -> StepShape:
        return decode_shape(len(self.requests), int(self.kv_tokens[step]), self.row_limit)


def plan_decode_run(scheduler: Scheduler, cost_model: CostModel, now: float, max_steps: int,
                    noise: Callable[[int], np.ndarray] | None = None) -> DecodeRun | None:
    """The decode-only steps ``scheduler`` would run from ``now``, at most ``max_steps``; None when its
    next step is not one (something waits or prefills, a hook would need calling, a request could stop
    on a token) or fewer than two are ahead. ``noise`` gives the factors of the next steps' times
    (``sim/step_noise.py``), as many as asked for."""
    allocator = scheduler.allocator
    if (scheduler.waiting or not scheduler.running or not scheduler.policy.decodes_in_bulk
            or scheduler.trace is not None or scheduler.speculation is not None
            or scheduler.structured_output is not None or allocator.num_groups != 1
            or allocator.groups[0].sliding_window is not None
            or len(scheduler.running) > scheduler.config.max_num_batched_tokens):
        return None
    running = scheduler.running
    # Each request has sampled a token: the blocks a run fills then all hold generated tokens, which no
    # prompt holds (a prompt whose last token is still to compute could fill a block of its own).
    if any(r.num_tokens - r.num_computed_tokens != 1 or not r.num_output_tokens for r in running):
        return None
    # Up to the step that finishes the first request (its finish is applied at the run's end).
    num_steps = min(min(r.max_tokens - r.num_output_tokens for r in running), max_steps)
    if num_steps < _MIN_STEPS or not all(_ends_by_length(r) for r in running):
        return None
    requests = [scheduler.requests[view.request_id] for view in scheduler.policy.order_running(running)]
    tokens = np.array([r.num_tokens for r in requests], dtype=np.int64)
    step = np.arange(num_steps, dtype=np.int64)
    # Step j computes position tokens + j - 1 of each request: a new block where that starts one.
    takes_by_residue = np.bincount((1 - tokens) % allocator.block_size, minlength=allocator.block_size)
    free_blocks = allocator.num_free_blocks - np.cumsum(takes_by_residue[step % allocator.block_size])
    num_steps = int(np.searchsorted(-free_blocks, 0, side="right"))  # until a step finds none
    if num_steps < _MIN_STEPS:
        return None
    step = step[:num_steps]
    kv_tokens = int(tokens.sum()) + len(requests) * step
    durations = cost_model.decode_step_times(len(requests), kv_tokens)
    if noise is not None:
        durations = durations * noise(num_steps)
    starts = np.add.accumulate(np.concatenate(([now], durations)))  # each end as now + duration, in turn
    evictions: dict[int, int] = {}
    if allocator.enable_kv_events:  # the k-th block taken is the free list's k-th, whatever takes it
        take_steps = np.repeat(step, takes_by_residue[step % allocator.block_size]).tolist()
        evicted = allocator.eviction_order(len(take_steps))
        evictions = {h: s for h, s in zip(evicted, take_steps, strict=True) if h is not None}
    return DecodeRun(requests, tokens, starts, durations, kv_tokens, free_blocks[:num_steps], evictions,
                     cost_model.row_limit)


def _ends_by_length(request: Request) -> bool:
    """Whether the simulated token can stop ``request`` only by its length."""
    params = request.sampling_params
    return SIMULATED_TOKEN_ID not in params.stop_token_ids and (
        params.ignore_eos or request.eos_token_id != SIMULATED_TOKEN_ID)


def commit(run: DecodeRun, start: int, stop: int, scheduler: Scheduler, tracker: ShapeTracker,
           ) -> list[EngineCoreOutput]:
    """Leave ``scheduler`` (its requests, allocator and step budget) and the runner's ``tracker`` as
    the run's steps ``start`` to ``stop`` (exclusive, those before committed) one by one would, as of
    the end of step ``stop - 1``; the outputs of the requests that step finishes (the run's last step
    may). The caller records the steps and tokens."""
    allocator = scheduler.allocator
    block_size = allocator.block_size
    new_tokens = [SIMULATED_TOKEN_ID] * (stop - start)
    lengths = run.tokens.tolist()
    calls: list[tuple[int, int]] = []  # (step, index in the running order): the allocations that do work
    for i, (request, length) in enumerate(zip(run.requests, lengths, strict=True)):
        request.output_token_ids.extend(new_tokens)  # blocks are hashed only up to each call's position
        request.all_token_ids.extend(new_tokens)
        calls.extend((step, i) for step in range(_first(start, 1 - length, block_size), stop, block_size))
        if allocator.enable_prefix_caching:  # step j fills a block where its position ends one
            calls.extend((step, i) for step in range(_first(start, -length, block_size), stop, block_size))
    group = allocator.groups[0]  # the only one, without a window (the plan checked)
    for step, i in sorted(set(calls)):  # step j computes position length + j - 1: slots up to length + j
        if group.grow(run.requests[i], lengths[i] + step) is None:
            raise RuntimeError(f"a planned decode run found no free block for {run.requests[i].request_id!r}")
    for request, length in zip(run.requests, lengths, strict=True):
        request.num_computed_tokens = length - 1 + stop
    if scheduler.step_budget is not None:
        scheduler.step_budget.observe_decodes(len(run.requests), run.kv_tokens[start:stop], run.durations[start:stop])
    finished = scheduler.advance_decodes(stop - start, run.shape(stop - 1))
    tracker.advance_decodes([r.request_id for r in run.requests], stop - start, finished)
    if stop < run.num_steps:
        return []
    return scheduler.finish_requests([r.request_id for r in run.requests if r.num_output_tokens >= r.max_tokens],
                                     RequestStatus.FINISHED_LENGTH)


def _first(start: int, residue: int, block_size: int) -> int:
    """The first step from ``start`` that is ``residue`` modulo ``block_size``."""
    return start + (residue - start) % block_size
