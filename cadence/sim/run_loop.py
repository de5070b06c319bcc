"""The simulation's loop: arrivals and step ends on one virtual clock, for one engine or a fleet.

Each :class:`SimEngine` is one engine core: its own scheduler, policy, KV allocator and simulated
runner. A step is scheduled and run at once, but takes the cost model's time: its outputs are
applied at its end, and requests that arrive meanwhile join the scheduler mid-step, as they do in
the real engine. With several engines, each arrival goes where the real data-parallel router
(``engine/routers/``) sends it, given each engine's unfinished requests as its load; a router that
follows the prefix caches is told each engine's KV events at the end of each of its steps, as the
engine core folds them into its output batch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cadence.bench.metrics import RequestRecord
from cadence.core.kv_events import fold_kv_events
from cadence.core.scheduler import Scheduler
from cadence.engine.routers.base import Router
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.policies.clock import VirtualClock
from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.sim.dashboard_report import SimDashboard
from cadence.sim.runner import SimulatedRunner
from cadence.sim.workload import FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, RequestSpec

StepHook = Callable[[Scheduler, SchedulerOutput], None]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated step: when it ran, what it computed, and the engine's state after scheduling."""

    start: float
    duration: float
    num_seqs: int
    num_tokens: int
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int  # cumulative
    engine: int = 0


class SimEngine:
    """One simulated engine core, stepped by :class:`RunLoop`."""

    def __init__(self, rank: int, scheduler: Scheduler, runner: SimulatedRunner, on_step: StepHook | None) -> None:
        self.rank = rank
        self.scheduler = scheduler
        self.runner = runner
        self.on_step = on_step
        self.steps: list[StepRecord] = []
        self.busy_until: float | None = None  # the running step's end
        self._result: ModelRunnerOutput | None = None
        self.dashboard: SimDashboard | None = None

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    def start(self, now: float) -> float:
        """Schedule and run a step from ``now``; its end.

        :raises RuntimeError: if nothing can be scheduled on an idle engine.
        """
        scheduler = self.scheduler
        out = scheduler.schedule()
        if not out.num_scheduled_tokens and not scheduler.running:
            raise RuntimeError(f"no waiting request can be scheduled on an idle engine: {scheduler.waiting[0]}")
        if self.on_step is not None:
            self.on_step(scheduler, out)
        if self.dashboard is not None:
            self.dashboard.step_started(scheduler, out, now)
        self._result, shape, duration = self.runner.execute(out)
        self.steps.append(StepRecord(now, duration, shape.num_seqs, shape.num_tokens, shape.prefill_tokens,
                                     shape.decode_seqs, shape.kv_tokens, len(scheduler.running),
                                     len(scheduler.waiting), scheduler.allocator.usage, scheduler.num_preemptions,
                                     self.rank))
        self.busy_until = now + duration
        return self.busy_until

    def finish(self, chunk_times: dict[str, list[float]], num_tokens: dict[str, int],
               finish_reasons: dict[str, str]) -> None:
        """Apply the running step's outputs at its end (a chunk may carry several tokens: speculation)."""
        assert self._result is not None and self.busy_until is not None
        now, result = self.busy_until, self._result
        self.busy_until = self._result = None
        self.scheduler.observe_step_time(self.steps[-1].duration, result.draft_time_s)
        outputs = self.scheduler.update_from_output(result)
        for output in outputs:
            if output.new_token_ids:
                chunk_times[output.request_id].append(now)
                num_tokens[output.request_id] += len(output.new_token_ids)
            if output.finish_reason is not None:
                finish_reasons[output.request_id] = output.finish_reason
        if self.dashboard is not None:
            self.dashboard.step_finished(self.rank, self.scheduler, outputs, now)


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
        self.max_steps = max_steps
        self.chunk_times: dict[str, list[float]] = {rid: [] for rid in self.ids}
        self.num_tokens: dict[str, int] = dict.fromkeys(self.ids, 0)
        self.finish_reasons: dict[str, str] = {}
        self._params: dict[int, SamplingParams] = {}
        self.dashboard = dashboard
        for engine in self.engines:
            engine.dashboard = dashboard

    @property
    def steps(self) -> list[StepRecord]:
        """Every engine's steps, by start."""
        if len(self.engines) == 1:
            return self.engines[0].steps
        return sorted((s for e in self.engines for s in e.steps), key=lambda s: (s.start, s.engine))

    def run(self) -> None:
        specs, engines, clock = self.specs, self.engines, self.clock
        ends: list[tuple[float, int]] = []  # (step end, rank) of the busy engines
        next_arrival, num_steps = 0, 0
        while next_arrival < len(specs) or ends:
            arrival = specs[next_arrival].arrival_time if next_arrival < len(specs) else math.inf
            if ends and ends[0][0] < arrival:  # a step ends first; arrivals at its end join before the next
                now, rank = heapq.heappop(ends)
                clock.time = now
                engine = engines[rank]
                engine.finish(self.chunk_times, self.num_tokens, self.finish_reasons)
                self._tell_router(engine)
                started = [engine] if engine.load else []
            else:
                now = clock.time = arrival
                started = []  # idle engines that got a request: only arrivals give an idle engine work
                while next_arrival < len(specs) and specs[next_arrival].arrival_time <= now:
                    request = self._request(next_arrival)
                    if self.dashboard is not None:
                        self.dashboard.arrived(request.request_id, now)
                    engine = self._route(request)
                    engine.scheduler.add_request(request)
                    if engine.busy_until is None and engine not in started:
                        started.append(engine)
                    next_arrival += 1
            for engine in started:
                heapq.heappush(ends, (engine.start(now), engine.rank))
                num_steps += 1
            if self.max_steps is not None and num_steps > self.max_steps:
                raise RuntimeError(f"the simulation ran past {self.max_steps} steps without finishing")
            if self.dashboard is not None:
                self.dashboard.tick(now)
        if self.dashboard is not None:
            self.dashboard.finish(clock.time)

    def _route(self, request: Request) -> SimEngine:
        if self.router is None:
            return self.engines[0]
        return self.engines[self.router.choose([e.load for e in self.engines], request.prompt_token_ids)]

    def _tell_router(self, engine: SimEngine) -> None:
        if self.router is not None and self.router.observes_prefix_caches:
            delta = fold_kv_events(engine.scheduler.allocator.take_events())
            if delta is not None:
                self.router.apply(engine.rank, delta)

    def _request(self, index: int) -> Request:
        spec = self.specs[index]
        if spec.prompt_token_ids is not None:
            prompt = list(spec.prompt_token_ids)
        else:
            prompt = self.rng.integers(FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, size=spec.prompt_tokens).tolist()
        params = self._params.get(spec.output_tokens) if spec.extra_args is None else None
        if params is None:
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True,
                                    extra_args=None if spec.extra_args is None else dict(spec.extra_args))
            if spec.extra_args is None:
                self._params[spec.output_tokens] = params
        return Request(self.ids[index], prompt, params, eos_token_id=None, arrival_time=spec.arrival_time,
                       max_model_len=self.max_model_len, priority=spec.priority, user=spec.user)

    def records(self) -> list[RequestRecord]:
        return [
            RequestRecord(arrival_time=spec.arrival_time, chunk_times=self.chunk_times[rid],
                          prompt_tokens=spec.prompt_tokens, output_tokens=self.num_tokens[rid],
                          success=self.finish_reasons.get(rid) in ("length", "stop"), request_id=rid,
                          user=spec.user, priority=spec.priority)
            for spec, rid in zip(self.specs, self.ids, strict=True)
        ]
