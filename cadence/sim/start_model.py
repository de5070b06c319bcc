"""A simulated engine's first step-budget model, made as the real engine core makes its own.

The real engine core starts its latency target's cost model from a few steps timed on its workers
(``core/start_fit.py``: a prompt alone, then decode batches), refitted from the built-in model, and
learns the rest as it runs. A simulated engine started from its whole cost model instead sized its
first chunks with costs the running fit never has (a prompt's own price, attention pairs): at twice
a 2-core machine's capacity the simulation took 999 steps where the served run took 845, and missed
its throughput by 16% (docs/research.md, "Calibrated from the served run's trace"). Here the same
phases run on a scratch scheduler and are priced by the cost model rather than timed.
"""

from __future__ import annotations

from cadence.config import SchedulerConfig
from cadence.core.cost_model import CostModel
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.start_fit import StartLimits, fit_phases, start_phases
from cadence.messages import SchedulerOutput
from cadence.policies.base import PolicyContext
from cadence.policies.clock import VirtualClock
from cadence.policies.fcfs import FCFSPolicy
from cadence.sim.runner import SimulatedRunner
from cadence.sim.workload import SYNTHETIC_VOCAB


def start_model(cost_model: CostModel, config: SchedulerConfig, num_kv_blocks: int, block_size: int,
                max_model_len: int) -> CostModel:
    """The step budget's first model of an engine of these limits whose steps ``cost_model`` prices."""
    limit = cost_model.row_limit
    runner = SimulatedRunner(cost_model)

    def scheduler_of(builtin: CostModel) -> Scheduler:
        allocator = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        return Scheduler(config, allocator, FCFSPolicy(PolicyContext.of(config, VirtualClock())), cost_model=builtin)

    def priced(scheduler: Scheduler) -> tuple[SchedulerOutput, float]:
        out = scheduler.schedule()
        result, _, seconds = runner.execute(out)
        scheduler.update_from_output(result)
        return out, seconds

    start = StartLimits(max_model_len, block_size, config.max_num_batched_tokens, config.max_num_seqs)
    return fit_phases(scheduler_of, lambda free: start_phases(start, SYNTHETIC_VOCAB, free, limit), priced, limit)
