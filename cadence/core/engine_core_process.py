"""The engine core in its own process: scheduler, KV allocator and executor behind two ZMQ sockets.

The server starts it with multiprocessing's ``spawn`` (a clean interpreter: no inherited threads,
and torch gets every core while the server process keeps one), waits for :class:`EngineCoreReady`,
and watches the process: if it exits, every in-flight request fails at once.

With data parallelism the server starts one such process per rank, each with its own sockets and
KV cache and an equal share of the cores; each then also reports its prefix cache's changes with
its outputs, for the router (see :mod:`cadence.core.dp_router`).

The server stops an engine core with SIGTERM: the engine core ends its loop and stops its
executor (the tensor-parallel workers, their sockets and rendezvous file, or the Ray actors and
placement group) before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
import zmq
import zmq.asyncio

from cadence.config import EngineConfig, threads_per_rank
from cadence.core.actor import Mailbox, run_actors
from cadence.core.kv_allocator import AllBlocksCleared, BlockStored, KVAllocator, KVEvent
from cadence.messages import (
    AbortRequests,
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineDead,
    KVCacheDelta,
)
from cadence.processes import set_process_name
from cadence.transport.forwarder import Forwarder
from cadence.transport.zmq_channel import ZmqReceiveChannel, ZmqSendChannel

if TYPE_CHECKING:
    from cadence.core.engine import EngineCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineAddresses:
    """The two sockets the engine core binds: requests in, outputs out."""

    input: str
    output: str

    @classmethod
    def fresh(cls) -> EngineAddresses:
        stem = os.path.join(tempfile.gettempdir(), f"cadence-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(input=f"ipc://{stem}-in", output=f"ipc://{stem}-out")


def engine_core_main(config: EngineConfig, addresses: EngineAddresses, log_level: str) -> None:
    """The process's entry point; exits non-zero if the engine failed."""
    # Ctrl-C reaches the whole process group; the server decides when the engine core stops.
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
    from cadence.core.engine import EngineCore  # heavy: imports the model code

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
        # The server's SIGTERM (after a crash, or a second one) must not cut the clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        core.shutdown()


async def _run(core: EngineCore, outputs: ZmqSendChannel[Any], inputs: ZmqReceiveChannel[Any]) -> bool:
    """Run the engine core's actors until one crashes (False) or SIGTERM comes (True)."""
    config = core.config
    publish_to: Mailbox[Any] = outputs
    if config.parallel.data_parallel_size > 1 and config.cache.enable_prefix_caching:
        core.allocator.enable_kv_events = True
        publish_to = _WithKVDelta(outputs, core.allocator)
    core_actor, executor = core.actors(publish_to)
    forwarder = Forwarder(inputs, {EngineCoreRequest: core_actor, AbortRequests: core_actor}, "engine-input")
    crashed: list[str] = []

    async def on_crash(error: str) -> None:
        crashed.append(error)
        await outputs.send(EngineDead(error))

    await outputs.send(EngineCoreReady(num_blocks=core.executor.num_blocks, block_size=config.cache.block_size))
    logger.info("engine core ready: %d KV blocks", core.executor.num_blocks)
    async with anyio.create_task_group() as group:
        group.start_soon(_stop_on_sigterm, group.cancel_scope)
        await run_actors([core_actor, executor, forwarder], on_crash)
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

    def __init__(self, outputs: Mailbox[Any], allocator: KVAllocator) -> None:
        self._outputs = outputs
        self._allocator = allocator

    async def send(self, message: EngineCoreOutputs) -> None:
        message.kv_delta = fold_kv_events(self._allocator.take_events())
        await self._outputs.send(message)

    def close(self) -> None:
        self._outputs.close()


def fold_kv_events(events: list[KVEvent]) -> KVCacheDelta | None:
    """The net effect of ``events`` (in order) on the set of cached hashes; None if there were none."""
    if not events:
        return None
    stored: dict[int, None] = {}  # dicts: sets in insertion order, so the frames are reproducible
    removed: dict[int, None] = {}
    cleared = False
    for event in events:
        if isinstance(event, AllBlocksCleared):
            stored.clear()
            removed.clear()
            cleared = True
            continue
        added, dropped = (stored, removed) if isinstance(event, BlockStored) else (removed, stored)
        for block_hash in event.block_hashes:
            dropped.pop(block_hash, None)
            added[block_hash] = None
    return KVCacheDelta(stored=list(stored), removed=list(removed), cleared=cleared)


class EngineCoreProcess:
    """The server's handle on one engine-core process and its two channels."""

    def __init__(self, config: EngineConfig, log_level: str = "WARNING") -> None:
        self.dp_rank = dp_rank = config.parallel.data_parallel_rank
        self.addresses = EngineAddresses.fresh()
        # Not a daemon under the mp executor: daemons may not start processes, and that engine core
        # starts its tensor-parallel workers. shutdown() stops it either way; its workers exit with it.
        self.process = multiprocessing.get_context("spawn").Process(
            target=engine_core_main, args=(config, self.addresses, log_level),
            name=f"cadence-engine-core-{dp_rank}", daemon=config.parallel.executor_backend != "mp")
        self._context = zmq.asyncio.Context()
        self.inputs: ZmqSendChannel[Any] = ZmqSendChannel(self._context, self.addresses.input, EngineCoreInput,
                                                          bind=False)
        self.outputs: ZmqReceiveChannel[Any] = ZmqReceiveChannel(
            self._context, self.addresses.output, EngineCoreEvent, bind=False)

    def start(self) -> None:
        self.process.start()

    async def wait_ready(self, timeout_s: float) -> EngineCoreReady:
        """:raises RuntimeError: if the engine core failed, exited or timed out while starting."""
        with anyio.move_on_after(timeout_s) as scope:
            async with anyio.create_task_group() as group:
                result: list[EngineCoreReady | EngineDead | str] = []

                async def first_message() -> None:
                    result.append(await self.outputs.receive())
                    group.cancel_scope.cancel()

                async def death() -> None:
                    code = await self.wait_exit()
                    result.append(f"engine core exited with code {code} while starting")
                    group.cancel_scope.cancel()

                group.start_soon(first_message)
                group.start_soon(death)
        if scope.cancelled_caught or not result:
            raise RuntimeError(f"engine core did not become ready within {timeout_s:.0f} s")
        first = result[0]
        if isinstance(first, EngineCoreReady):
            return first
        raise RuntimeError(first.error if isinstance(first, EngineDead) else first)

    async def wait_exit(self) -> int | None:
        """Block (without CPU) until the process exits; its exit code."""
        await anyio.to_thread.run_sync(self.process.join, abandon_on_cancel=True)
        return self.process.exitcode

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the engine core stops its workers, within ``timeout_s``), else SIGKILL."""
        self.inputs.close()
        self.outputs.close()
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._context.term()
        # The engine core's bound sockets' files: it exits without closing them.
        for address in (self.addresses.input, self.addresses.output):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.removeprefix("ipc://"))
