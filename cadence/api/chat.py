"""``POST /v1/chat/completions``: the conversation goes through the tokenizer's chat template; the
stream opens with each choice's role, then its content."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from cadence.api.errors import bad_request
from cadence.api.logprobs import chat_logprobs
from cadence.api.offload import in_thread
from cadence.api.params import chat_prompt, check_stream_options, max_tokens_for, sampling_params, structured_outputs
from cadence.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
    encode,
)
from cadence.api.request_body import read_json
from cadence.api.serving import APIState, Generation, prepare
from cadence.api.streaming import SSEStream, stream_response
from cadence.messages import RequestOutput
from cadence.sampling_params import StructuredOutputsParams


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _Chat:
    """One chat request, validated and ready to run (its prompt rendered, its constraint checked)."""

    def __init__(self, state: APIState, req: ChatCompletionRequest, model: str, arrival: float,
                 prompt_ids: list[int], constraint: StructuredOutputsParams | None) -> None:
        self.state = state
        self.req = req
        self.model = model
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.top_logprobs = _num_logprobs(req)
        requested: int | None
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        max_tokens = max_tokens_for(requested, None, len(self.prompt_ids), state.limits, param=param,
                                    prompt_param="messages")
        params = sampling_params(req, max_tokens=max_tokens, logprobs=self.top_logprobs, constraint=constraint)
        request = prepare(state, self.prompt_ids, params, prompt_param="messages")
        self.n = params.n
        self.generation = Generation(state, self.id, [request], priority=req.priority, user=req.user,
                                     arrival=arrival)
        self.choices = [_Choice() for _ in range(self.n)]
        self.num_cached = 0
        self.num_generated = 0

    def apply(self, delta: RequestOutput) -> list[ChatChunkChoice]:
        """Fold a delta in; the choices it adds to, as chunk choices."""
        self.num_cached = max(self.num_cached, delta.num_cached_tokens)
        changed = []
        for seq in delta.outputs:
            choice = self.choices[seq.index]
            logprobs = None
            if self.top_logprobs is not None:
                entries = chat_logprobs(seq.logprobs or [], self.state.texts, self.top_logprobs)
                choice.logprobs.extend(entries)
                logprobs = ChatLogprobs(content=entries)
            choice.text.append(seq.text)
            choice.finish_reason = seq.finish_reason or choice.finish_reason
            self.num_generated += len(seq.token_ids)
            if seq.text or logprobs is not None or seq.finish_reason is not None:
                changed.append(ChatChunkChoice(index=seq.index, delta=DeltaMessage(content=seq.text),
                                               logprobs=logprobs, finish_reason=seq.finish_reason))
        return changed

    def usage(self) -> Usage:
        prompt_tokens = len(self.prompt_ids)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self.num_generated,
                     total_tokens=prompt_tokens + self.num_generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached))

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i, message=AssistantMessage(content="".join(c.text)),
                logprobs=ChatLogprobs(content=c.logprobs) if self.top_logprobs is not None else None,
                # Only an aborted request ends without one, and that is answered with an error.
                finish_reason=c.finish_reason or "stop")
            for i, c in enumerate(self.choices)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())

    def chunk(self, choices: list[ChatChunkChoice], include_usage: bool) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        if include_usage:
            chunk.usage = None
        return chunk


def _num_logprobs(req: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` for the request: None (off), else how many top tokens to return."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


async def create_chat_completion(request: web.Request, state: APIState) -> web.StreamResponse:
    arrival = time.monotonic()
    settings = state.settings
    req = await read_json(request, ChatCompletionRequest, max_bytes=settings.max_request_body_bytes,
                          timeout_s=settings.request_read_timeout_s)
    model = state.check_model(req.model)
    include_usage = check_stream_options(req)
    constraint = structured_outputs(req)
    state.check_admission(1)  # before the slow work, which an overloaded server should not do
    prompt_ids = await in_thread(
        lambda: chat_prompt(req.messages, state.tokenizer, req.add_generation_prompt, state.text_bound),
        timeout_s=settings.preprocess_timeout_s, what="rendering and tokenizing the messages", param="messages")
    if constraint is not None:
        await state.constraints.check(*constraint)
    chat = _Chat(state, req, model, arrival, prompt_ids, constraint[0] if constraint else None)
    with state.admitted(1) as entry:
        if not req.stream:
            async def collect(_: int, delta: RequestOutput) -> None:
                chat.apply(delta)

            await chat.generation.run(entry, collect)
            return web.Response(body=encode(chat.response()), content_type="application/json")

        async def produce(stream: SSEStream) -> None:
            for index in range(chat.n):
                role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                await stream.send(chat.chunk([role], include_usage))

            async def send(_: int, delta: RequestOutput) -> None:
                for choice in chat.apply(delta):
                    await stream.send(chat.chunk([choice], include_usage))

            await chat.generation.run(entry, send)
            if include_usage:
                last = chat.chunk([], include_usage)
                last.usage = chat.usage()
                await stream.send(last)

        return await stream_response(request, produce)
