"""The execution layer: how the engine core runs the model.

Executors (``base.py``: one in-process worker, ``uni``; ``multiproc.py``: one worker process per
tensor-parallel rank, ``mp``; ``ray_executor.py``: one Ray actor per rank), the executor actor that
hands them each step (``actor.py``), and what runs on a rank: the worker (``worker.py``), its model
runner (``model_runner.py``) and sampler (``sampler.py``). ``core/`` keeps the engine's brain:
requests, scheduling, the KV cache.
"""

from cadence.executor.base import Executor, WorkerError, create_executor

__all__ = ["Executor", "WorkerError", "create_executor"]
