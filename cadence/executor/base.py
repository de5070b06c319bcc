"""The executor contract, the in-process executor, and a tensor-parallel rank's start-up."""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch.distributed as dist
from transformers import PretrainedConfig

from cadence.config import EngineConfig
from cadence.distributed.group import init_tensor_parallel
from cadence.executor.worker import Worker
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.models.loader import load_hf_config

_T = TypeVar("_T")


class WorkerError(RuntimeError):
    """A worker failed or died; the message names its rank."""


class Executor(abc.ABC):
    """Runs each scheduled step on every rank's worker and returns rank 0's sampled tokens.

    ``num_blocks`` is the KV cache's block count, the same on every rank; ``kernel_row_limit`` the
    quantized kernel's row limit for the model's weights (None: none), rank 0's
    (:func:`~cadence.quantization.packed.model_row_limit`). The executor actor calls
    :meth:`execute_model` from a thread, one step at a time.
    """

    num_blocks: int
    kernel_row_limit: int | None = None

    @abc.abstractmethod
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all ranks; blocks until rank 0 has sampled.

        :raises WorkerError: a worker raised or died during the step.
        """

    async def run_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """:meth:`execute_model` from the event loop: in a thread, abandoned (not awaited) when the
        caller is cancelled, so that a step that never ends cannot hold the engine's shutdown."""
        return await anyio.to_thread.run_sync(self.execute_model, step, abandon_on_cancel=True)

    async def watch_workers(self) -> None:
        """Wait (using no CPU, off the step path) for a worker to die while no step runs; never
        returns. A death during a step fails that step instead, and is not reported here again.
        This one waits forever: the uni executor's worker is the engine core's own process.

        :raises WorkerError: naming the rank that died.
        """
        await anyio.sleep_forever()

    def shutdown(self) -> None:
        """Stop the workers (idempotent); the executor is unusable afterwards."""


@functools.cache
def model_thread() -> ThreadPoolExecutor:
    """The one thread of this process that every in-process worker's torch calls run on."""
    return ThreadPoolExecutor(1, thread_name_prefix="cadence-model")


class UniExecutor(Executor):
    """One worker in the engine core's process: no copies, no collectives (the default for one rank).

    Every torch call of the worker (loading, sizing the cache, each step) runs on the process's model
    thread (:func:`model_thread`), which the workers of every engine in the process share. OpenMP
    keeps a thread team per calling thread; a second team (another thread's, idle) takes libgomp past
    one thread per core, where it stops spinning between parallel regions, and each of a forward's
    ~1000 regions then pays a futex wake-up: 120 ms instead of 82 ms per batch-64 decode step on 2
    cores, measured here. Engines in one process (two ``LLM``s, the tests) thus take turns at the
    cores rather than slowing each other down.
    """

    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig) -> None:
        self._closed = False
        self.worker = self._submit(Worker, config, hf_config, local_rank=config.parallel.device_index(0)).result()
        self.num_blocks = self.worker.num_blocks
        self.kernel_row_limit = self.worker.kernel_row_limit

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self._submit(self.worker.execute_model, step).result()

    async def run_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        # Straight to the model's thread: one thread hop each way, not two through anyio's worker
        # thread (0.1-0.2 ms a step at batch 1, docs/benchmarks.md). Cancelling abandons the future.
        return await asyncio.wrap_future(self._submit(self.worker.execute_model, step))

    def shutdown(self) -> None:
        self._closed = True  # the thread is the process's: other engines may still use it

    def _submit(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> Future[_T]:
        """:raises RuntimeError: after :meth:`shutdown`."""
        if self._closed:
            raise RuntimeError("this executor is shut down")
        return model_thread().submit(call, *args, **kwargs)


def start_worker(config: EngineConfig, rank: int, rendezvous: str | dist.Store, local_rank: int) -> Worker:
    """One tensor-parallel rank's start-up, in a worker process or a Ray actor: join the group at
    ``rendezvous``, then load this rank's shard and allocate its KV cache."""
    group = init_tensor_parallel(rank, config.parallel.tensor_parallel_size, rendezvous, config.device.torch_device)
    return Worker(config, load_hf_config(config.model.path), group, local_rank)
