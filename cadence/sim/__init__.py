"""The simulator: the real scheduler, policy and KV allocator on a virtual clock (see docs/architecture.md).

``simulate(workload, limits, policy, cost_model, seed) -> SimResult`` is the Python API;
``cadence simulate`` the command line.
"""

from __future__ import annotations

from cadence.core.cost_model import CostModel, StepShape, fit_cost_model
from cadence.sim.simulator import EngineLimits, SimResult, StepRecord, simulate
from cadence.sim.workload import LengthDist, RequestSpec, load_trace, save_trace, synthetic_workload

__all__ = [
    "CostModel",
    "EngineLimits",
    "LengthDist",
    "RequestSpec",
    "SimResult",
    "StepRecord",
    "StepShape",
    "fit_cost_model",
    "load_trace",
    "save_trace",
    "simulate",
    "synthetic_workload",
]
