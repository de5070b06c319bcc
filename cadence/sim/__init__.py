"""The simulator: the real scheduler, policy and KV allocator on a virtual clock (see docs/architecture.md).

``simulate(workload, limits, policy, cost_model, seed) -> SimResult`` is the Python API;
``cadence simulate`` the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Where each name lives. Imported when first asked for: the simulator pulls in the executor's model
# code, which the modules beside it (trace formats, workloads, the CLI) must not cost their importers.
_HOMES = {"CostModel": "cadence.core.cost_model", "StepShape": "cadence.core.cost_model",
          "fit_cost_model": "cadence.core.cost_model", "EngineLimits": "cadence.sim.simulator",
          "SimResult": "cadence.sim.simulator", "StepRecord": "cadence.sim.simulator",
          "simulate": "cadence.sim.simulator", "LengthDist": "cadence.sim.workload",
          "RequestSpec": "cadence.sim.workload", "load_trace": "cadence.sim.workload",
          "save_trace": "cadence.sim.workload", "synthetic_workload": "cadence.sim.workload"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'cadence.sim' has no attribute {name!r}")
