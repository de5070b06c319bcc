"""The simulator: the real scheduler, policy and KV allocator driven on a virtual clock.

Each step runs the engine's own code path, ``Scheduler.schedule()`` -> a simulated runner ->
``Scheduler.update_from_output()``, and moves the clock by the cost model's time for the step.
Requests arrive when the clock passes their arrival time (an idle engine jumps to the next
arrival); tokens are stamped with the end of the step that produced them. There is no sleep, no
thread and no randomness beyond the seed, so a run is deterministic and fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cadence.bench.metrics import BenchmarkMetrics, RequestRecord, TenantShare, compute_metrics, tenant_shares
from cadence.config import SchedulerConfig
from cadence.core.cost_model import CostModel
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.scheduling_trace import SchedulingTrace
from cadence.engine_args import DEFAULT_TARGET_ITL_MS, DEFAULT_TOKEN_BUDGET
from cadence.messages import SchedulerOutput
from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.clock import Clock, VirtualClock
from cadence.policies.loader import load_policy
from cadence.request import Request
from cadence.sampling_params import SamplingParams
from cadence.sim.runner import SimulatedRunner
from cadence.sim.workload import RequestSpec

if TYPE_CHECKING:
    from cadence.config import EngineConfig

# Synthetic prompt ids are drawn above the ids most vocabularies keep for special tokens.
_FIRST_ORDINARY_ID = 100
_SYNTHETIC_VOCAB = 32000


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings a simulation needs: context length, KV pool and the scheduler's limits.

    A simulation models a server: the step's token budget and the inter-token latency target default
    to ``cadence serve``'s.
    """

    num_kv_blocks: int = 4096  # the null block included
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET["serving"]
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS["serving"]

    def __post_init__(self) -> None:
        self.scheduler_config()  # the scheduler's own checks, raised at the boundary
        if self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (one is the null block), got {self.num_kv_blocks}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be at least max_model_len ({self.max_model_len})")

    @classmethod
    def from_engine_config(cls, config: EngineConfig, num_kv_blocks: int | None = None) -> EngineLimits:
        """The limits a real engine with ``config`` would have. Without ``num_kv_blocks`` the pool is
        sized from the model's config the way the worker sizes it (no weights are loaded)."""
        if num_kv_blocks is None:
            from cadence.executor.worker import num_kv_blocks as size_pool
            from cadence.models.layers import head_dim_of
            from cadence.models.loader import load_hf_config

            hf = load_hf_config(config.model.path)
            num_kv_blocks = size_pool(config.cache, hf.num_hidden_layers, hf.num_key_value_heads, head_dim_of(hf),
                                      config.model.torch_dtype)
        sched = config.scheduler
        return cls(num_kv_blocks=num_kv_blocks, block_size=config.cache.block_size,
                   max_model_len=config.model.max_model_len, enable_prefix_caching=config.cache.enable_prefix_caching,
                   max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                   enable_chunked_prefill=sched.enable_chunked_prefill,
                   long_prefill_token_threshold=sched.long_prefill_token_threshold,
                   target_itl_ms=sched.target_itl_ms)

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

    def scheduler_config(self, policy: str = "fcfs", options: Mapping[str, str] | None = None) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               target_itl_ms=self.target_itl_ms, policy=policy, policy_options=dict(options or {}))

    def policy_context(self, clock: Clock | None = None) -> PolicyContext:
        """The context of a policy under these limits, on ``clock`` (a fresh virtual clock by
        default; :func:`simulate` puts every policy on the clock of its run)."""
        return PolicyContext.of(self.scheduler_config(), clock or VirtualClock())

    def check(self, spec: RequestSpec) -> None:
        """:raises ValueError: if the engine would reject this request (as the request manager does)."""
        if spec.prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {spec.request_id!r} has a {spec.prompt_tokens}-token prompt but "
                             f"max_model_len is {self.max_model_len}; raise --max-model-len or drop it")
        needed = min(spec.prompt_tokens + spec.output_tokens, self.max_model_len)
        if needed > self.kv_capacity_tokens:
            raise ValueError(f"request {spec.request_id!r} needs up to {needed} tokens of KV cache but the pool "
                             f"holds {self.kv_capacity_tokens}; raise --kv-cache-memory or --num-kv-blocks")


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


@dataclass
class SimResult:
    """What a simulation produced: per-request records (arrival order) and per-step records."""

    policy: str
    records: list[RequestRecord]
    steps: list[StepRecord]
    num_preemptions: int
    wall_time_s: float
    cost_model: CostModel
    limits: EngineLimits
    finish_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def end_time(self) -> float:
        return self.steps[-1].start + self.steps[-1].duration if self.steps else 0.0

    def metrics(self, goodput_slos_ms: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = (99.0,)) -> BenchmarkMetrics:
        return compute_metrics(self.records, goodput_slos_ms=goodput_slos_ms, percentiles=percentiles)

    def tenant_shares(self) -> list[TenantShare]:
        return tenant_shares(self.records)

    def step_arrays(self) -> dict[str, np.ndarray]:
        """Step records as columns (``start``, ``num_waiting``, ``kv_usage`` ...), for plots."""
        names = StepRecord.__slots__
        return {name: np.array([getattr(s, name) for s in self.steps]) for name in names}

    def summary(self, goodput_slos_ms: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = (50.0, 99.0)) -> dict[str, Any]:
        """Metrics, preemptions, tenant shares and run facts as one JSON-ready dict."""
        return {
            "policy": self.policy,
            **self.metrics(goodput_slos_ms, percentiles).to_dict(),
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "mean_kv_usage": float(np.mean([s.kv_usage for s in self.steps])) if self.steps else 0.0,
            "max_num_waiting": max((s.num_waiting for s in self.steps), default=0),
            "tenants": [vars(t) for t in self.tenant_shares()],
            "simulated_time_s": self.end_time,
            "wall_time_s": self.wall_time_s,
        }


StepHook = Callable[[Scheduler, SchedulerOutput], None]


def simulate(
    workload: Sequence[RequestSpec],
    limits: EngineLimits | None = None,
    policy: str | SchedulingPolicy = "fcfs",
    cost_model: CostModel | None = None,
    seed: int = 0,
    *,
    policy_options: Mapping[str, str] | None = None,
    label: str | None = None,
    on_step: StepHook | None = None,
    max_steps: int | None = None,
    trace_scheduling: str | Path | None = None,
) -> SimResult:
    """Run ``workload`` through the real scheduler under ``policy`` on a virtual clock.

    ``policy`` is an entry-point name (built with ``policy_options`` and the limits' context) or
    a policy object (used as is, its clock set to the run's; give each run a fresh one). Policies
    read the virtual clock, on the trace's timeline. ``cost_model`` defaults to the
    built-in SmolLM2 figures. ``seed`` draws the prompt token ids of specs that carry none (each
    request gets distinct ids, so nothing hits the prefix cache by chance). ``on_step`` is called
    after each ``schedule()`` with the scheduler and its output, before the step runs: property
    tests check invariants there. ``max_steps`` stops a run that makes no progress.
    ``trace_scheduling`` writes the engine's scheduling trace (``core/scheduling_trace.py``) of the
    run to that file, stamped with the virtual clock.

    :raises ValueError: for a request the engine would reject, or an unknown policy.
    :raises RuntimeError: if the scheduler stalls (nothing scheduled on an idle engine) or
        ``max_steps`` is exceeded.
    """
    limits = limits or EngineLimits()
    cost_model = cost_model or CostModel.default()
    for spec in workload:
        limits.check(spec)
    clock = VirtualClock()
    if isinstance(policy, str):
        name = policy
        policy = load_policy(policy, limits.policy_context(clock), policy_options)
    else:
        name = policy.name
        policy.context = replace(policy.context, clock=clock)  # the run's time, whatever it was built with
    allocator = KVCacheManager(limits.num_kv_blocks, limits.block_size, limits.enable_prefix_caching)
    trace = None if trace_scheduling is None else SchedulingTrace(trace_scheduling)
    scheduler = Scheduler(limits.scheduler_config(name, policy_options), allocator, policy, cost_model=cost_model,
                          trace=trace)
    run = _Run(workload, limits, scheduler, SimulatedRunner(cost_model), clock, seed, on_step, max_steps)
    started = time.perf_counter()
    try:
        run.run()
    finally:
        if trace is not None:
            trace.close()
    return SimResult(
        policy=label or name,
        records=run.records(),
        steps=run.steps,
        num_preemptions=scheduler.num_preemptions,
        wall_time_s=time.perf_counter() - started,
        cost_model=cost_model,
        limits=limits,
        finish_reasons=run.finish_reasons,
    )


class _Run:
    """One simulation's mutable state and its loop."""

    def __init__(self, workload: Sequence[RequestSpec], limits: EngineLimits, scheduler: Scheduler,
                 runner: SimulatedRunner, clock: VirtualClock, seed: int, on_step: StepHook | None,
                 max_steps: int | None) -> None:
        # Stable order by arrival; ids are the spec's or its index.
        self.specs = sorted(workload, key=lambda s: s.arrival_time)
        self.ids = [s.request_id if s.request_id is not None else str(i) for i, s in enumerate(self.specs)]
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("request ids in a workload must be unique")
        self.limits = limits
        self.scheduler = scheduler
        self.runner = runner
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.on_step = on_step
        self.max_steps = max_steps
        self.chunk_times: dict[str, list[float]] = {rid: [] for rid in self.ids}
        self.finish_reasons: dict[str, str] = {}
        self.steps: list[StepRecord] = []
        self._params: dict[int, SamplingParams] = {}

    def run(self) -> None:
        scheduler, runner, specs = self.scheduler, self.runner, self.specs
        allocator = scheduler.allocator
        chunk_times, finish_reasons, steps = self.chunk_times, self.finish_reasons, self.steps
        on_step, max_steps, clock = self.on_step, self.max_steps, self.clock
        now = specs[0].arrival_time if specs else 0.0
        next_arrival = 0
        while next_arrival < len(specs) or scheduler.num_unfinished:
            clock.time = now
            while next_arrival < len(specs) and specs[next_arrival].arrival_time <= now:
                scheduler.add_request(self._request(next_arrival))
                next_arrival += 1
            if not scheduler.num_unfinished:
                now = specs[next_arrival].arrival_time  # idle: jump to the next arrival
                continue
            out = scheduler.schedule()
            if not out.num_scheduled_tokens and not scheduler.running:
                raise RuntimeError(f"no waiting request can be scheduled on an idle engine: {scheduler.waiting[0]}")
            if on_step is not None:
                on_step(scheduler, out)
            result, shape, duration = runner.execute(out)
            steps.append(StepRecord(now, duration, shape.num_seqs, shape.num_tokens, shape.prefill_tokens,
                                    shape.decode_seqs, shape.kv_tokens, len(scheduler.running),
                                    len(scheduler.waiting), allocator.usage, scheduler.num_preemptions))
            now += duration
            clock.time = now  # the step's outputs are processed at its end
            scheduler.observe_step_time(duration)
            for output in scheduler.update_from_output(result):
                if output.new_token_ids:
                    chunk_times[output.request_id].append(now)
                if output.finish_reason is not None:
                    finish_reasons[output.request_id] = output.finish_reason
            if max_steps is not None and len(steps) > max_steps:
                raise RuntimeError(f"the simulation ran past {max_steps} steps without finishing")

    def _request(self, index: int) -> Request:
        spec = self.specs[index]
        if spec.prompt_token_ids is not None:
            prompt = list(spec.prompt_token_ids)
        else:
            prompt = self.rng.integers(_FIRST_ORDINARY_ID, _SYNTHETIC_VOCAB, size=spec.prompt_tokens).tolist()
        params = self._params.get(spec.output_tokens) if spec.extra_args is None else None
        if params is None:
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True,
                                    extra_args=None if spec.extra_args is None else dict(spec.extra_args))
            if spec.extra_args is None:
                self._params[spec.output_tokens] = params
        return Request(self.ids[index], prompt, params, eos_token_id=None, arrival_time=spec.arrival_time,
                       max_model_len=self.limits.max_model_len, priority=spec.priority, user=spec.user)

    def records(self) -> list[RequestRecord]:
        return [
            RequestRecord(arrival_time=spec.arrival_time, chunk_times=self.chunk_times[rid],
                          prompt_tokens=spec.prompt_tokens, output_tokens=len(self.chunk_times[rid]),
                          success=self.finish_reasons.get(rid) in ("length", "stop"), request_id=rid,
                          user=spec.user, priority=spec.priority)
            for spec, rid in zip(self.specs, self.ids, strict=True)
        ]
