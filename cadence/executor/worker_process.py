"""The loop of one tensor-parallel worker process (``mp`` executor).

The process joins the rank's ``torch.distributed`` group, loads its shard, reports ready, then runs
every step the executor publishes. Rank 0 replies with the sampled tokens; a rank that raises
reports the error and exits, so that the executor fails the step instead of the other ranks
waiting in a collective forever. A worker whose parent (the engine core) is gone exits at once,
whatever it is doing, starting up included.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass

import zmq

from cadence.config import EngineConfig
from cadence.executor.base import start_worker
from cadence.executor.worker import Worker
from cadence.messages import SchedulerOutput, WorkerFailed, WorkerReady, WorkerReply
from cadence.runtime.codec import Codec
from cadence.runtime.processes import exit_with_parent, set_process_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerAddresses:
    """Where the workers meet the executor and each other."""

    steps: str  # the executor publishes each step here, once, to every rank
    replies: str  # the workers push ready / rank 0's outputs / failures here
    init_method: str  # the torch.distributed rendezvous (file://PATH)


def worker_main(config: EngineConfig, rank: int, addresses: WorkerAddresses) -> None:
    """The process's entry point; exits non-zero if the worker failed."""
    exit_with_parent()
    # Ctrl-C reaches the whole process group; the engine core decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_name(f"cadence-tp-{config.parallel.data_parallel_rank}-{rank}")
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s worker-{rank} %(name)s: %(message)s")
    context = zmq.Context()
    steps = context.socket(zmq.SUB)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.connect(addresses.steps)
    replies = context.socket(zmq.PUSH)
    replies.connect(addresses.replies)
    codec: Codec[WorkerReply] = Codec(WorkerReply)
    try:
        worker = start_worker(config, rank, addresses.init_method, config.parallel.device_index(rank))
        replies.send(codec.encode(WorkerReady(rank, worker.num_blocks, worker.kernel_row_limit)))
        _serve(worker, rank, steps, replies, codec)
    except Exception as exc:
        logger.exception("worker rank %d failed", rank)
        replies.send(codec.encode(WorkerFailed(rank, f"{type(exc).__name__}: {exc}")))
        # Bounded: the message must leave before the process does, but the executor may be gone.
        replies.close(linger=5000)
        sys.exit(1)


def _serve(worker: Worker, rank: int, steps: zmq.Socket[bytes], replies: zmq.Socket[bytes],
           codec: Codec[WorkerReply]) -> None:
    """Run every published step, forever (the executor, or the engine core's death, ends the process)."""
    step_codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
    while True:
        output = worker.execute_model(step_codec.decode(steps.recv()))
        if rank == 0:
            replies.send(codec.encode(output))
