"""The simulation's loop: arrivals and step ends on one virtual clock, for one engine or a fleet.

Each :class:`SimEngine` is one engine core: its own scheduler, policy, KV allocator and simulated
runner. A step is scheduled and run at once, but takes the cost model's time: its outputs are
applied at its end, and requests that arrive meanwhile join the scheduler mid-step, as they do in
the real engine. With several engines, each arrival goes where the real data-parallel router
(``engine/routers/``) sends it, given each engine's unfinished requests as its load; a router that
follows the prefix caches is told each engine's KV events at the end of each of its steps, as the
engine core folds them into its output batch. An engine whose next steps only decode may take them
as one :class:`~cadence.sim.decode_run.DecodeRun` (the fast-forward), which an arrival routed to it
cuts short.
"""

from __future__ import annotations

import heapq
import math
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from cadence.bench.metrics import RequestRecord
from cadence.core.block_hash import prompt_block_hashes
from cadence.core.kv_events import fold_kv_events
from cadence.core.scheduler import Scheduler
from cadence.engine.routers.base import Router
from cadence.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from cadence.policies.clock import VirtualClock
from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.sim.dashboard_report import SimDashboard
from cadence.sim.decode_run import DecodeRun, commit, plan_decode_run
from cadence.sim.runner import SIMULATED_TOKEN_ID, SimulatedRunner
from cadence.sim.step_log import StepLog, StepRecord
from cadence.sim.step_noise import StepNoise
from cadence.sim.workload import FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, RequestSpec

StepHook = Callable[[Scheduler, SchedulerOutput], None]
_DRAW_AHEAD = 1 << 16  # synthetic prompt tokens drawn at once


class SimEngine:
    """One simulated engine core, stepped by :class:`RunLoop`; with ``fast_forward``, runs of
    decode-only steps go in one call (not with a step hook or a dashboard, which see every step)."""

    def __init__(self, rank: int, scheduler: Scheduler, runner: SimulatedRunner, on_step: StepHook | None,
                 fast_forward: bool = False, noise: StepNoise | None = None) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.runner = runner
        self.noise = noise  # each step's time scaled by its own factor (simulate --step-time-noise)
        self.on_step = on_step
        self.fast_forward = fast_forward and on_step is None
        self.steps = StepLog()
        self.busy_until: float | None = None  # the running step's (or run's) end
        self.generation = 0  # moves when a run is cut: the loop's entry for its old end is stale
        self._result: ModelRunnerOutput | None = None
        self._duration = 0.0  # the running step's
        self._run: DecodeRun | None = None
        self._done = 0  # the run's steps applied so far
        self.dashboard: SimDashboard | None = None

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    def start(self, now: float, max_steps: int) -> float:
        """Schedule and run a step (or a run of at most ``max_steps`` decode-only steps) from ``now``; its end.

        :raises RuntimeError: if nothing can be scheduled on an idle engine.
        """
        scheduler = self.scheduler
        if self.fast_forward and self.dashboard is None:
            noise = None if self.noise is None else partial(self.noise.factors, len(self.steps))
            self._run, self._done = plan_decode_run(scheduler, self.runner.cost_model, now, max_steps, noise), 0
            if self._run is not None:
                self.busy_until = float(self._run.starts[-1])
                return self.busy_until
        out = scheduler.schedule()
        if not out.num_scheduled_tokens and not scheduler.running:
            raise RuntimeError(f"no waiting request can be scheduled on an idle engine: {scheduler.waiting[0]}")
        if self.on_step is not None:
            self.on_step(scheduler, out)
        if self.dashboard is not None:
            self.dashboard.step_started(scheduler, out, now)
        self._result, shape, duration = self.runner.execute(out)
        if self.noise is not None:
            factor = self.noise.factor(len(self.steps))
            duration *= factor
            self._result.draft_time_s *= factor  # the drafts' share of the step
        self._duration = duration
        self.steps.append(StepRecord(now, duration, shape.num_seqs, shape.num_tokens, shape.prefill_tokens,
                                     shape.decode_seqs, shape.kv_tokens, len(scheduler.running),
                                     len(scheduler.waiting), scheduler.allocator.usage, scheduler.num_preemptions,
                                     self.rank))
        self.busy_until = now + duration
        return self.busy_until

    def finish(self, chunk_times: dict[str, array[float]], num_tokens: dict[str, int],
               finish_reasons: dict[str, str]) -> None:
        """Apply the running step's outputs at its end (a chunk may carry several tokens: speculation)."""
        if self._run is not None:
            for output in self._commit(self._run.num_steps, chunk_times, num_tokens):
                if output.finish_reason is not None:
                    finish_reasons[output.request_id] = output.finish_reason
            self._run = None
        if self._result is None:  # a run, committed now or when it was cut
            self.busy_until = None
            return
        assert self.busy_until is not None
        now, result = self.busy_until, self._result
        self.busy_until = self._result = None
        self.scheduler.observe_step_time(self._duration, result.draft_time_s)
        outputs = self.scheduler.update_from_output(result)
        for output in outputs:
            if output.new_token_ids:
                chunk_times[output.request_id].append(now)
                num_tokens[output.request_id] += len(output.new_token_ids)
            if output.finish_reason is not None:
                finish_reasons[output.request_id] = output.finish_reason
        if self.dashboard is not None:
            self.dashboard.step_finished(self.rank, self.scheduler, outputs, now)

    def catch_up(self, time: float, chunk_times: dict[str, array[float]], num_tokens: dict[str, int]) -> None:
        """Apply the steps of the run (if one is going) that ended before ``time``; it goes on (its last
        step, whose end is the run's, is applied by :meth:`finish`)."""
        run = self._run
        if run is not None:
            self._commit(min(run.steps_ended_before(time), run.num_steps - 1), chunk_times, num_tokens)

    def evicts_before(self, hashes: Iterable[int], time: float) -> bool:
        """Whether a step of the run not applied yet, ended before ``time``, evicted one of ``hashes``."""
        run = self._run
        if run is None:
            return False
        steps = [run.evictions.get(h) for h in hashes]
        return any(s is not None and s >= self._done and run.starts[s + 1] < time for s in steps)

    @property
    def in_run(self) -> bool:
        """Whether a run of decode-only steps is going (its KV events are told as its steps are applied)."""
        return self._run is not None

    def cut(self, time: float, chunk_times: dict[str, array[float]], num_tokens: dict[str, int]) -> float | None:
        """Before a request that arrives at ``time`` joins: end the run after the steps begun by then
        (their outputs applied; call :meth:`catch_up` first for those that ended, whose KV events a
        router must hear now); the end of the last of those. None when all had begun: the run goes
        on, and the request joins after it as after a cut."""
        run = self._run
        assert run is not None
        num_steps = run.steps_begun_before(time)
        if num_steps == run.num_steps:
            return None
        self._commit(num_steps, chunk_times, num_tokens)
        self._run = None
        self.busy_until = float(run.starts[num_steps])
        self.generation += 1
        return self.busy_until

    def _commit(self, stop: int, chunk_times: dict[str, array[float]], num_tokens: dict[str, int],
                ) -> list[EngineCoreOutput]:
        """Apply the run's steps up to ``stop`` (exclusive) from the first not applied yet; the outputs
        of the requests that finish."""
        run, start = self._run, self._done
        assert run is not None
        if stop <= start:
            return []
        self._done = stop
        finished = commit(run, start, stop, self.scheduler, self.runner.tracker)
        ends = run.starts[start + 1:stop + 1].tobytes()
        for request in run.requests:
            chunk_times[request.request_id].frombytes(ends)
            num_tokens[request.request_id] += stop - start
        usage = 1.0 - run.free_blocks[start:stop] / (self.scheduler.allocator.num_blocks - 1)
        self.steps.extend_decodes(run.starts[start:stop], run.durations[start:stop], run.kv_tokens[start:stop], usage,
                                  len(run.requests), self.scheduler.num_preemptions, self.rank)
        return finished


class RunLoop:
    """One simulation's mutable state and its loop."""

    def __init__(self, workload: Sequence[RequestSpec], max_model_len: int, engines: Sequence[SimEngine],
                 router: Router | None, clock: VirtualClock, seed: int, max_steps: int | None,
                 dashboard: SimDashboard | None = None) -> None:
        # Stable order by arrival; ids are the spec's or its index.
        self.specs = sorted(workload, key=lambda s: s.arrival_time)
        self.ids = [s.request_id if s.request_id is not None else str(i) for i, s in enumerate(self.specs)]
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("request ids in a workload must be unique")
        self.max_model_len = max_model_len
        self.engines = list(engines)
        self.router = router
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self._drawn = np.empty(0, dtype=np.int64)  # synthetic prompt tokens drawn ahead (_synthetic_prompt)
        self._next_drawn = 0
        self.max_steps = max_steps
        # Doubles, not lists of floats: a million requests' tokens are a hundred million times.
        self.chunk_times: dict[str, array[float]] = {rid: array("d") for rid in self.ids}
        self.num_tokens: dict[str, int] = dict.fromkeys(self.ids, 0)
        self.finish_reasons: dict[str, str] = {}
        self._params: dict[int, SamplingParams] = {}
        self.dashboard = dashboard
        for engine in self.engines:
            engine.dashboard = dashboard
        self._loads = [0] * len(self.engines)  # each engine's unfinished requests, kept as they change
        # The router that follows the prefix caches (and so must hear the engines' KV events), if any.
        self._cache_router = router if router is not None and router.observes_prefix_caches else None

    @property
    def steps(self) -> list[StepLog]:
        """Each engine's steps."""
        return [engine.steps for engine in self.engines]

    def run(self) -> None:
        specs, engines, clock = self.specs, self.engines, self.clock
        ends: list[tuple[float, int, int]] = []  # (step end, rank, generation) of the busy engines
        next_arrival = 0
        while next_arrival < len(specs) or ends:
            arrival = specs[next_arrival].arrival_time if next_arrival < len(specs) else math.inf
            if ends and ends[0][0] < arrival:  # a step ends first; arrivals at its end join before the next
                now, rank, generation = heapq.heappop(ends)
                engine = engines[rank]
                if generation != engine.generation:
                    continue  # the end of a run that was cut
                clock.time = now
                engine.finish(self.chunk_times, self.num_tokens, self.finish_reasons)
                self._loads[rank] = engine.load
                self._tell_router(engine)
                started = [engine] if engine.load else []
            else:
                now = clock.time = arrival
                started = []  # idle engines that got a request: only arrivals give an idle engine work
                while next_arrival < len(specs) and specs[next_arrival].arrival_time <= now:
                    request = self._request(next_arrival)
                    if self.dashboard is not None:
                        self.dashboard.arrived(request.request_id, now)
                    self._tell_before(request, now)
                    engine = self._route(request)
                    if engine.in_run:  # the request joins at the next step's start
                        if self._cache_router is not None:  # the steps that ended first: it hears them now
                            engine.catch_up(now, self.chunk_times, self.num_tokens)
                            self._tell_router(engine)
                        end = engine.cut(now, self.chunk_times, self.num_tokens)
                        if end is not None:
                            heapq.heappush(ends, (end, engine.rank, engine.generation))
                    engine.scheduler.add_request(request)
                    self._loads[engine.rank] = engine.load
                    if engine.busy_until is None and engine not in started:
                        started.append(engine)
                    next_arrival += 1
            for engine in started:
                heapq.heappush(ends, (engine.start(now, self._steps_left()), engine.rank, engine.generation))
            if self._steps_left() < 0:
                raise RuntimeError(f"the simulation ran past {self.max_steps} steps without finishing")
            if self.dashboard is not None:
                self.dashboard.tick(now)
        if self.dashboard is not None:
            self.dashboard.finish(clock.time)

    def _steps_left(self) -> int:
        """Steps the run may still take before ``max_steps`` (all it wants without one)."""
        if self.max_steps is None:
            return sys.maxsize
        return self.max_steps - sum(len(engine.steps) for engine in self.engines)

    def _route(self, request: Request) -> SimEngine:
        if self.router is None:
            return self.engines[0]
        return self.engines[self.router.choose(self._loads, request.prompt_token_ids)]

    def _tell_before(self, request: Request, now: float) -> None:
        """Tell a router that follows the prefix caches what it could route ``request`` by that runs'
        steps ended before ``now`` changed: a run's block takes evict cached blocks (known when it was
        planned), and its fills cache blocks of generated tokens, which only a prompt holding the
        simulated token can match."""
        router = self._cache_router
        if router is None:
            return
        running = [engine for engine in self.engines if engine.in_run]
        if not running:
            return
        prompt = request.prompt_token_ids
        anything = SIMULATED_TOKEN_ID in prompt
        context = router.context
        hashes = [] if anything else list(prompt_block_hashes(prompt, context.block_size, request.cache_salt,
                                                              context.hash_algo))
        for engine in running:
            if anything or engine.evicts_before(hashes, now):
                engine.catch_up(now, self.chunk_times, self.num_tokens)
                self._tell_router(engine)

    def _tell_router(self, engine: SimEngine) -> None:
        if self._cache_router is not None:
            delta = fold_kv_events(engine.scheduler.allocator.take_events())
            if delta is not None:
                self._cache_router.apply(engine.rank, delta)

    def _request(self, index: int) -> Request:
        spec = self.specs[index]
        if spec.prompt_token_ids is not None:
            prompt = list(spec.prompt_token_ids)
        else:
            prompt = self._synthetic_prompt(spec.prompt_tokens)
        params = self._params.get(spec.output_tokens) if spec.extra_args is None else None
        if params is None:
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True,
                                    extra_args=None if spec.extra_args is None else dict(spec.extra_args))
            if spec.extra_args is None:
                self._params[spec.output_tokens] = params
        return Request(self.ids[index], prompt, params, eos_token_id=None, arrival_time=spec.arrival_time,
                       max_model_len=self.max_model_len, priority=spec.priority, user=spec.user)

    def _synthetic_prompt(self, num: int) -> list[int]:
        """``num`` random token ids, the ones a draw per prompt would give: the generator draws bounded
        64-bit integers one after another whatever the calls (a call per prompt cost more than
        building the rest of its request)."""
        start, end = self._next_drawn, self._next_drawn + num
        if end > len(self._drawn):
            fresh = self.rng.integers(FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, size=max(num, _DRAW_AHEAD), dtype=np.int64)
            self._drawn, start, end = np.concatenate((self._drawn[start:], fresh)), 0, num
        self._next_drawn = end
        return self._drawn[start:end].tolist()

    def records(self) -> list[RequestRecord]:
        return [
            RequestRecord(arrival_time=spec.arrival_time, chunk_times=self.chunk_times[rid],
                          prompt_tokens=spec.prompt_tokens, output_tokens=self.num_tokens[rid],
                          success=self.finish_reasons.get(rid) in ("length", "stop"), request_id=rid,
                          user=spec.user, priority=spec.priority)
            for spec, rid in zip(self.specs, self.ids, strict=True)
        ]
