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
from cadence.core.kv_allocator import KVAllocator
from cadence.core.scheduler import Scheduler
from cadence.messages import EngineCoreOutput
from cadence.request import Request, RequestStatus
from cadence.sim.runner import SIMULATED_TOKEN_ID, ShapeTracker

_MIN_STEPS = 2  # a shorter run saves nothing over a step


@dataclass(slots=True)
class DecodeRun:
    """Up to ``len(durations)`` decode-only steps of ``requests`` (in the policy's running order)
    from ``starts[0]``; ``starts[j + 1]`` is step ``j``'s end. Not changed once planned (not frozen:
    a frozen dataclass's construction costs 1.4 µs more, and a fleet simulation plans two runs a request)."""

    requests: list[Request]
    tokens: list[int]  # each request's length when the run began
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
        return int(self.starts[:-1].searchsorted(time, side="left"))  # the method: a call less than np's

    def steps_ended_before(self, time: float) -> int:
        """How many of the run's steps had ended by ``time`` (an arrival then is routed after their KV events)."""
        return int(self.starts[1:].searchsorted(time, side="left"))

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
    num_steps = max_steps  # up to the step that finishes the first request (its finish is applied at the run's end)
    for r in scheduler.running:
        # Each request has sampled a token: the blocks a run fills then all hold generated tokens, which no
        # prompt holds (a prompt whose last token is still to compute could fill a block of its own).
        if r.num_tokens - r.num_computed_tokens != 1 or not r.num_output_tokens or not _ends_by_length(r):
            return None
        num_steps = min(num_steps, r.max_tokens - r.num_output_tokens)
    if num_steps < _MIN_STEPS:
        return None
    requests = [scheduler.requests[view.request_id] for view in scheduler.policy.order_running(scheduler.running)]
    lengths = [r.num_tokens for r in requests]
    # Step j computes position length + j - 1 of each request: a new block where that starts one, so
    # step j takes takes[j % block_size] blocks. Python, not numpy: a handful of requests.
    block_size = allocator.block_size
    takes = [0] * block_size
    for length in lengths:
        takes[(1 - length) % block_size] += 1
    num_steps = min(num_steps, _steps_with_blocks(takes, allocator.num_free_blocks))  # until a step finds none
    if num_steps < _MIN_STEPS:
        return None
    step = np.arange(num_steps, dtype=np.int64)
    taken = np.array(takes)[step % block_size]
    free_blocks = allocator.num_free_blocks - taken.cumsum()
    total = sum(lengths)
    kv_tokens = np.arange(total, total + len(lengths) * num_steps, len(lengths), dtype=np.int64)
    durations = cost_model.decode_step_times(len(requests), kv_tokens)
    if noise is not None:
        durations = durations * noise(num_steps)
    starts = np.add.accumulate(np.concatenate(([now], durations)))  # each end as now + duration, in turn
    evictions: dict[int, int] = {}
    if allocator.enable_kv_events:  # the k-th block taken is the free list's k-th, whatever takes it
        take_steps = np.repeat(step, taken).tolist()
        evicted = allocator.eviction_order(len(take_steps))
        evictions = {h: s for h, s in zip(evicted, take_steps, strict=True) if h is not None}
    return DecodeRun(requests, lengths, starts, durations, kv_tokens, free_blocks, evictions, cost_model.row_limit)


def _steps_with_blocks(takes: list[int], num_free: int) -> int:
    """How many steps find the blocks they take among ``num_free``, step j taking ``takes[j % len(takes)]``."""
    periods, left = divmod(num_free, sum(takes))  # sum(takes) > 0: each request takes a block a period
    num_steps = periods * len(takes)
    for num in takes:
        left -= num
        if left < 0:
            break
        num_steps += 1
    return num_steps


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
    lengths = run.tokens
    for request in run.requests:
        request.output_token_ids.extend(new_tokens)  # blocks are hashed only up to each call's position
        request.all_token_ids.extend(new_tokens)
    # Step j computes position length + j - 1: request i takes a block at the steps from its first one
    # on, block_size apart. In the steps' order the requests take by their first steps, round after round.
    firsts = [_first(start, 1 - length, block_size) for length in lengths]
    order = sorted(range(len(lengths)), key=firsts.__getitem__)  # ties: the running order (a stable sort)
    counts = [len(range(first, stop, block_size)) for first in firsts]  # the last round may leave some out
    rounds = min(counts)
    takers = order * rounds + [i for i in order if counts[i] > rounds]
    group = allocator.groups[0]  # the only one, without a window (the plan checked)
    if len(takers) > group.num_free_blocks:
        raise RuntimeError(f"a planned decode run found {group.num_free_blocks} free blocks for {len(takers)}")
    # Step stop - 1 ends with slots up to length + stop - 1; in one go when the calls' order cannot matter.
    if not group.grow_unordered(run.requests, takers, [length + stop - 1 for length in lengths]):
        _grow_in_turn(group, run.requests, lengths, start, stop)
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


def _grow_in_turn(group: KVAllocator, requests: list[Request], lengths: list[int], start: int, stop: int) -> None:
    """The allocations of steps ``start`` to ``stop`` that do work, one by one in the steps' order: the
    block takes, and with prefix caching the fills (step j fills a block where its position ends one)."""
    residues = [1, 0] if group.enable_prefix_caching else [1]
    calls = {(step, i) for i, length in enumerate(lengths) for residue in residues
             for step in range(_first(start, residue - length, group.block_size), stop, group.block_size)}
    for step, i in sorted(calls):  # step j computes position length + j - 1: slots up to length + j
        group.grow(requests[i], lengths[i] + step)


def _first(start: int, residue: int, block_size: int) -> int:
    """The first step from ``start`` that is ``residue`` modulo ``block_size``."""
    return start + (residue - start) % block_size
