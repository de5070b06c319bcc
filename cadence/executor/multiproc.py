"""The ``mp`` executor: one worker process per tensor-parallel rank, started and watched by the engine core.

Each step is encoded once and published once on a ZMQ PUB socket that every rank subscribes to (an
XPUB, so the executor knows when all have subscribed); the ranks run the forward together and
rank 0 pushes back the sampled tokens. While it waits, the executor also watches every process's
sentinel: a rank that dies or raises fails the step at once with an error naming it, never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import zmq

from cadence.config import EngineConfig
from cadence.distributed.group import free_port
from cadence.executor.base import Executor, WorkerError
from cadence.executor.worker_process import WorkerAddresses, worker_main
from cadence.messages import ModelRunnerOutput, SchedulerOutput, WorkerFailed, WorkerReady, WorkerReply
from cadence.transport.codec import Codec

logger = logging.getLogger(__name__)

_SUBSCRIBE = 1  # first byte of the frame an XPUB socket receives for a new subscription
# After a rank's process exits, how long to wait for the error it may have sent just before.
_LAST_WORDS_MS = 1000


class MultiprocExecutor(Executor):
    """Starts ``tensor_parallel_size`` worker processes (spawn) and waits until all are ready.

    :raises WorkerError: a worker failed or died while starting (the others are stopped).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        stem = os.path.join(tempfile.gettempdir(), f"cadence-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        addresses = WorkerAddresses(steps=f"ipc://{stem}-steps", replies=f"ipc://{stem}-replies",
                                    init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
        self._context = zmq.Context()
        self._steps = self._context.socket(zmq.XPUB)
        self._steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank, not per topic
        self._steps.setsockopt(zmq.LINGER, 0)
        self._steps.bind(addresses.steps)
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(addresses.replies)
        self._step_codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
        self._reply_codec: Codec[WorkerReply] = Codec(WorkerReply)
        spawn = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = [
            spawn.Process(target=worker_main, args=(config, rank, addresses), name=f"cadence-worker-{rank}",
                          daemon=True)
            for rank in range(self.world_size)
        ]
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._context)
        try:
            for process in self.processes:
                process.start()
            self.num_blocks = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self._steps.send(self._step_codec.encode(step), copy=False)
        while True:
            reply = self._next_reply()
            if isinstance(reply, ModelRunnerOutput):
                return reply
            raise WorkerError(f"unexpected {type(reply).__name__} from worker rank {reply.rank} during a step")

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_ready(self) -> int:
        """Rank 0's KV block count, once every rank is ready and subscribed to the steps."""
        ready: dict[int, int] = {}
        subscribed = 0
        poller = self._poller(self._steps)
        while len(ready) < self.world_size or subscribed < self.world_size:
            events = dict(poller.poll())
            if self._steps in events:
                subscribed += self._steps.recv()[0] == _SUBSCRIBE
            if self._replies in events or self._dead_ranks(events):
                reply = self._next_reply()
                if not isinstance(reply, WorkerReady):
                    raise WorkerError(f"unexpected {type(reply).__name__} from a worker while starting")
                ready[reply.rank] = reply.num_blocks
        return ready[0]

    def _next_reply(self) -> WorkerReady | ModelRunnerOutput:
        """The next message from a worker.

        :raises WorkerError: a worker reported a failure, or a worker process exited.
        """
        poller = self._poller()
        while True:
            events = dict(poller.poll())
            if self._replies in events:
                reply = self._reply_codec.decode(self._replies.recv())
                if isinstance(reply, WorkerFailed):
                    raise self._failure(reply)
                return reply
            dead = self._dead_ranks(events)
            if dead:
                raise self._death(dead[0])

    def _poller(self, *sockets: zmq.Socket[bytes]) -> zmq.Poller:
        poller = zmq.Poller()
        for socket in (self._replies, *sockets):
            poller.register(socket, zmq.POLLIN)
        for process in self.processes:
            poller.register(process.sentinel, zmq.POLLIN)
        return poller

    def _dead_ranks(self, events: dict[object, int]) -> list[int]:
        return [rank for rank, process in enumerate(self.processes) if process.sentinel in events]

    def _death(self, rank: int) -> WorkerError:
        """The error for a rank whose process exited: the failure it reported, if any arrives."""
        if self._replies.poll(_LAST_WORDS_MS):
            reply = self._reply_codec.decode(self._replies.recv())
            if isinstance(reply, WorkerFailed):
                return self._failure(reply)
        return self._exited(rank)

    def _failure(self, reply: WorkerFailed) -> WorkerError:
        """A rank's reported failure, or the death of another rank that caused it: a collective
        fails on the surviving ranks as soon as a peer's process is gone."""
        for rank, process in enumerate(self.processes):
            if rank != reply.rank and process.exitcode is not None:
                error = self._exited(rank)
                return WorkerError(f"{error}; rank {reply.rank} then failed: {reply.error}")
        return WorkerError(f"worker rank {reply.rank} failed: {reply.error}")

    def _exited(self, rank: int) -> WorkerError:
        process = self.processes[rank]
        process.join()
        return WorkerError(f"worker rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)}")


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(processes: Sequence[BaseProcess], context: zmq.Context[zmq.Socket[bytes]]) -> None:
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    for process in started:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    context.destroy(linger=0)
