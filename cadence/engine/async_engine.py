"""The front end's API: :class:`AsyncEngine`, whose ``generate()`` is an async iterator.

The request manager and detokenizer actors live in the caller's process; the engine core
(scheduler, KV allocator, executor) runs in its own process (:meth:`AsyncEngine.launch`, for
servers) or in this one (``in_process=True``, and the offline ``LLM``, which runs
:meth:`AsyncEngine.running` over its own in-process engine core). Cancelling a ``generate()``
aborts its request in the engine, which frees its KV blocks within one step.

With ``data_parallel_size`` N > 1 there are N engine-core processes, each behind its own request
manager and detokenizer here, and a router (``cadence/engine/routers/``, ``--router``) picks the
engine core for each request (aborts go to the one that holds the request). If any engine core
dies, the engine as a whole is dead, as in vLLM: that core's requests fail at once, new requests
are refused, and the other cores finish what they hold.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
from transformers import PreTrainedTokenizerBase

from cadence.config import EngineConfig
from cadence.engine.admission import ModelLimits, PreparedRequest, Prompt, prepare_request
from cadence.engine.core_client import EngineCoreClient
from cadence.engine.dashboard_feed import DashboardFeed
from cadence.engine.front_end import CoreFrontEnd, build_front_end
from cadence.engine.request_manager import RequestHandle
from cadence.engine.routers.base import RouterContext, load_router, router_class
from cadence.engine.zmq_client import ZmqCoreClient
from cadence.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from cadence.lora_request import LoRARequest
from cadence.messages import LoRAStats, RequestOutput, SchedulerStats, SpecDecodeStats
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.runtime.actor import run_actors
from cadence.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DeathHook = Callable[[str], None]


class AsyncEngine:
    """A running engine: one engine core, or several behind a router. Get one from :meth:`launch`
    (it starts the engine cores) or :meth:`running` (over engine cores already started)."""

    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                 clients: Sequence[EngineCoreClient], *, max_waiting_requests: int | None = None,
                 on_dead: DeathHook | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        # One engine core: no router, nothing added to the request path.
        self._router = None if len(clients) == 1 else load_router(config.parallel.router, RouterContext(
            len(clients), config.cache.block_size, config.cache.enable_prefix_caching, config.model.seed,
            config.cache.prefix_caching_hash_algo))
        self.cores = tuple(build_front_end(client, tokenizer, limits, functools.partial(self._die, rank), self._router)
                           for rank, client in enumerate(clients))
        self._max_waiting = max_waiting_requests
        self._on_dead = on_dead
        self.dead: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, config: EngineConfig, *, in_process: bool = False, max_waiting_requests: int | None = None,
                     startup_timeout_s: float = 600.0, log_level: str = "WARNING",
                     on_dead: DeathHook | None = None, stall_timeout_s: float | None = None
                     ) -> AsyncIterator[AsyncEngine]:
        """Start the engine (its cores in separate processes unless ``in_process``); stop it on exit.

        ``on_dead`` is called once if an engine core dies while running (or stalls: see :meth:`running`).
        :raises RuntimeError: if an engine core fails to start.
        :raises ValueError: for ``in_process`` with more than one data-parallel engine core, or a
            router that is not installed.
        """
        if config.parallel.data_parallel_size > 1:
            router_class(config.parallel.router)  # an unknown name fails before any engine core starts
        tokenizer = load_tokenizer(config.model.path)
        clients: list[EngineCoreClient] = []
        try:
            if in_process:
                clients.append(_in_process_client(config))
            else:
                zmq_clients = [ZmqCoreClient(config.for_data_parallel_rank(rank), log_level)
                               for rank in range(config.parallel.data_parallel_size)]
                clients.extend(zmq_clients)
                # All started before the first await: the server relies on it for its signal handling.
                for zmq_client in zmq_clients:
                    zmq_client.start()
                await _wait_all_ready(zmq_clients, startup_timeout_s)
            # Admission checks hold against every engine core's pool.
            limits = ModelLimits.of(config, load_hf_config(config.model.path), min(c.num_blocks for c in clients),
                                    tokenizer)
            async with cls.running(config, tokenizer, limits, clients, max_waiting_requests=max_waiting_requests,
                                   on_dead=on_dead, stall_timeout_s=stall_timeout_s) as engine:
                yield engine
        finally:
            for client in clients:
                client.shutdown()

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                      clients: Sequence[EngineCoreClient], *, max_waiting_requests: int | None = None,
                      on_dead: DeathHook | None = None, stall_timeout_s: float | None = None
                      ) -> AsyncIterator[AsyncEngine]:
        """Run the front end's actors (and an in-process engine core's) over ``clients`` while the
        caller uses the engine; the engine cores outlive it.

        With ``stall_timeout_s``, an engine core that stays silent that long while requests are
        pending on it (a step that never ends) counts as dead: its requests fail, and the engine is
        unhealthy.

        :raises EngineDeadError: if an engine core is dead already.
        """
        engine = cls(config, tokenizer, limits, clients, max_waiting_requests=max_waiting_requests, on_dead=on_dead)
        error: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                for rank, core in enumerate(engine.cores):
                    # Each engine core's actors in a group of their own: one crashing fails only its requests.
                    die = functools.partial(engine._die, rank)
                    group.start_soon(run_actors, core.actors, die)
                    group.start_soon(core.client.watch, die)
                    if stall_timeout_s is not None:
                        group.start_soon(_watch_progress, core, stall_timeout_s, die)
                try:
                    yield engine
                except BaseException as exc:  # re-raised unwrapped, outside the task group
                    error = exc
                finally:
                    group.cancel_scope.cancel()
        finally:
            for client in clients:
                client.disconnect()
        if error is not None:
            raise error

    def _die(self, rank: int, message: str) -> None:
        """Engine core ``rank`` died: fail its requests; the first death makes the whole engine dead."""
        core = self.cores[rank]
        if core.client.dead is not None:
            return
        if len(self.cores) > 1:
            message = f"engine core {rank} of {len(self.cores)}: {message}"
        logger.error("engine died: %s", message)
        core.client.dead = message
        core.manager.fail_all(message)
        if self.dead is None:
            self.dead = message
            if self._on_dead is not None:
                self._on_dead(message)

    # ---- state -------------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine core's state after its latest step (None before the first step); with several
        engine cores, their states summed (None until each has stepped)."""
        if len(self.cores) == 1:
            return self.cores[0].stats
        stats = [c.stats for c in self.cores]
        return None if None in stats else _sum_stats([s for s in stats if s is not None])

    @property
    def num_pending_requests(self) -> int:
        return sum(c.num_pending for c in self.cores)

    def watch(self, feed: DashboardFeed) -> None:
        """Tell ``feed`` (one slot per engine core) of every request from now on, and of each engine
        core's state after its steps (the dashboard)."""
        for core in self.cores:
            core.detokenizer.watch(feed, core.rank)

    # ---- requests ----------------------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams, lora_request: LoRARequest | None = None
                ) -> PreparedRequest:
        """Tokenize and check a request (to run with ``lora_request``'s adapter, if given) without
        submitting it (see :mod:`cadence.engine.admission`).

        :raises InvalidRequestError: saying what to change, with the field in ``param``.
        """
        return prepare_request(self.tokenizer, self.limits, prompt, params, lora_request)

    async def submit(self, request: PreparedRequest, request_id: str | None = None, *, priority: int = 0,
                     user: str | None = None) -> RequestHandle:
        """Submit a prepared request; read its outputs from the handle (or abort it with :meth:`abort`).

        ``request_id`` is any string not in use by a pending request (default: a fresh one).

        :raises InvalidRequestError: if ``request_id`` is in use.
        :raises EngineOverloadedError: when ``max_waiting_requests`` are already pending.
        :raises EngineDeadError: if the engine is dead.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        pending = self.num_pending_requests
        if self._max_waiting is not None and pending >= self._max_waiting:
            raise EngineOverloadedError(f"the engine already has {pending} requests pending "
                                        f"(--max-waiting-requests {self._max_waiting}); retry later")
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif any(request_id in core.manager for core in self.cores):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        core = self._route(request)
        return core.manager.add_request(request_id, request, priority=priority, user=user)

    async def generate(self, prompt: Prompt | PreparedRequest, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       user: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its progress: after each step, the sequences that changed
        with only their new text and tokens. Leaving the loop early (or being cancelled) aborts it.

        ``prompt`` is text or token ids with their ``params``, or a request from :meth:`prepare`
        (which carries its own parameters: pass no ``params``).

        :raises InvalidRequestError: for a bad prompt or parameters, or an id in use (nothing is admitted).
        :raises EngineOverloadedError: when ``max_waiting_requests`` are already pending.
        :raises EngineDeadError: if the engine is dead or dies before the request finishes.
        """
        request = _prepared(self, prompt, params)
        handle = await self.submit(request, request_id, priority=priority, user=user)
        finished = False
        try:
            async for delta in handle.deltas():
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self.abort(handle.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a pending request (all of its sequences); unknown ids are ignored."""
        for core in self.cores:
            if request_id in core.manager:
                await core.manager.abort(request_id)

    def _route(self, request: PreparedRequest) -> CoreFrontEnd:
        if self._router is None:
            return self.cores[0]
        salt = None if request.lora_request is None else request.lora_request.cache_salt
        return self.cores[self._router.choose_salted([c.load for c in self.cores], request.prompt_token_ids, salt)]


def _prepared(engine: AsyncEngine, prompt: Prompt | PreparedRequest, params: SamplingParams | None
              ) -> PreparedRequest:
    if isinstance(prompt, PreparedRequest):
        if params is not None:
            raise TypeError("a prepared request carries its own sampling parameters; pass no params")
        return prompt
    if params is None:
        raise TypeError("generate() needs params for a text or token-id prompt")
    return engine.prepare(prompt, params)


async def _watch_progress(core: CoreFrontEnd, timeout_s: float, die: DeathHook) -> None:
    """Tell ``die`` once ``core``'s engine core has been silent for ``timeout_s`` with requests pending."""
    while True:
        await anyio.sleep(min(1.0, timeout_s / 4))
        silent = core.stalled_for(time.monotonic())
        if silent >= timeout_s:
            die(f"the engine core made no progress for {silent:.0f} s with {core.num_pending} requests pending "
                f"(a step that never ends?); see --engine-stall-timeout")
            return


def _in_process_client(config: EngineConfig) -> EngineCoreClient:
    if config.parallel.data_parallel_size > 1:
        raise ValueError("data parallelism runs each engine core in its own process; "
                         "launch without in_process or with data_parallel_size 1")
    # Here, not at the top: a server's process never builds an engine core, and must not load the
    # model code for it.
    from cadence.engine.inproc_client import InProcessCoreClient

    return InProcessCoreClient.start(config)


async def _wait_all_ready(clients: Sequence[ZmqCoreClient], timeout_s: float) -> None:
    """Wait for every engine core's ready message; the first failure ends the wait.

    :raises RuntimeError: saying which engine core failed and why.
    """
    failures: list[str] = []
    async with anyio.create_task_group() as group:

        async def wait(client: ZmqCoreClient) -> None:
            try:
                await client.wait_ready(timeout_s)
            except RuntimeError as exc:
                failures.append(str(exc) if len(clients) == 1 else
                                f"engine core {client.rank} of {len(clients)}: {exc}")
                group.cancel_scope.cancel()

        for client in clients:
            group.start_soon(wait, client)
    if failures:
        raise RuntimeError(failures[0])


def _sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' states as one: counts and times summed, KV cache usage weighted by pool size."""
    usable = [s.num_blocks - 1 for s in stats]
    spec = [s.spec_decode for s in stats if s.spec_decode is not None]
    lora = [s.lora for s in stats if s.lora is not None]
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * u for s, u in zip(stats, usable, strict=True)) / sum(usable),
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_blocks=sum(s.num_blocks for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        step_time_s=sum(s.step_time_s for s in stats),
        forward_time_s=sum(s.forward_time_s for s in stats),
        spec_decode=SpecDecodeStats.total(spec) if spec else None,
        lora=LoRAStats.total(lora) if lora else None,
    )
