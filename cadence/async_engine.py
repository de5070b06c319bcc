"""The front-end API of a running engine, for servers: ``generate()`` is an async iterator.

The request manager and detokenizer actors live here, in the caller's process; the engine core
(scheduler, KV allocator, executor) runs in its own process by default, or in this one
(``in_process=True``, for tests and embedding). Cancelling a ``generate()`` aborts its request in
the engine, which frees its KV blocks within one step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from transformers import PreTrainedTokenizerBase

from cadence.config import EngineConfig
from cadence.core.actor import Actor, EngineDeadError, Mailbox, run_actors
from cadence.core.detokenizer_actor import DetokenizerActor
from cadence.core.engine import Engine, model_limits
from cadence.core.engine_core_process import EngineAddresses, EngineCoreProcess
from cadence.core.request_manager import ModelLimits, Prompt, RequestManager, tokenize_prompt, validate_request
from cadence.messages import EngineCoreOutputs, EngineDead, RequestOutput, SchedulerStats
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.sampling_params import SamplingParams
from cadence.transport.forwarder import Forwarder

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class AsyncEngine:
    """A running engine. Build it with :meth:`launch`."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                 manager: RequestManager, max_waiting_requests: int | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self._manager = manager
        self._max_waiting = max_waiting_requests
        self._ids = itertools.count()
        self.dead: str | None = None
        # The engine-core process, when there is one (tests reach its sockets and pid through these).
        self._process_addresses: EngineAddresses | None = None
        self._process_pid: int | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, config: EngineConfig, *, in_process: bool = False, max_waiting_requests: int | None = None,
                     startup_timeout_s: float = 600.0, log_level: str = "WARNING",
                     on_dead: Callable[[str], None] | None = None) -> AsyncIterator[AsyncEngine]:
        """Start the engine (its core in a separate process unless ``in_process``); stop it on exit.

        ``on_dead`` is called once if the engine dies while running.
        :raises RuntimeError: if the engine core fails to start.
        """
        if in_process:
            engine = Engine(config)
            fronts: list[AsyncEngine] = []
            async with engine.running(on_crash=lambda message: fronts[0]._die(message, on_dead)) as manager:
                fronts.append(cls(config, engine.tokenizer, engine.limits, manager, max_waiting_requests))
                yield fronts[0]
            return
        tokenizer = load_tokenizer(config.model.path)
        hf_config = load_hf_config(config.model.path)
        process = EngineCoreProcess(config, log_level)
        process.start()
        try:
            ready = await process.wait_ready(startup_timeout_s)
            limits = model_limits(config, hf_config, ready.num_blocks, tokenizer)
            async with cls._front_end(config, tokenizer, limits, process, max_waiting_requests, on_dead) as front:
                yield front
        finally:
            process.shutdown()

    @classmethod
    @contextlib.asynccontextmanager
    async def _front_end(cls, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                         process: EngineCoreProcess, max_waiting_requests: int | None,
                         on_dead: Callable[[str], None] | None) -> AsyncIterator[AsyncEngine]:
        detokenizer = DetokenizerActor(tokenizer)
        manager = RequestManager(tokenizer, limits)
        detokenizer.connect(process.inputs, manager)
        manager.connect(process.inputs, detokenizer)
        front = cls(config, tokenizer, limits, manager, max_waiting_requests)
        front._process_addresses = process.addresses
        front._process_pid = process.process.pid
        routes: dict[type, Mailbox[Any]] = {EngineCoreOutputs: detokenizer, EngineDead: _DeathNotice(front, on_dead)}
        forwarder = Forwarder(process.outputs, routes, "engine-output")
        error: BaseException | None = None
        async with anyio.create_task_group() as group:
            actors: list[Actor[Any]] = [detokenizer, manager, forwarder]
            group.start_soon(run_actors, actors, lambda message: front._die(message, on_dead))
            group.start_soon(front._watch_process, process, on_dead)
            try:
                yield front
            except BaseException as exc:  # re-raised unwrapped, outside the task group
                error = exc
            finally:
                group.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _watch_process(self, process: EngineCoreProcess, on_dead: Callable[[str], None] | None) -> None:
        code = await process.wait_exit()
        self._die(f"engine core process exited with code {code}", on_dead)

    def _die(self, message: str, on_dead: Callable[[str], None] | None) -> None:
        if self.dead is not None:
            return
        logger.error("engine died: %s", message)
        self.dead = message
        self._manager.fail_all(message)
        if on_dead is not None:
            on_dead(message)

    # ---- requests ----------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine core's state after its latest step (None before the first step)."""
        return self._manager.detokenizer.latest_stats

    @property
    def num_pending_requests(self) -> int:
        return self._manager.num_pending

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """:raises ValueError: saying what to change."""
        validate_request(self.limits, prompt_token_ids, params)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, user: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its progress: after each step, the sequences that changed
        with only their new text and tokens. Leaving the loop early (or being cancelled) aborts it.

        :raises ValueError: for a bad prompt or parameters (nothing is admitted).
        :raises EngineOverloadedError: when ``max_waiting_requests`` are already pending.
        :raises EngineDeadError: if the engine is dead or dies before the request finishes.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self._max_waiting is not None and self._manager.num_pending >= self._max_waiting:
            raise EngineOverloadedError(f"the engine already has {self._manager.num_pending} requests pending "
                                        f"(--max-waiting-requests {self._max_waiting}); retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        handle = await self._manager.add_request(request_id, prompt, params, priority=priority, user=user)
        finished = False
        try:
            async for delta in handle.deltas():
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._manager.abort(request_id, params.n)


class _DeathNotice:
    """The mailbox for an ``EngineDead`` message from the engine-core process."""

    def __init__(self, front: AsyncEngine, on_dead: Callable[[str], None] | None) -> None:
        self.front = front
        self.on_dead = on_dead

    async def send(self, message: EngineDead) -> None:
        self.front._die(message.error, self.on_dead)

    def close(self) -> None:
        pass
