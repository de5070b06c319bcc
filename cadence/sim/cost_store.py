"""Fitted cost models kept on this machine, one per model, dtype, quantization, thread count and build
of cadence's C++ kernels.

``cadence simulate calibrate`` stores its fit here (``$CADENCE_COST_MODELS_DIR``, else ``cost-models/``
in cadence's cache folder), and
``cadence simulate`` finds it by the engine options it is given: a fit is only valid for the
machine, model, dtype, quantization, threads and kernels it was timed with (new kernels, as after an
upgrade, are calibrated afresh at first use: faster attention made an older fit price steps high).
The built-in fit (SmolLM2 bf16 on the 2-core development machine) is a fallback that must be asked
for by name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cadence.backends.cpu_kernels import build_for
from cadence.config import cache_dir, threads_per_rank
from cadence.core.cost_model import CostModel

if TYPE_CHECKING:
    from cadence.config import EngineConfig

BUILTIN = "builtin"


def store_dir() -> Path:
    return Path(os.environ.get("CADENCE_COST_MODELS_DIR") or cache_dir() / "cost-models")


@dataclass(frozen=True)
class FitKey:
    """What a fit depends on besides the machine."""

    model: str  # the model folder's name (a converted GGUF's folder names its file)
    dtype: str
    quantization: str
    threads: int
    kernels: str  # cpu_kernels.build_for: the kernels' build, "none" for torch's ops

    @classmethod
    def of(cls, config: EngineConfig) -> FitKey:
        return cls(Path(config.model.path.rstrip("/")).name, config.model.dtype, config.model.quantization,
                   threads_per_rank(config.device, config.parallel),
                   build_for(config.device.torch_device, config.model.torch_dtype))

    @property
    def path(self) -> Path:
        name = f"{self.model}-{self.dtype}-{self.quantization}-{self.threads}t-{self.kernels}"
        return store_dir() / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.json"

    def describe(self) -> str:
        return (f"{self.model} {self.dtype}, quantization {self.quantization}, {self.threads} threads, "
                f"kernels {self.kernels}")


def stored_fit(key: FitKey) -> CostModel | None:
    """The fit stored for ``key`` on this machine, if any.

    :raises ValueError: the stored file is not a cost model this version reads.
    """
    return CostModel.load(key.path) if key.path.is_file() else None


def store_fit(model: CostModel, key: FitKey) -> Path:
    """Keep ``model`` as this machine's fit for ``key``; returns where."""
    key.path.parent.mkdir(parents=True, exist_ok=True)
    model.save(key.path)
    return key.path
