"""The engine core in its own process: scheduler, KV allocator and executor behind two ZMQ sockets.

The front end (:class:`cadence.engine.core_client.ZmqCoreClient`) starts :func:`engine_core_main`
in a child of the fork server (:mod:`cadence.runtime.fork_server`: a process that imported the
engine's modules and holds none of the API process's threads or sockets; torch gets every core while
the API process keeps one) and waits for :class:`~cadence.messages.EngineCoreReady`.
Requests and aborts come in on one socket, outputs (and, once, ``EngineDead``) go out on the other.

With data parallelism there is one such process per rank, each with its own sockets and KV cache
and an equal share of the cores; each then also reports its prefix cache's changes with its
outputs, for the router (see :mod:`cadence.engine.routers.prefix_aware`).

SIGTERM ends the loop: the engine core stops its executor (the tensor-parallel workers, their
sockets and rendezvous file, or the Ray actors and placement group) before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch
import zmq
import zmq.asyncio

from cadence.config import EngineConfig, threads_per_rank
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.kv_events import fold_kv_events
from cadence.messages import (
    AbortRequests,
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineDead,
)
from cadence.runtime.actor import Mailbox, run_actors
from cadence.runtime.forwarder import Forwarder
from cadence.runtime.processes import set_process_name
from cadence.runtime.zmq_channel import ZmqReceiveChannel, ZmqSendChannel

if TYPE_CHECKING:
    from cadence.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineAddresses:
    """The two sockets the engine core binds: requests in, outputs out.

    Their files sit in the temp folder under a fresh random name, and the binding channel creates
    them owner-only (:mod:`cadence.runtime.zmq_channel`): another user can neither connect nor, in
    a sticky temp folder, remove them. (A private folder would do as well, but the files' names are
    how tools and tests find a running engine core's sockets.)
    """

    input: str
    output: str

    @classmethod
    def fresh(cls) -> EngineAddresses:
        stem = os.path.join(tempfile.gettempdir(), f"cadence-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(input=f"ipc://{stem}-in", output=f"ipc://{stem}-out")

    def remove_files(self) -> None:
        """Delete the sockets' files (an engine core that was killed leaves them behind)."""
        for address in (self.input, self.output):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.removeprefix("ipc://"))


def engine_core_main(config: EngineConfig, addresses: EngineAddresses, log_level: str) -> None:
    """The process's entry point; exits non-zero if the engine failed."""
    # Ctrl-C reaches the whole process group; the front end decides when the engine core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # While starting, SIGTERM unwinds the start-up (an executor stops the workers it started);
    # once serving, it ends the loop instead (see _stop_on_sigterm).
    signal.signal(signal.SIGTERM, _exit_now)
    dp_rank = config.parallel.data_parallel_rank
    set_process_name(f"cadence-core-{dp_rank}")
    logging.basicConfig(level=log_level, format=f"%(levelname)s engine-core-{dp_rank} %(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(config.device, config.parallel))
    ok = anyio.run(_serve, config, addresses)
    sys.exit(0 if ok else 1)


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


async def _serve(config: EngineConfig, addresses: EngineAddresses) -> bool:
    # Here, not at the top: the front end imports this module for the entry point, and must not
    # load the model code it never runs.
    from cadence.core.engine_core import EngineCore

    context = zmq.asyncio.Context()
    outputs: ZmqSendChannel[Any] = ZmqSendChannel(context, addresses.output, EngineCoreEvent, bind=True)
    inputs: ZmqReceiveChannel[Any] = ZmqReceiveChannel(context, addresses.input, EngineCoreInput, bind=True)
    try:
        core = EngineCore.build(config)
    except Exception as exc:
        logger.exception("engine core failed to start")
        await outputs.send(EngineDead(f"engine core failed to start: {type(exc).__name__}: {exc}"))
        return False
    try:
        return await _run(core, outputs, inputs)
    finally:
        # The front end's SIGTERM (after a crash, or a second one) must not cut the clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        core.shutdown()


async def _run(core: EngineCore, outputs: ZmqSendChannel[Any], inputs: ZmqReceiveChannel[Any]) -> bool:
    """Run the engine core's actors until one crashes (False) or SIGTERM comes (True)."""
    config = core.config
    publish_to: Mailbox[Any] = outputs
    if config.parallel.data_parallel_size > 1 and config.cache.enable_prefix_caching:
        core.allocator.enable_kv_events = True
        publish_to = _WithKVDelta(outputs, core.allocator)
    scheduler, executor = core.actors(publish_to)
    forwarder = Forwarder(inputs, {EngineCoreRequest: scheduler, AbortRequests: scheduler}, "engine-input")
    crashed: list[str] = []

    async def on_crash(error: str) -> None:
        crashed.append(error)
        await outputs.send(EngineDead(error))

    policy = core.scheduler.policy.describe()
    await outputs.send(EngineCoreReady(num_blocks=core.executor.num_blocks, block_size=config.cache.block_size,
                                       policy=policy))
    logger.info("engine core ready: %d KV blocks, scheduling policy %s", core.executor.num_blocks, policy)
    async with anyio.create_task_group() as group:
        group.start_soon(_stop_on_sigterm, group.cancel_scope)
        await run_actors([scheduler, executor, forwarder], on_crash)
        group.cancel_scope.cancel()
    return not crashed


async def _stop_on_sigterm(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


class _WithKVDelta:
    """The engine core's output channel, with the allocator's KV events since the previous batch
    folded into each output batch (one delta per step, never a message per block)."""

    def __init__(self, outputs: Mailbox[Any], allocator: KVCacheManager) -> None:
        self._outputs = outputs
        self._allocator = allocator

    async def send(self, message: EngineCoreOutputs) -> None:
        message.kv_delta = fold_kv_events(self._allocator.take_events())
        await self._outputs.send(message)

    def close(self) -> None:
        self._outputs.close()
