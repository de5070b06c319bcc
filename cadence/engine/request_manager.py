"""The request manager actor: submits prepared requests to one engine core, fans out ``n``, owns
one output collector per request (:mod:`cadence.engine.output_collector`), and fails every pending
request at once if the engine dies.

Identity is structure, not string syntax: a caller's request id is any string, and each of its
``n`` sequences is a child known to the engine core by an id of the manager's own making; the
manager's table maps that id back to ``(parent, index)``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cadence.engine.admission import ModelLimits, PreparedRequest
from cadence.engine.output_collector import DeltaBatch, OutputCollector
from cadence.errors import EngineDeadError, InvalidRequestError
from cadence.messages import (
    AbortRequests,
    CompletionOutput,
    DetokenizedOutputs,
    EngineCoreRequest,
    RequestOutput,
    SequenceDelta,
    TokenLogprobs,
    TrackRequest,
)
from cadence.runtime.actor import UNBOUNDED, Actor, NowaitMailbox


class RequestHandle:
    """The caller's side of one request: its output stream, folded into cumulative results."""

    def __init__(self, request_id: str, prepared: PreparedRequest, outputs: OutputCollector) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._output = RequestOutput(
            request_id=request_id, prompt=prepared.prompt_text, prompt_token_ids=prepared.prompt_token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(prepared.params.n)],
            finished=False)

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """Yield the sequences that changed with only their new text and tokens: after each step, or,
        for a reader slower than the engine, what several steps added.

        :raises EngineDeadError: if the engine stopped before the request finished.
        """
        while (batch := await self._outputs.get()) is not None:
            delta = self._apply(batch)
            yield delta
            if self._output.finished:
                return
        raise EngineDeadError(self._outputs.error or f"request {self.request_id} lost its outputs before finishing")

    async def result(self) -> RequestOutput:
        """Wait for the request to finish and return its cumulative output."""
        async for _ in self.deltas():
            pass
        return self._output

    @property
    def output(self) -> RequestOutput:
        return self._output

    def _apply(self, batch: DeltaBatch) -> RequestOutput:
        changed = []
        new_prompt_logprobs: list[TokenLogprobs | None] | None = None
        for index, delta in batch:
            if delta.prompt_logprobs is not None and self._output.prompt_logprobs is None:
                # Every sequence of the request has the same prompt: the first to report gives them.
                new_prompt_logprobs = self._output.prompt_logprobs = [None, *delta.prompt_logprobs]
            if delta.error is not None:
                self._output.error = delta.error
            seq = self._output.outputs[index]
            seq.text += delta.new_text
            seq.token_ids.extend(delta.new_token_ids)
            if delta.new_logprobs is not None:
                seq.logprobs = (seq.logprobs or []) + delta.new_logprobs
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(
                    lp.logprobs[0] for lp in delta.new_logprobs)
            seq.finish_reason = delta.finish_reason
            seq.stop_reason = delta.stop_reason
            self._output.num_cached_tokens = max(self._output.num_cached_tokens, delta.num_cached_tokens)
            if delta.queue_time_s is not None:
                self._output.queue_time_s = delta.queue_time_s
            changed.append(msgspec.structs.replace(
                seq, text=delta.new_text, token_ids=delta.new_token_ids, logprobs=delta.new_logprobs))
        self._output.finished = all(s.finish_reason is not None for s in self._output.outputs)
        return msgspec.structs.replace(self._output, outputs=changed, prompt_logprobs=new_prompt_logprobs)


@dataclass(eq=False)
class _Parent:
    """A caller's request: its outputs, and its children (the engine core's ids) not yet finished."""

    outputs: OutputCollector
    unfinished: dict[str, int] = field(default_factory=dict)  # child id -> index


@dataclass(frozen=True, eq=False)
class _Child:
    parent_id: str
    parent: _Parent
    index: int


class RequestManager(Actor[DetokenizedOutputs]):
    inbox_size = UNBOUNDED

    def __init__(self, limits: ModelLimits) -> None:
        super().__init__()
        self.limits = limits
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._child_ids = itertools.count()
        self._dead: str | None = None
        # When the manager last went from no pending request to some (time.monotonic()).
        self.busy_since = time.monotonic()
        self.engine_core: NowaitMailbox[Any]
        self.detokenizer: NowaitMailbox[Any]

    def connect(self, engine_core: NowaitMailbox[Any], detokenizer: NowaitMailbox[Any]) -> None:
        self.engine_core = engine_core
        self.detokenizer = detokenizer

    @property
    def num_pending(self) -> int:
        return len(self._parents)

    def __contains__(self, request_id: str) -> bool:
        """Whether a request with this (caller's) id is pending here."""
        return request_id in self._parents

    # ---- admission ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prepared: PreparedRequest, *, priority: int = 0,
                    user: str | None = None) -> RequestHandle:
        """Submit a prepared request (see :mod:`cadence.engine.admission`) under the caller's id.

        Never yields to the event loop, so no cancellation (a client gone) can leave a request half
        submitted: registered here, and its sequences not all sent to the engine core.

        :raises InvalidRequestError: if a request with ``request_id`` is still pending.
        :raises EngineDeadError: if the engine died.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if not self._parents:
            self.busy_since = time.monotonic()
        outputs = OutputCollector()
        parent = self._parents[request_id] = _Parent(outputs)
        params, arrival = prepared.params, time.time()
        for index in range(params.n):
            child_id = str(next(self._child_ids))
            child_params = params if params.n == 1 else msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index)
            parent.unfinished[child_id] = index
            self._children[child_id] = _Child(request_id, parent, index)
            self.detokenizer.send_nowait(TrackRequest(child_id, prepared.prompt_token_ids, child_params, arrival))
            self.engine_core.send_nowait(EngineCoreRequest(
                request_id=child_id, prompt_token_ids=prepared.prompt_token_ids, sampling_params=child_params,
                eos_token_id=self.limits.eos_token_id, arrival_time=arrival, priority=priority, user=user,
                client_id=request_id, lora_request=prepared.lora_request))
        return RequestHandle(request_id, prepared, outputs)

    async def abort(self, request_id: str) -> None:
        """Abort a request (all of its sequences); its stream ends with finish reason ``abort``."""
        parent = self._parents.get(request_id)
        if parent is not None and self._dead is None:
            await self.engine_core.send(AbortRequests(list(parent.unfinished)))

    # ---- outputs -----------------------------------------------------------------------------

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                self._route(message.outputs)

    def _route(self, deltas: list[SequenceDelta]) -> None:
        batches: dict[str, DeltaBatch] = {}
        for delta in deltas:
            child = self._children.get(delta.request_id)
            if child is None:
                continue  # its request failed or finished already
            batches.setdefault(child.parent_id, []).append((child.index, delta))
            if delta.finish_reason is not None:
                del self._children[delta.request_id]
                del child.parent.unfinished[delta.request_id]
        for parent_id, batch in batches.items():
            parent = self._parents[parent_id]
            parent.outputs.put(batch)
            if not parent.unfinished:
                parent.outputs.close()
                del self._parents[parent_id]

    def fail_all(self, error: str) -> None:
        """The engine died: end every pending request's stream with ``error``."""
        self._dead = error
        for parent in self._parents.values():
            parent.outputs.close(error)
        self._parents.clear()
        self._children.clear()
