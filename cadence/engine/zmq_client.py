"""The engine core in its own process (:mod:`cadence.core.core_process`), reached over two ZMQ
sockets: requests and aborts out, outputs in.

The client starts the process from the fork server (:mod:`cadence.runtime.fork_server`: the
engine's modules are imported there once), waits for its ready message, and
watches it: if the process exits, or reports its own death, every request pending on it fails at
once. :meth:`ZmqCoreClient.shutdown` stops it with SIGTERM (the engine core stops its workers
first), SIGKILL after a timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.to_thread
import zmq.asyncio

from cadence.config import EngineConfig
from cadence.core.core_process import EngineAddresses, engine_core_main
from cadence.engine.core_client import EngineCoreClient
from cadence.errors import EngineDeadError
from cadence.messages import (
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineDead,
)
from cadence.runtime.actor import Actor, Mailbox, NowaitMailbox
from cadence.runtime.fork_server import forked_process
from cadence.runtime.forwarder import Forwarder
from cadence.runtime.zmq_channel import ZmqReceiveChannel, ZmqSendChannel


class ZmqCoreClient(EngineCoreClient):
    """The front end's handle on one engine-core process and its two channels."""

    def __init__(self, config: EngineConfig, log_level: str = "WARNING") -> None:
        self.rank = rank = config.parallel.data_parallel_rank
        self.addresses = EngineAddresses.fresh()
        # Not a daemon under the mp executor: daemons may not start processes, and that engine core
        # starts its tensor-parallel workers. shutdown() stops it either way; its workers exit with it.
        self.process = forked_process(engine_core_main, (config, self.addresses, log_level),
                                      f"cadence-engine-core-{rank}", daemon=config.parallel.executor_backend != "mp")
        self._context = zmq.asyncio.Context()
        # Unbounded: the request manager submits without waiting (admission bounds what it sends).
        self.inputs: ZmqSendChannel[EngineCoreInput] = ZmqSendChannel(
            self._context, self.addresses.input, EngineCoreInput, bind=False, unbounded=True)
        self.outputs: ZmqReceiveChannel[Any] = ZmqReceiveChannel(
            self._context, self.addresses.output, EngineCoreEvent, bind=False)
        self._exit_code: Future[int | None] | None = None

    def start(self) -> None:
        self.process.start()
        # One thread reaps the process and everyone else waits on its result: two concurrent joins
        # race in waitpid, and the loser reads no exit code (nor knows the process is dead).
        exit_code: Future[int | None] = Future()
        self._exit_code = exit_code

        def reap() -> None:
            self.process.join()
            exit_code.set_result(self.process.exitcode)

        threading.Thread(target=reap, name=f"{self.process.name}-reaper", daemon=True).start()

    async def wait_ready(self, timeout_s: float) -> EngineCoreReady:
        """Wait for the engine core's ready message; it sets :attr:`num_blocks` and :attr:`policy`.

        :raises RuntimeError: if the engine core failed, exited or timed out while starting.
        """
        with anyio.move_on_after(timeout_s) as scope:
            async with anyio.create_task_group() as group:
                result: list[EngineCoreReady | EngineDead | str] = []

                async def first_message() -> None:
                    result.append(await self.outputs.receive())
                    group.cancel_scope.cancel()

                async def death() -> None:
                    code = await self._wait_exit()
                    result.append(f"engine core exited with code {code} while starting")
                    group.cancel_scope.cancel()

                group.start_soon(first_message)
                group.start_soon(death)
        if scope.cancelled_caught or not result:
            raise RuntimeError(f"engine core did not become ready within {timeout_s:.0f} s")
        first = result[0]
        if isinstance(first, EngineCoreReady):
            self.num_blocks = first.num_blocks
            self.policy = first.policy
            return first
        raise RuntimeError(first.error if isinstance(first, EngineDead) else first)

    def connect(self, outputs_to: Mailbox[EngineCoreOutputs], on_dead: Callable[[str], None]
                ) -> tuple[NowaitMailbox[EngineCoreInput], list[Actor[Any]]]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        routes: dict[type, Mailbox[Any]] = {EngineCoreOutputs: outputs_to, EngineDead: _DeathNotice(on_dead)}
        return self.inputs, [Forwarder(self.outputs, routes, f"engine-output-{self.rank}")]

    async def watch(self, on_dead: Callable[[str], None]) -> None:
        code = await self._wait_exit()
        on_dead(f"engine core process exited with code {code}")

    async def _wait_exit(self) -> int | None:
        """Block (without CPU) until the process exits; its exit code."""
        assert self._exit_code is not None, "the process was never started"
        return await anyio.to_thread.run_sync(self._exit_code.result, abandon_on_cancel=True)

    def exit_code(self, timeout_s: float) -> int | None:
        """The process's exit status once it has exited, waiting up to ``timeout_s`` (None: still
        running). Ask here rather than the process: its reaper reads the status, and a join racing
        that one reads none (from the fork server: 255)."""
        assert self._exit_code is not None, "the process was never started"
        try:
            return self._exit_code.result(timeout_s)
        except TimeoutError:
            return None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the engine core stops its workers, within ``timeout_s``), else SIGKILL."""
        self.inputs.close()
        self.outputs.close()
        if self._exit_code is not None and not self._exit_code.done():
            self.process.terminate()
            try:
                self._exit_code.result(timeout_s)
            except TimeoutError:
                self.process.kill()
                self._exit_code.result()
        self._context.term()
        # The engine core exits without closing its bound sockets' files.
        self.addresses.remove_files()


class _DeathNotice:
    """The mailbox for an ``EngineDead`` message from the engine-core process."""

    def __init__(self, on_dead: Callable[[str], None]) -> None:
        self._on_dead = on_dead

    async def send(self, message: EngineDead) -> None:
        self._on_dead(message.error)

    def close(self) -> None:
        pass
