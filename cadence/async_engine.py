"""The front-end API of a running engine, for servers: ``generate()`` is an async iterator.

The request manager and detokenizer actors live here, in the caller's process; the engine core
(scheduler, KV allocator, executor) runs in its own process by default, or in this one
(``in_process=True``, for tests and embedding). Cancelling a ``generate()`` aborts its request in
the engine, which frees its KV blocks within one step.

With ``data_parallel_size`` N > 1 there are N engine-core processes, each behind its own request
manager and detokenizer here, and a :class:`~cadence.core.dp_router.DataParallelRouter` picks the
engine for each request (aborts go to the engine that holds the request, structurally: the request
keeps its engine). If any engine core dies, the engine as a whole is dead, as in vLLM: that core's
requests fail at once, new requests are refused, and the other cores finish what they hold.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from transformers import PreTrainedTokenizerBase

from cadence.config import EngineConfig
from cadence.core.actor import Actor, EngineDeadError, Mailbox, run_actors
from cadence.core.detokenizer_actor import DetokenizerActor
from cadence.core.dp_router import DataParallelRouter
from cadence.core.engine import Engine, model_limits
from cadence.core.engine_core_process import EngineCoreProcess
from cadence.core.request_manager import ModelLimits, Prompt, RequestManager, tokenize_prompt, validate_request
from cadence.messages import EngineCoreOutputs, EngineCoreReady, EngineDead, RequestOutput, SchedulerStats
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.sampling_params import SamplingParams
from cadence.transport.forwarder import Forwarder

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineClient:
    """One engine core as the front end sees it: the request manager (with its detokenizer) that
    talks to it, the size of its KV pool, its process (None in process), and why it died."""

    def __init__(self, rank: int, manager: RequestManager, num_blocks: int,
                 process: EngineCoreProcess | None = None) -> None:
        self.rank = rank
        self.manager = manager
        self.num_blocks = num_blocks  # the pool, the null block included
        self.process = process
        self.dead: str | None = None

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine core's state after its latest step (None before the first step)."""
        return self.manager.detokenizer.latest_stats

    @property
    def num_pending(self) -> int:
        return self.manager.num_pending

    @property
    def load(self) -> int:
        """What the router balances: requests pending here, with those the engine core reported
        queued counted twice (a queue means its batch is full, so a new request waits longer)."""
        stats = self.stats
        return self.manager.num_pending + (stats.num_waiting if stats is not None else 0)


class AsyncEngine:
    """A running engine (one engine core, or several behind a router). Build it with :meth:`launch`."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                 engines: Sequence[EngineClient], max_waiting_requests: int | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.engines = tuple(engines)
        # One engine core: no router, nothing added to the request path.
        self._router = None if len(engines) == 1 else DataParallelRouter(
            len(engines), config.cache.block_size, prefix_caching=config.cache.enable_prefix_caching)
        self._max_waiting = max_waiting_requests
        self._ids = itertools.count()
        self.dead: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, config: EngineConfig, *, in_process: bool = False, max_waiting_requests: int | None = None,
                     startup_timeout_s: float = 600.0, log_level: str = "WARNING",
                     on_dead: Callable[[str], None] | None = None) -> AsyncIterator[AsyncEngine]:
        """Start the engine (its cores in separate processes unless ``in_process``); stop it on exit.

        ``on_dead`` is called once if an engine core dies while running.
        :raises RuntimeError: if an engine core fails to start.
        :raises ValueError: for ``in_process`` with more than one data-parallel engine core.
        """
        if in_process:
            if config.parallel.data_parallel_size > 1:
                raise ValueError("data parallelism runs each engine core in its own process; "
                                 "launch without in_process or with data_parallel_size 1")
            engine = Engine(config)
            fronts: list[AsyncEngine] = []
            async with engine.running(on_crash=lambda message: fronts[0]._die(fronts[0].engines[0], message,
                                                                              on_dead)) as manager:
                client = EngineClient(0, manager, engine.allocator.num_blocks)
                fronts.append(cls(config, engine.tokenizer, engine.limits, [client], max_waiting_requests))
                yield fronts[0]
            return
        tokenizer = load_tokenizer(config.model.path)
        hf_config = load_hf_config(config.model.path)
        processes = [EngineCoreProcess(config.for_data_parallel_rank(rank), log_level)
                     for rank in range(config.parallel.data_parallel_size)]
        try:
            # All before the first await: the server relies on it for its signal handling.
            for process in processes:
                process.start()
            readies = await _wait_all_ready(processes, startup_timeout_s)
            # Admission checks hold against every engine core's pool.
            limits = model_limits(config, hf_config, min(r.num_blocks for r in readies), tokenizer)
            engines = [EngineClient(p.dp_rank, RequestManager(tokenizer, limits), r.num_blocks, p)
                       for p, r in zip(processes, readies, strict=True)]
            async with cls._front_end(cls(config, tokenizer, limits, engines, max_waiting_requests),
                                      on_dead) as front:
                yield front
        finally:
            for process in processes:
                process.shutdown()

    @staticmethod
    @contextlib.asynccontextmanager
    async def _front_end(front: AsyncEngine, on_dead: Callable[[str], None] | None) -> AsyncIterator[AsyncEngine]:
        """Run each engine core's front-end actors and watch its process while the caller uses ``front``."""
        error: BaseException | None = None
        async with anyio.create_task_group() as group:
            for engine in front.engines:
                # Each engine core's actors in a group of their own: one crashing fails only its requests.
                group.start_soon(run_actors, front._actors(engine, on_dead),
                                 functools.partial(front._die, engine, on_dead=on_dead))
                group.start_soon(front._watch_process, engine, on_dead)
            try:
                yield front
            except BaseException as exc:  # re-raised unwrapped, outside the task group
                error = exc
            finally:
                group.cancel_scope.cancel()
        if error is not None:
            raise error

    def _actors(self, engine: EngineClient, on_dead: Callable[[str], None] | None) -> list[Actor[Any]]:
        """The detokenizer, request manager and output forwarder of one engine-core process."""
        assert engine.process is not None  # only engines in their own process get here
        channels = engine.process
        detokenizer = DetokenizerActor(self.tokenizer)
        engine.manager.connect(channels.inputs, detokenizer)
        detokenizer.connect(channels.inputs, engine.manager)
        outputs_to: Mailbox[Any] = detokenizer
        if self._router is not None and self._router.prefix_caching:
            outputs_to = _PrefixCacheTap(self._router, engine.rank, detokenizer)
        routes: dict[type, Mailbox[Any]] = {EngineCoreOutputs: outputs_to,
                                            EngineDead: _DeathNotice(self, engine, on_dead)}
        forwarder = Forwarder(channels.outputs, routes, f"engine-output-{engine.rank}")
        return [detokenizer, engine.manager, forwarder]

    async def _watch_process(self, engine: EngineClient, on_dead: Callable[[str], None] | None) -> None:
        assert engine.process is not None
        code = await engine.process.wait_exit()
        self._die(engine, f"engine core process exited with code {code}", on_dead=on_dead)

    def _die(self, engine: EngineClient, message: str, on_dead: Callable[[str], None] | None) -> None:
        """``engine``'s core died: fail its requests; the first death also makes the engine as a whole dead."""
        if engine.dead is not None:
            return
        message = _on_rank(message, engine.rank, len(self.engines))
        logger.error("engine died: %s", message)
        engine.dead = message
        engine.manager.fail_all(message)
        if self.dead is None:
            self.dead = message
            if on_dead is not None:
                on_dead(message)

    # ---- requests ----------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine core's state after its latest step (None before the first step); with several
        engine cores, their states summed (None until each has stepped)."""
        if self._router is None:
            return self.engines[0].stats
        stats = [e.stats for e in self.engines]
        return None if None in stats else _sum_stats([s for s in stats if s is not None])

    @property
    def num_pending_requests(self) -> int:
        return sum(e.num_pending for e in self.engines)

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
        pending = self.num_pending_requests
        if self._max_waiting is not None and pending >= self._max_waiting:
            raise EngineOverloadedError(f"the engine already has {pending} requests pending "
                                        f"(--max-waiting-requests {self._max_waiting}); retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        engine, prompt, prompt_text = self._route(prompt)
        manager = engine.manager
        handle = await manager.add_request(request_id, prompt, params, priority=priority, user=user,
                                           prompt_text=prompt_text)
        finished = False
        try:
            async for delta in handle.deltas():
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await manager.abort(request_id, params.n)

    def _route(self, prompt: Prompt) -> tuple[EngineClient, Prompt, str | None]:
        """The engine core for a new request, and the prompt to give it (tokenized once, here, when
        the router needs the ids) with its text."""
        if self._router is None:
            return self.engines[0], prompt, None
        token_ids = tokenize_prompt(self.tokenizer, prompt)
        rank = self._router.choose([e.load for e in self.engines], token_ids)
        return self.engines[rank], token_ids, prompt if isinstance(prompt, str) else None


async def _wait_all_ready(processes: Sequence[EngineCoreProcess], timeout_s: float) -> list[EngineCoreReady]:
    """Each engine core's ready message, in rank order; the first failure ends the wait.

    :raises RuntimeError: saying which engine core failed and why.
    """
    readies: dict[int, EngineCoreReady] = {}
    failures: list[str] = []
    async with anyio.create_task_group() as group:

        async def wait(process: EngineCoreProcess) -> None:
            try:
                readies[process.dp_rank] = await process.wait_ready(timeout_s)
            except RuntimeError as exc:
                failures.append(_on_rank(str(exc), process.dp_rank, len(processes)))
                group.cancel_scope.cancel()

        for process in processes:
            group.start_soon(wait, process)
    if failures:
        raise RuntimeError(failures[0])
    return [readies[p.dp_rank] for p in processes]


def _on_rank(message: str, rank: int, num_engines: int) -> str:
    """A message about one engine core, naming it when there are several."""
    return message if num_engines == 1 else f"engine core {rank} of {num_engines}: {message}"


def _sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' states as one: counts summed, KV cache usage weighted by pool size."""
    usable = [s.num_blocks - 1 for s in stats]
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * u for s, u in zip(stats, usable, strict=True)) / sum(usable),
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_blocks=sum(s.num_blocks for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
    )


class _PrefixCacheTap:
    """One engine core's outputs on their way to its detokenizer. The router takes in the prefix
    cache's changes first, so it knows a request's blocks by the time the request's caller sees
    the output of the step that cached them."""

    def __init__(self, router: DataParallelRouter, rank: int, detokenizer: DetokenizerActor) -> None:
        self.router = router
        self.rank = rank
        self.detokenizer = detokenizer

    async def send(self, message: EngineCoreOutputs) -> None:
        if message.kv_delta is not None:
            self.router.apply(self.rank, message.kv_delta)
        await self.detokenizer.send(message)

    def close(self) -> None:
        self.detokenizer.close()


class _DeathNotice:
    """The mailbox for an ``EngineDead`` message from an engine-core process."""

    def __init__(self, front: AsyncEngine, engine: EngineClient, on_dead: Callable[[str], None] | None) -> None:
        self.front = front
        self.engine = engine
        self.on_dead = on_dead

    async def send(self, message: EngineDead) -> None:
        self.front._die(self.engine, message.error, self.on_dead)

    def close(self) -> None:
        pass
