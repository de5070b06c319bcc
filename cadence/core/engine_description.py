"""What an engine's step times were measured on: the model and its weights, the attention backend,
the C++ kernels' build, the threads and the machine. A calibrated cost model keeps it as its metadata
(``sim/calibrate.py``), and a scheduling trace opens with it (``core/scheduling_trace.py``), so a
fit from either says where it holds.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

from cadence.backends.cpu_kernels import build_for
from cadence.config import EngineConfig, threads_per_rank

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from cadence.executor import Executor


def engine_description(config: EngineConfig, hf_config: PretrainedConfig, executor: Executor) -> dict[str, Any]:
    import torch

    return {
        "model": os.path.basename(config.model.path.rstrip("/")),
        "model_path": config.model.path,
        "dtype": config.model.dtype,
        "quantization": config.model.quantization,
        "device": config.device.device,
        "attention_backend": _attention_backend(config, hf_config),
        # Each rank's: the workers of several ranks run in other processes, with their share.
        "threads": torch.get_num_threads() if config.parallel.tensor_parallel_size == 1
        else threads_per_rank(config.device, config.parallel),
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": str(torch.__version__),
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        # Verified drafts can cost too little to measure (a small model's step is its overhead): the
        # fit's draft_tokens is then 0, and this says it was looked for (CostModel.prices_speculation).
        "speculative": None if config.speculative is None else config.speculative.method,
        # Step shapes are counted with it (kernel_rows); the simulator counts its steps' the same way.
        "kernel_row_limit": executor.kernel_row_limit,
        # The C++ kernels' build: a fit of older kernels prices steps that now run otherwise.
        "kernels": build_for(config.device.torch_device, config.model.torch_dtype),
    }


def _attention_backend(config: EngineConfig, hf_config: PretrainedConfig) -> str:
    """The backend the workers chose: the same choice, made again here (they may be in other processes)."""
    from cadence.backends.registry import load_backend
    from cadence.models.layers import head_dim_of

    return load_backend(config.device.attention_backend, config.device.torch_device, config.model.torch_dtype,
                        head_dim_of(hf_config), config.cache.block_size).name
