"""The simulator: the real scheduler, policy and KV allocator driven on a virtual clock.

Each step runs the engine's own code path, ``Scheduler.schedule()`` -> a simulated runner ->
``Scheduler.update_from_output()``, and moves the clock by the cost model's time for the step.
Requests arrive when the clock passes their arrival time (an idle engine jumps to the next
arrival); tokens are stamped with the end of the step that produced them. There is no sleep, no
thread and no randomness beyond the seed, so a run is deterministic and fast.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from cadence.bench.metrics import BenchmarkMetrics, RequestRecord, TenantShare, compute_metrics, tenant_shares
from cadence.config import SchedulerConfig, SpeculativeConfig, check_hash_algo
from cadence.core.cost_model import CostModel
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.scheduling_trace import SchedulingTrace, ranked_path
from cadence.core.speculation import SpecDecoding
from cadence.engine.routers.base import Router, RouterContext, load_router
from cadence.engine_args import DEFAULT_TOKEN_BUDGET, EngineArgs
from cadence.messages import SpecDecodeStats
from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.clock import Clock, VirtualClock
from cadence.policies.loader import policy_class
from cadence.sim.dashboard_report import SimDashboard
from cadence.sim.run_loop import RunLoop, SimEngine, StepHook
from cadence.sim.runner import ACCEPTANCE_ARG, SimulatedDrafts, SimulatedRunner
from cadence.sim.start_model import start_model
from cadence.sim.step_log import StepLog, StepRecord
from cadence.sim.step_noise import StepNoise
from cadence.sim.workload import RequestSpec

if TYPE_CHECKING:
    from cadence.config import EngineConfig


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings a simulation needs: context length, KV pool and the scheduler's limits.

    The step's token budget and the inter-token latency target (off) default to the engine's, as
    ``cadence serve`` and ``LLM`` run it.
    """

    num_kv_blocks: int = 4096  # the null block included
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # the keys do not change a simulation's figures; xxhash is faster
    max_num_seqs: int = 128
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_prompts_per_step: int = 0
    target_itl_ms: float = EngineArgs.target_itl_ms

    def __post_init__(self) -> None:
        self.scheduler_config()  # the scheduler's own checks, raised at the boundary
        check_hash_algo(self.prefix_caching_hash_algo)
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
                   prefix_caching_hash_algo=config.cache.prefix_caching_hash_algo,
                   max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                   enable_chunked_prefill=sched.enable_chunked_prefill,
                   long_prefill_token_threshold=sched.long_prefill_token_threshold,
                   max_prompts_per_step=sched.max_prompts_per_step, target_itl_ms=sched.target_itl_ms)

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

    def scheduler_config(self, policy: str = "fcfs", options: Mapping[str, str] | None = None) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               max_prompts_per_step=self.max_prompts_per_step,
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


@dataclass
class SimResult:
    """What a simulation produced: per-request records (arrival order) and each engine's steps."""

    policy: str
    records: list[RequestRecord]
    engine_steps: list[StepLog]  # by rank
    num_preemptions: int
    wall_time_s: float
    cost_model: CostModel
    limits: EngineLimits
    finish_reasons: dict[str, str] = field(default_factory=dict)
    spec_decode: SpecDecodeStats | None = None  # with speculation: every engine's counts summed

    @functools.cached_property
    def steps(self) -> StepLog:
        """Every engine's steps, by start (then engine)."""
        return StepLog.merged(self.engine_steps)

    @property
    def num_steps(self) -> int:
        return sum(len(log) for log in self.engine_steps)

    @property
    def end_time(self) -> float:
        """When the last step to start ended."""
        last = max(((log[-1].start, log[-1].engine, log[-1].duration) for log in self.engine_steps if log),
                   default=None)
        return 0.0 if last is None else last[0] + last[2]

    def metrics(self, goodput_slos_ms: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = (99.0,)) -> BenchmarkMetrics:
        return compute_metrics(self.records, goodput_slos_ms=goodput_slos_ms, percentiles=percentiles)

    def _all(self, name: str) -> np.ndarray:
        """One field of every engine's steps, in no particular order (for sums and extremes)."""
        return np.concatenate([log.column(name) for log in self.engine_steps])

    def tenant_shares(self) -> list[TenantShare]:
        return tenant_shares(self.records)

    def step_arrays(self) -> dict[str, np.ndarray]:
        """Step records as columns (``start``, ``num_waiting``, ``kv_usage`` ...), by start, for plots."""
        return {name: np.array(self.steps.column(name)) for name in StepRecord.__slots__}

    def summary(self, goodput_slos_ms: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = (50.0, 99.0)) -> dict[str, Any]:
        """Metrics, preemptions, tenant shares and run facts as one JSON-ready dict."""
        return {
            "policy": self.policy,
            **self.metrics(goodput_slos_ms, percentiles).to_dict(),
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "mean_kv_usage": float(np.mean(self._all("kv_usage"))) if self.num_steps else 0.0,
            "max_num_waiting": int(self._all("num_waiting").max(initial=0)),
            "tenants": [vars(t) for t in self.tenant_shares()],
            "simulated_time_s": self.end_time,
            "wall_time_s": self.wall_time_s,
            **({} if self.spec_decode is None else {"spec_decode": msgspec.structs.asdict(self.spec_decode)}),
        }


def simulate(
    workload: Sequence[RequestSpec],
    limits: EngineLimits | None = None,
    policy: str | SchedulingPolicy = "fcfs",
    cost_model: CostModel | Sequence[CostModel] | None = None,
    seed: int = 0,
    *,
    policy_options: Mapping[str, str] | None = None,
    label: str | None = None,
    on_step: StepHook | None = None,
    max_steps: int | None = None,
    trace_scheduling: str | Path | None = None,
    engines: int = 1,
    router: str = "prefix-aware",
    speculative: SpeculativeConfig | None = None,
    draft_acceptance: float = 0.7,
    dashboard: SimDashboard | None = None,
    fast_forward: bool = True,
    step_time_noise: float = 0.0,
) -> SimResult:
    """Run ``workload`` through the real scheduler under ``policy`` on a virtual clock.

    ``policy`` is an entry-point name (built with ``policy_options`` and the limits' context) or
    a policy object (used as is, its clock set to the run's; give each run a fresh one). Policies
    read the virtual clock, on the trace's timeline. ``cost_model`` defaults to the built-in
    fallback. ``seed`` draws the prompt token ids of specs that carry none (each request gets
    distinct ids, so nothing hits the prefix cache by chance). ``on_step`` is called after each
    ``schedule()`` with the scheduler and its output, before the step runs: property tests check
    invariants there. ``max_steps`` stops a run that makes no progress. ``trace_scheduling``
    writes the scheduling trace (``core/scheduling_trace.py``) of the run to that file, stamped with
    the virtual clock (``FILE.dpRANK`` per engine of several).

    ``engines`` > 1 simulates a fleet: that many engines with these limits, each with its own
    scheduler, policy (by name) and KV allocator, and its own cost model when ``cost_model`` is a
    sequence of one per engine (heterogeneous machines), behind the data-parallel ``router``
    (an entry point in ``cadence.routers``, the real server's code) on one virtual clock.

    ``speculative`` turns speculative decoding on (docs/speculative_decoding.md): the scheduler drafts
    and backs off as the engine's does, the simulated worker proposes ``num_speculative_tokens`` drafts
    each step and a verification accepts each with probability ``draft_acceptance`` (up to the first
    rejection), or a request's own ``draft_acceptance`` extra arg; the cost model prices the drafts
    (its ``draft_tokens``).

    ``dashboard`` is fed the run as the live dashboard's feed is fed a server's (its snapshots make
    ``simulate --dashboard``'s report).

    ``fast_forward`` lets an engine take a run of decode-only steps in one call where the result is
    the same as step by step (``sim/decode_run.py``): with a policy that allows it, and not with a
    step hook, a scheduling trace, a dashboard or speculation. A router that follows the prefix
    caches is told the KV events of a run's steps before an arrival they could matter to. Off,
    every step is taken one by one.

    ``step_time_noise`` scales each step's modelled time by a factor of its own, lognormal with mean 1
    and this spread of its logarithm, seeded by ``seed`` and the engine (``sim/step_noise.py``): a
    real machine's steps vary, and the step budget refits to what they took. 0 keeps the exact times.

    :raises ValueError: for a request the engine would reject, an unknown policy or router, a
        policy object with several engines, or speculation with a cost model that prices no drafts.
    :raises RuntimeError: if a scheduler stalls (nothing scheduled on an idle engine) or
        ``max_steps`` is exceeded.
    """
    limits = limits or EngineLimits()
    models = list(cost_model) if isinstance(cost_model, Sequence) else [cost_model or CostModel.default()] * engines
    if len(models) != engines or engines < 1:
        raise ValueError(f"{engines} engine(s) need as many cost models, got {len(models)}")
    for spec in workload:
        limits.check(spec)
    if speculative is not None and not all(m.prices_speculation for m in models):
        raise ValueError("this cost model prices verified drafts at 0 (it was calibrated without speculative "
                         "decoding): calibrate with --speculative-config, or use --cost-model builtin")
    if speculative is not None and speculative.uses_draft_model and not all(m.prices_draft_models for m in models):
        raise ValueError("this cost model prices a draft model's proposals at 0 (it was calibrated without one): "
                         "calibrate with the same --speculative-config, or use --cost-model builtin")
    drafts = None if speculative is None else SimulatedDrafts(speculative.num_speculative_tokens, draft_acceptance,
                                                              draft_model=speculative.uses_draft_model)
    for spec in workload:
        rate = (spec.extra_args or {}).get(ACCEPTANCE_ARG)
        if rate is not None and not (isinstance(rate, int | float) and 0 <= rate <= 1):
            raise ValueError(f"request {spec.request_id!r}: extra_args {ACCEPTANCE_ARG} must be a number in [0, 1], "
                             f"got {rate!r}")
    if not isinstance(policy, str) and engines > 1:
        raise ValueError("a fleet needs a policy name (each engine builds its own), not a policy object")
    clock = VirtualClock()
    fleet = router_of(router, engines, limits, seed)
    sim_engines = []
    policy_type = policy_class(policy) if isinstance(policy, str) else None  # found once: a lookup scans every package
    # The step budgets' first models (none without a latency target: no step budget reads them).
    starts = {id(model): start_model(model, limits.scheduler_config(), limits.num_kv_blocks, limits.block_size,
                                     limits.max_model_len) for model in models} if limits.target_itl_ms else {}
    for rank, model in enumerate(models):
        if isinstance(policy, str):
            assert policy_type is not None
            name, engine_policy = policy, policy_type(limits.policy_context(clock), policy_options)
        else:
            name, engine_policy = policy.name, policy
            policy.context = replace(policy.context, clock=clock)  # the run's time, whatever it was built with
        allocator = KVCacheManager(limits.num_kv_blocks, limits.block_size, limits.enable_prefix_caching,
                                   enable_kv_events=fleet is not None and fleet.observes_prefix_caches,
                                   hash_algo=limits.prefix_caching_hash_algo)
        path = None if trace_scheduling is None else ranked_path(trace_scheduling, rank, engines)
        trace = None if path is None else SchedulingTrace(path)
        if trace is not None:
            trace.engine(_description(model, speculative), simulated=True)
        scheduler = Scheduler(limits.scheduler_config(name, policy_options), allocator, engine_policy,
                              cost_model=starts.get(id(model), model), trace=trace,
                              speculation=None if speculative is None else SpecDecoding(speculative))
        noise = StepNoise(step_time_noise, seed, rank) if step_time_noise else None
        sim_engines.append(SimEngine(rank, scheduler, SimulatedRunner(model, drafts, seed + rank), on_step,
                                     fast_forward, noise))
    run = RunLoop(workload, limits.max_model_len, sim_engines, fleet, clock, seed, max_steps, dashboard)
    started = time.perf_counter()
    try:
        run.run()
    finally:
        for engine in sim_engines:
            if engine.scheduler.trace is not None:
                engine.scheduler.trace.close()
    return SimResult(
        policy=label or name,
        records=run.records(),
        engine_steps=run.steps,
        num_preemptions=sum(e.scheduler.num_preemptions for e in sim_engines),
        wall_time_s=time.perf_counter() - started,
        cost_model=models[0],
        limits=limits,
        finish_reasons=run.finish_reasons,
        spec_decode=None if speculative is None else SpecDecodeStats.total(
            [e.scheduler.speculation.stats() for e in sim_engines if e.scheduler.speculation is not None]),
    )


def _description(model: CostModel, speculative: SpeculativeConfig | None) -> dict[str, Any]:
    """A simulated engine's trace header: its cost model's description of the engine it models."""
    described = {name: model.metadata.get(name) for name in ("model", "dtype", "quantization", "threads")}
    return {**described, "kernel_row_limit": model.row_limit,
            "speculative": None if speculative is None else speculative.method}


def router_of(name: str, engines: int, limits: EngineLimits, seed: int) -> Router | None:
    """The data-parallel router of a fleet; none for one engine (nothing to choose)."""
    if engines == 1:
        return None
    return load_router(name, RouterContext(engines, limits.block_size, limits.enable_prefix_caching, seed,
                                                 limits.prefix_caching_hash_algo))
