"""The request manager actor: validates and tokenizes requests, fans out ``n``, owns one output
stream per request, and fails every pending request at once if the engine dies.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from transformers import PreTrainedTokenizerBase

from cadence.core.actor import UNBOUNDED, Actor, EngineDeadError, Mailbox
from cadence.core.detokenizer_actor import DetokenizerActor
from cadence.core.structured_output import check_constraint
from cadence.messages import (
    AbortRequests,
    CompletionOutput,
    DetokenizedOutputs,
    EngineCoreRequest,
    RequestOutput,
    SequenceDelta,
    TrackRequest,
)
from cadence.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against before it is admitted."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # tokens the whole KV pool holds
    eos_token_id: int | None


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of a text prompt; a token-id prompt as a fresh list."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    return list(prompt)


def validate_request(limits: ModelLimits, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise ``ValueError`` saying what to change if the request cannot be served."""
    num = len(prompt_token_ids)
    if num == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if num >= limits.max_model_len:
        raise ValueError(f"the prompt has {num} tokens but the model's context length (max_model_len) is "
                         f"{limits.max_model_len}; shorten the prompt to at most {limits.max_model_len - 1}")
    if any(not isinstance(t, int) or not 0 <= t < limits.vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {limits.vocab_size})")
    params.validate_against(limits.vocab_size)
    if params.structured_outputs is not None:
        check_constraint(params.structured_outputs)
    max_tokens = params.max_tokens or limits.max_model_len
    needed = min(num + max_tokens, limits.max_model_len)
    if needed > limits.kv_capacity_tokens:
        raise ValueError(f"the request needs up to {needed} tokens of KV cache but the whole cache holds "
                         f"{limits.kv_capacity_tokens}; lower max_tokens or raise --kv-cache-memory")


class RequestHandle:
    """The caller's side of one request: its output stream, folded into cumulative results."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 stream: MemoryObjectReceiveStream[list[SequenceDelta]]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)], finished=False)

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """Yield, after each step, the sequences that changed with only their new text and tokens.

        :raises EngineDeadError: if the engine stopped before the request finished.
        """
        async with self._stream:
            async for batch in self._stream:
                delta = self._apply(batch)
                yield delta
                if self._output.finished:
                    return
        raise EngineDeadError(f"request {self.request_id} lost its output stream before finishing")

    async def result(self) -> RequestOutput:
        """Wait for the request to finish and return its cumulative output."""
        async for _ in self.deltas():
            pass
        return self._output

    @property
    def output(self) -> RequestOutput:
        return self._output

    def _apply(self, batch: list[SequenceDelta]) -> RequestOutput:
        changed = []
        for delta in batch:
            if delta.error is not None:
                if delta.finish_reason is None:
                    raise EngineDeadError(delta.error)
                self._output.error = delta.error
            index = _child_index(delta.request_id)
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
        return msgspec.structs.replace(self._output, outputs=changed)


def _child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def _child_index(child_id: str) -> int:
    _, sep, index = child_id.rpartition("#")
    return int(index) if sep else 0


def _parent_id(child_id: str) -> str:
    parent, sep, _ = child_id.rpartition("#")
    return parent if sep else child_id


class RequestManager(Actor[DetokenizedOutputs]):
    inbox_size = UNBOUNDED

    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.limits = limits
        self._streams: dict[str, MemoryObjectSendStream[list[SequenceDelta]]] = {}
        self._num_children: dict[str, int] = {}
        self._finished_children: dict[str, set[str]] = {}
        self._dead: str | None = None
        self.engine_core: Mailbox[Any]
        self.detokenizer: DetokenizerActor

    def connect(self, engine_core: Mailbox[Any], detokenizer: DetokenizerActor) -> None:
        self.engine_core = engine_core
        self.detokenizer = detokenizer

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # ---- admission ---------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                          priority: int = 0, user: str | None = None,
                          prompt_text: str | None = None) -> RequestHandle:
        """Validate, tokenize and submit; nothing is sent unless every check passes."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._streams or any(k.startswith(f"{request_id}#") for k in self._streams):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = tokenize_prompt(self.tokenizer, prompt)
        validate_request(self.limits, prompt_token_ids, params)
        send, receive = anyio.create_memory_object_stream[list[SequenceDelta]](math.inf)
        if isinstance(prompt, str):
            prompt_text = prompt
        handle = RequestHandle(request_id, prompt_text, prompt_token_ids, params.n, receive)
        self._streams[request_id] = send
        self._num_children[request_id] = params.n
        arrival = time.time()
        for index in range(params.n):
            child_params = params if params.n == 1 else msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index)
            child_id = _child_id(request_id, index, params.n)
            await self.detokenizer.send(TrackRequest(child_id, prompt_token_ids, child_params))
            await self.engine_core.send(EngineCoreRequest(
                request_id=child_id, prompt_token_ids=prompt_token_ids, sampling_params=child_params,
                eos_token_id=self.limits.eos_token_id, arrival_time=arrival, priority=priority, user=user))
        return handle

    async def abort(self, request_id: str, n: int = 1) -> None:
        """Abort a request (all of its ``n`` sequences); its stream ends with finish reason ``abort``."""
        if request_id in self._streams and self._dead is None:
            await self.engine_core.send(AbortRequests([_child_id(request_id, i, n) for i in range(n)]))

    # ---- outputs -----------------------------------------------------------------------------

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                self._route(message.outputs)

    def _route(self, deltas: list[SequenceDelta]) -> None:
        by_parent: dict[str, list[SequenceDelta]] = {}
        for delta in deltas:
            by_parent.setdefault(_parent_id(delta.request_id), []).append(delta)
        for parent, batch in by_parent.items():
            stream = self._streams.get(parent)
            if stream is None:
                continue
            _deliver(stream, batch)
            if self._is_done(parent, batch):
                stream.close()
                del self._streams[parent]

    def _is_done(self, parent: str, batch: list[SequenceDelta]) -> bool:
        finished = self._finished_children.setdefault(parent, set())
        finished.update(d.request_id for d in batch if d.finish_reason is not None)
        if len(finished) < self._num_children[parent]:
            return False
        del self._finished_children[parent]
        del self._num_children[parent]
        return True

    def fail_all(self, error: str) -> None:
        """The engine died: end every pending request's stream with ``error``."""
        self._dead = error
        for request_id, stream in self._streams.items():
            _deliver(stream, [SequenceDelta(request_id, "", [], error=error)])
            stream.close()
        self._streams.clear()
        self._num_children.clear()
        self._finished_children.clear()


def _deliver(stream: MemoryObjectSendStream[list[SequenceDelta]], batch: list[SequenceDelta]) -> None:
    """Hand a batch to the request's reader, unless it stopped reading (its abort is on the way)."""
    with contextlib.suppress(anyio.BrokenResourceError):
        stream.send_nowait(batch)
