"""What the handlers share: the server's settings and state, admission, and :class:`Generation`,
which runs one API request's prompts through the engine.

An admitted request is in flight, with a cancel scope of its own, until its handler returns: a
graceful shutdown waits for it, and cancels the scope once the grace period is over (its
``generate()`` then aborts the engine request, which frees its KV blocks within one engine step).
A client that disconnects cancels its handler task (aiohttp's ``handler_cancellation``), with the
same effect.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

import anyio
from aiohttp import web

from cadence.api.constraints import ConstraintChecks
from cadence.api.errors import APIError, bad_request, overloaded
from cadence.api.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PREPROCESS_TIMEOUT_S,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)
from cadence.api.logprobs import TokenTexts
from cadence.api.lora_adapters import LoRAAdapters, LoRAModule
from cadence.api.metrics import APIMetrics, EngineState, RequestTimer
from cadence.api.params import TextBound, longest_token_bytes
from cadence.api.reasoning_parsers import load_reasoning_parser
from cadence.api.request_body import read_json
from cadence.api.tool_parsers import load_tool_parser
from cadence.engine.admission import PreparedRequest
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.prefix_tokenizer import PrefixTokenizer
from cadence.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from cadence.lora_request import LoRARequest
from cadence.messages import RequestOutput
from cadence.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


T = TypeVar("T")

@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side's options (the engine's are in its ``EngineConfig``)."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    preprocess_timeout_s: float = DEFAULT_PREPROCESS_TIMEOUT_S
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    # Tools and reasoning (docs/tools_and_reasoning.md): parser names, and a chat template's text.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None
    # LoRA (docs/lora.md): adapters served from the start, and whether clients may load and unload more.
    lora_modules: tuple[LoRAModule, ...] = ()
    allow_runtime_lora_updating: bool = False
    dashboard: bool = False  # GET /dashboard, live (api/dashboard.py)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("give at least one served model name")
        self._check_lora_modules()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        # Refused here, before the engine starts, like any bad option.
        if self.tool_call_parser is not None:
            load_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            load_reasoning_parser(self.reasoning_parser)
        for flag, value in (("--max-request-body-bytes", self.max_request_body_bytes),
                            ("--request-read-timeout", self.request_read_timeout_s),
                            ("--preprocess-timeout", self.preprocess_timeout_s),
                            ("--grammar-compile-timeout", self.grammar_compile_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def _check_lora_modules(self) -> None:
        """What can be refused before the engine starts: names taken twice or by a base model, and
        parents that are not served; the adapters themselves are checked against the model once it
        runs (:class:`APIState`)."""
        names = [m.name for m in self.lora_modules]
        for module in self.lora_modules:
            if module.name in self.served_model_names:
                raise ValueError(f"--lora-modules: {module.name!r} is a served model name (--served-model-name); "
                                 "give the adapter another name")
            if names.count(module.name) > 1:
                raise ValueError(f"--lora-modules: {module.name!r} is given more than once")
            if module.base_model_name not in (None, *self.served_model_names):
                raise ValueError(f"--lora-modules: adapter {module.name!r} names base_model_name "
                                 f"{module.base_model_name!r}, which is not a served model name (served: "
                                 f"{', '.join(self.served_model_names)})")


@dataclass(frozen=True)
class ServedModel:
    """What a request's ``model`` selects: the name its response reports, and the LoRA adapter it
    runs with (None: the base model)."""

    name: str
    lora_request: LoRARequest | None = None


class InFlight:
    """An admitted request; its generation runs inside ``scope``."""

    __slots__ = ("aborted", "scope")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.aborted = False


class APIState:
    """One app's engine, settings, served LoRA adapters, metrics and in-flight generations.

    :raises ValueError: (on creation) for a ``--lora-modules`` adapter that does not fit the model.
    """

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.prompt_tokens = PrefixTokenizer(engine.tokenizer)  # reuses the ids of prompts' shared starts
        self.limits = engine.limits
        self.texts = TokenTexts(engine.tokenizer)
        self.metrics = APIMetrics(settings.model_name, self.limits.max_model_len, self._engine_states)
        self.constraints = ConstraintChecks(settings.grammar_compile_timeout_s)
        self.text_bound = TextBound(self.limits.max_model_len, longest_token_bytes(engine.tokenizer))
        self.tool_parser = None if settings.tool_call_parser is None else load_tool_parser(settings.tool_call_parser)
        self.reasoning_parser = (None if settings.reasoning_parser is None
                                 else load_reasoning_parser(settings.reasoning_parser))
        self.created = int(time.time())
        self.closing = False
        self._in_flight: set[InFlight] = set()
        self.adapters = LoRAAdapters(self.limits, settings.served_model_names)
        for module in settings.lora_modules:
            try:
                self.adapters.add(module.name, module.path, module.base_model_name)
            except InvalidRequestError as exc:
                raise ValueError(f"--lora-modules: {exc}") from None  # the message names the adapter

    def _engine_states(self) -> list[EngineState]:
        """Per engine core, in rank order; a pool's usable blocks exclude its null block."""
        return [EngineState(c.stats, c.num_pending, c.client.num_blocks - 1, c.client.policy)
                for c in self.engine.cores]

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def read(self, request: web.Request, kind: type[T]) -> T:
        """The request's body as ``kind``, within this server's size and time limits (:func:`read_json`)."""
        return await read_json(request, kind, max_bytes=self.settings.max_request_body_bytes,
                               timeout_s=self.settings.request_read_timeout_s)

    def check_model(self, model: str | None) -> ServedModel:
        """What ``model`` selects: the base model (under its first served name) or a served LoRA
        adapter (under its own name, as vLLM reports it).

        :raises APIError: 404 ``model_not_found`` for a name this server does not serve (also an
            adapter unloaded since).
        """
        if model is None or model in self.settings.served_model_names:
            return ServedModel(self.settings.model_name)
        adapter = self.adapters.get(model)
        if adapter is not None:
            return ServedModel(model, adapter.lora_request)
        served = ", ".join(self.settings.served_model_names)
        if len(self.adapters):
            served += " and LoRA adapters (GET /v1/models lists them)"
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    @contextlib.contextmanager
    def admitted(self, num_requests: int) -> Iterator[InFlight]:
        """Admit a request of ``num_requests`` prompts and count it as in flight while inside; a
        graceful shutdown waits for it, then cancels ``entry.scope`` (see :class:`Generation`).

        :raises APIError: as :meth:`check_admission`.
        """
        self.check_admission(num_requests)
        entry = InFlight()
        self._in_flight.add(entry)
        try:
            yield entry
        finally:
            self._in_flight.discard(entry)

    def check_admission(self, num_requests: int) -> None:
        """Whether a request of ``num_requests`` prompts would be admitted now (handlers ask before
        tokenizing, so that an overloaded server does no work for a request it refuses).

        :raises APIError: 503 when shutting down, the engine is dead, or too many requests wait
            (with ``Retry-After``); 400 for a batch that could never be admitted.
        """
        if self.closing:
            raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
        if self.engine.dead is not None:
            raise engine_dead(self.engine.dead)
        limit = self.settings.max_waiting_requests
        if limit is None:
            return
        if num_requests > limit:
            raise bad_request(f"the request has {num_requests} prompts; this server admits at most {limit} at once "
                              f"(--max-waiting-requests); split the batch", param="prompt")
        pending = self.engine.num_pending_requests
        if pending + num_requests > limit:
            raise overloaded(f"the server is overloaded: {pending} requests pending (--max-waiting-requests "
                             f"{limit}); retry later")

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, wait up to ``grace_s`` for those in flight, then abort the rest."""
        self.closing = True
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        if self._in_flight:
            logger.warning("aborting %d requests still running after the %.1f s grace period",
                           len(self._in_flight), grace_s)
        for entry in list(self._in_flight):
            entry.aborted = True
            entry.scope.cancel()
        with anyio.move_on_after(5.0):
            while self._in_flight:
                await anyio.sleep(0.02)


def prepare(state: APIState, prompt_ids: list[int], params: SamplingParams, *, prompt_param: str,
            lora_request: LoRARequest | None = None) -> PreparedRequest:
    """The engine's admission checks (vocabulary, KV capacity, the adapter ...), run once, before
    anything is admitted.

    :raises APIError: 400 saying what to change, naming the field (``prompt_param`` for the prompt).
    """
    try:
        return state.engine.prepare(prompt_ids, params, lora_request)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=prompt_param if exc.param == "prompt" else exc.param) from None


def engine_dead(reason: str) -> APIError:
    return APIError(503, f"the engine is dead: {reason}", code="engine_dead")


def request_failed(reason: str) -> APIError:
    """A request the engine ended with finish reason "error", which is no OpenAI finish reason."""
    return APIError(500, f"the request failed in the engine: {reason}", code="internal_error")


DeltaHandler = Callable[[int, RequestOutput], Awaitable[None]]


class Generation:
    """One API request: one engine request per prompt (each with ``params.n`` sequences), run
    concurrently; every delta goes to ``on_delta(prompt_index, delta)``.

    :meth:`run` raises :class:`APIError` when the request cannot finish (engine dead, overloaded,
    aborted by shutdown, failed in the engine); anything ``on_delta`` raises (a write to a client
    that left) propagates.
    """

    def __init__(self, state: APIState, request_id: str, requests: list[PreparedRequest], *,
                 priority: int = 0, user: str | None = None, arrival: float | None = None) -> None:
        self.state = state
        self.request_id = request_id
        self.requests = requests
        self.priority = priority
        self.user = user
        self.arrival = time.monotonic() if arrival is None else arrival
        self._error: BaseException | None = None

    async def run(self, entry: InFlight, on_delta: DeltaHandler) -> None:
        """Generate within ``entry`` (from :meth:`APIState.admitted`)."""
        with entry.scope:
            if len(self.requests) == 1:
                await self._one(0, on_delta)
            else:
                async with anyio.create_task_group() as group:
                    for index in range(len(self.requests)):
                        group.start_soon(self._guarded, index, on_delta, group.cancel_scope)
                if self._error is not None:
                    raise self._error
        if entry.aborted:
            raise APIError(503, "the server shut down before the request finished; it was aborted",
                           code="shutting_down")

    async def _guarded(self, index: int, on_delta: DeltaHandler, scope: anyio.CancelScope) -> None:
        """Run one prompt; the first failure is kept and stops its siblings (no exception groups)."""
        try:
            await self._one(index, on_delta)
        except Exception as exc:
            if self._error is None:
                self._error = exc
            scope.cancel()

    async def _one(self, index: int, on_delta: DeltaHandler) -> None:
        state, request = self.state, self.requests[index]
        timer = RequestTimer(state.metrics, len(request.prompt_token_ids), request.params.n, self.arrival)
        outcome = "abort"
        # ``generate`` is an async generator (its annotation says only AsyncIterator).
        deltas = cast("AsyncGenerator[RequestOutput, None]", state.engine.generate(
            request, request_id=f"{self.request_id}-{index}", priority=self.priority, user=self.user))
        try:
            # aclosing: leaving early for any reason (client gone, shutdown) aborts the engine request now.
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    timer.on_delta(delta)
                    if delta.error is not None:
                        outcome = "error"  # for its sequences still running, aborted on the way out
                        raise request_failed(delta.error)
                    if any(seq.finish_reason == "abort" for seq in delta.outputs):
                        raise APIError(503, "the request was aborted by the server", code="aborted")
                    await on_delta(index, delta)
        except EngineDeadError as exc:
            outcome = "error"
            raise engine_dead(str(exc)) from None
        except EngineOverloadedError as exc:
            raise overloaded(str(exc)) from None
        except InvalidRequestError as exc:  # only a request id in use gets here: the checks ran in prepare()
            raise bad_request(str(exc), param=exc.param) from None
        finally:
            timer.close(outcome)
