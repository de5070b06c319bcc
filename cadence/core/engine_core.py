"""The engine core: the executor (and through it the workers), the KV allocator and the scheduler.

They live as long as the :class:`EngineCore`; the actors that move messages between them are made
fresh by :meth:`EngineCore.actors` for each run, in the engine-core process
(:mod:`cadence.core.core_process`) or, for offline generation and tests, in the caller's process
(:class:`cadence.engine.core_client.InProcessCoreClient`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from cadence.config import EngineConfig
from cadence.core.engine_description import engine_description
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.scheduler_actor import SchedulerActor
from cadence.core.scheduling_trace import SchedulingTrace, ranked_path
from cadence.core.speculation import SpecDecoding
from cadence.core.start_fit import fit_at_start
from cadence.core.step_timing import StepTiming
from cadence.core.structured_output import StructuredOutputManager
from cadence.core.warm_up import warm_up
from cadence.executor import Executor, create_executor
from cadence.executor.actor import ExecutorActor
from cadence.executor.base import UniExecutor
from cadence.executor.worker import Worker
from cadence.lora.adapter import AdapterLimits
from cadence.models.kv_groups import kv_cache_groups_of
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.policies.base import PolicyContext
from cadence.policies.clock import WallClock
from cadence.policies.loader import load_policy
from cadence.request import RequestStatus
from cadence.runtime.actor import Mailbox


@dataclass
class EngineCore:
    """The engine-core side: executor (and through it the workers), KV allocator and scheduler."""

    config: EngineConfig
    hf_config: PretrainedConfig
    executor: Executor
    allocator: KVCacheManager
    scheduler: Scheduler
    timing: StepTiming = field(default_factory=StepTiming)

    @classmethod
    def build(cls, config: EngineConfig) -> EngineCore:
        """Load the policy, the model (on every worker) and size the KV cache.

        :raises ValueError: for a policy name or option that does not exist, or a model that
            cannot be split over the tensor-parallel ranks.
        :raises WorkerError: a worker failed to start.
        """
        sched = config.scheduler
        # Fail on a bad policy name before the (slower) model load.
        policy = load_policy(sched.policy, PolicyContext.of(sched, WallClock()), sched.policy_options)
        hf_config = load_hf_config(config.model.path)
        executor = create_executor(config, hf_config)
        # One allocator per KV cache group, as the workers laid out their caches.
        groups = kv_cache_groups_of(hf_config, config.cache.hybrid_kv_cache)
        warm_up(executor, config, hf_config, groups.windows)
        # The latency target's step costs, timed on these workers (whole-prefill policies ignore it).
        costs = (fit_at_start(executor, config, hf_config.vocab_size, groups.windows)
                 if sched.target_itl_ms and policy.chunked else None)
        allocator = KVCacheManager(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                   windows=groups.windows, hash_algo=config.cache.prefix_caching_hash_algo)
        # Loads the tokenizer and xgrammar only when the first constrained request arrives.
        grammars = StructuredOutputManager(functools.partial(load_tokenizer, config.model.path), hf_config.vocab_size)
        speculation = None if config.speculative is None else SpecDecoding(config.speculative)
        trace = scheduling_trace_of(config)
        if trace is not None:
            trace.engine(engine_description(config, hf_config, executor), simulated=False)
        return cls(config, hf_config, executor, allocator, Scheduler(sched, allocator, policy, grammars, costs,
                                                                     trace=trace, speculation=speculation))

    def actors(self, outputs_to: Mailbox[Any]) -> tuple[SchedulerActor, ExecutorActor]:
        """Fresh scheduler and executor actors over these components; the scheduler actor takes
        requests and aborts, and sends each step's outputs to ``outputs_to``."""
        lora = self.config.lora
        core = SchedulerActor(self.scheduler, self.config.model.max_model_len, self.timing,
                              vocab_size=self.hf_config.vocab_size,
                              lora=None if lora is None else AdapterLimits.of(self.hf_config, lora.max_lora_rank))
        executor = ExecutorActor(self.executor, core)
        core.connect(executor, outputs_to)
        return core, executor

    @property
    def worker(self) -> Worker:
        """The in-process worker of the uni executor.

        :raises RuntimeError: the workers run in other processes (mp or ray executor).
        """
        if not isinstance(self.executor, UniExecutor):
            raise RuntimeError(f"the {self.config.parallel.executor_backend} executor's workers run in other "
                               "processes; only the uni executor has an in-process worker")
        return self.executor.worker

    def abort_all(self) -> None:
        """Finish every request still in the scheduler (a run ended with requests unfinished)."""
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        """Stop the workers (their processes or actors, under the mp and ray executors)."""
        self.executor.shutdown()
        if self.scheduler.trace is not None:
            self.scheduler.trace.close()


def scheduling_trace_of(config: EngineConfig) -> SchedulingTrace | None:
    """``--trace-scheduling FILE``'s writer; each engine core of several writes ``FILE.dpRANK``."""
    path = config.scheduler.trace_scheduling
    if path is None:
        return None
    parallel = config.parallel
    return SchedulingTrace(ranked_path(path, parallel.data_parallel_rank, parallel.data_parallel_size))
