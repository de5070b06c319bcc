"""The ``mp`` executor: one worker process per tensor-parallel rank, started and watched by the engine core.

The ranks meet through a ``file://`` rendezvous on a fresh temporary path, so engine cores that
start their workers at the same moment (data parallelism) cannot race for a TCP port. Each step
is encoded once and published once on a ZMQ PUB socket that every rank subscribes to (an XPUB, so
the executor knows when all have subscribed); the ranks run the forward together and rank 0
pushes back the sampled tokens. While it waits, the executor also watches every process's
sentinel: a rank that dies or raises fails the step at once with an error naming it, never a hang.
Between steps, :meth:`MultiprocExecutor.watch_workers` waits on the same sentinels in the event
loop, so a rank that dies while the engine is idle fails the engine at once too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import anyio
import zmq

from cadence.config import EngineConfig
from cadence.executor.base import Executor, WorkerError
from cadence.executor.worker_process import WorkerAddresses, worker_main
from cadence.messages import ModelRunnerOutput, SchedulerOutput, WorkerFailed, WorkerReady, WorkerReply
from cadence.runtime.codec import Codec
from cadence.runtime.fork_server import forked_process

logger = logging.getLogger(__name__)

_SUBSCRIBE = 1  # first byte of the frame an XPUB socket receives for a new subscription
# After a rank's process exits, how long to wait for the error it may have sent just before.
_LAST_WORDS_MS = 1000
# After a rank reports a failure, how long to wait for another rank's exit that may have caused it: a
# killed process's sockets close (and a collective fails on its peers) a moment before its exit shows,
# a moment that a loaded machine stretched past 0.2 s. Only a failing engine waits.
_PEER_EXIT_S = 1.0


class MultiprocExecutor(Executor):
    """Starts ``tensor_parallel_size`` worker processes (forked from this process's fork server, with
    the engine's modules imported) and waits until all are ready.

    :raises WorkerError: a worker failed or died while starting (the others are stopped).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        stem = os.path.join(tempfile.gettempdir(), f"cadence-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        addresses = WorkerAddresses(steps=f"ipc://{stem}-steps", replies=f"ipc://{stem}-replies",
                                    init_method=f"file://{stem}-rendezvous")
        # Held for each step, so that a death seen between steps is told apart from one a step saw.
        self._stepping = threading.Lock()
        self._failed = False
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
        self.processes: list[BaseProcess] = [
            forked_process(worker_main, (config, rank, addresses), name=f"cadence-worker-{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        files = [f"{stem}-{name}" for name in ("steps", "replies", "rendezvous")]
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._context, files)
        try:
            for process in self.processes:
                process.start()
            first = self._wait_ready()
            self.num_blocks, self.kernel_row_limit = first.num_blocks, first.kernel_row_limit
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        with self._stepping:
            try:
                return self._run_step(step)
            except WorkerError:
                self._failed = True
                raise

    def _run_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self._steps.send(self._step_codec.encode(step), copy=False)
        reply = self._next_reply()
        if isinstance(reply, ModelRunnerOutput):
            return reply
        raise WorkerError(f"unexpected {type(reply).__name__} from worker rank {reply.rank} during a step")

    async def watch_workers(self) -> None:
        rank = await _first_exit(self.processes)
        # A step running now sees the death too (it polls the sentinels), and fails with it.
        error = await anyio.to_thread.run_sync(self._death_between_steps, rank)
        if error is not None:
            raise error
        await anyio.sleep_forever()  # the step that saw it reports it

    def _death_between_steps(self, rank: int) -> WorkerError | None:
        """The error for ``rank``'s exit, unless a step already failed (and reported the death)."""
        with self._stepping:
            if self._failed:
                return None
            self._failed = True
            return self._death(rank)

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_ready(self) -> WorkerReady:
        """Rank 0's report, once every rank is ready and subscribed to the steps."""
        ready: dict[int, WorkerReady] = {}
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
                ready[reply.rank] = reply
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
        others = [process.sentinel for rank, process in enumerate(self.processes) if rank != reply.rank]
        # A sentinel is ready as the process exits, a moment before waitpid sees it: _exited joins it.
        ended = multiprocessing.connection.wait(others, timeout=_PEER_EXIT_S)
        for rank, process in enumerate(self.processes):
            if rank != reply.rank and (process.sentinel in ended or process.exitcode is not None):
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


async def _first_exit(processes: Sequence[BaseProcess]) -> int:
    """The rank of the first worker process to exit (its sentinel polled by the event loop)."""
    exited: list[int] = []
    async with anyio.create_task_group() as group:

        async def wait(rank: int, sentinel: int) -> None:
            await anyio.wait_readable(sentinel)
            exited.append(rank)
            group.cancel_scope.cancel()

        for rank, process in enumerate(processes):
            group.start_soon(wait, rank, process.sentinel)
    return exited[0]


def _stop(processes: Sequence[BaseProcess], context: zmq.Context[zmq.Socket[bytes]], files: Sequence[str]) -> None:
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
    # The sockets' ipc files stay after they close; torch removes the rendezvous file when the last
    # rank leaves cleanly, not when one was killed.
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
