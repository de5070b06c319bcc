"""How the engine core runs the model: one in-process worker (``uni``), one worker process per
tensor-parallel rank (``mp``), or one Ray actor per rank (``ray``)."""

from cadence.executor.base import Executor, WorkerError, create_executor

__all__ = ["Executor", "WorkerError", "create_executor"]
