"""The execution layer: how the engine core runs the model.

Executors, chosen by :func:`create_executor` (``base.py``: one in-process worker, ``uni``;
``multiproc.py``: one worker process per tensor-parallel rank, ``mp``; ``ray_executor.py``: one Ray
actor per rank), the executor actor that hands them each step (``actor.py``), and what runs on a
rank: the worker (``worker.py``), its model runner (``model_runner.py``) and sampler
(``sampler.py``). ``core/`` keeps the engine's brain: requests, scheduling, the KV cache.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from cadence.config import EngineConfig
from cadence.distributed.partition import check_shardable
from cadence.executor.base import Executor, UniExecutor, WorkerError

__all__ = ["Executor", "WorkerError", "create_executor"]


def create_executor(config: EngineConfig, hf_config: PretrainedConfig) -> Executor:
    """The executor ``config.parallel`` asks for, with its workers started and their KV caches sized.

    :raises ValueError: the model cannot be split over ``tensor_parallel_size`` ranks.
    :raises WorkerError: a worker failed to start.
    """
    backend = config.parallel.executor_backend
    if backend == "uni":
        return UniExecutor(config, hf_config)
    check_shardable(hf_config, config.parallel.tensor_parallel_size)
    if backend == "mp":
        from cadence.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from cadence.executor.ray_executor import RayExecutor  # needs the `ray` extra

    return RayExecutor(config)

