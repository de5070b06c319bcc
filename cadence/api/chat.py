"""``POST /v1/chat/completions``: the conversation goes through the chat template (with the tools);
the answer's text becomes a message with its reasoning and tool calls apart (cadence/api/chat_output.py);
the stream opens with each choice's role, then its deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web
from msgspec import UNSET

from cadence.api.chat_output import ChoiceOutput, with_markup_tokens
from cadence.api.conversation import conversation_prompt
from cadence.api.errors import bad_request
from cadence.api.logprobs import chat_logprobs
from cadence.api.params import (
    ChatTemplateArgs,
    check_stream_options,
    max_tokens_for,
    sampling_params,
    structured_outputs,
)
from cadence.api.protocol import (
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
from cadence.api.request_body import request_id_of
from cadence.api.serving import APIState, Generation, ServedModel, prepare
from cadence.api.streaming import SSEStream, stream_response
from cadence.api.tools import ToolMode, template_tools, tool_constraint, tool_mode
from cadence.messages import RequestOutput
from cadence.sampling_params import StructuredOutputsParams


@dataclass
class _Choice:
    output: ChoiceOutput
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _Chat:
    """One chat request, validated and ready to run (its prompt rendered, its constraint checked)."""

    def __init__(self, state: APIState, req: ChatCompletionRequest, model: ServedModel, arrival: float,
                 prompt_ids: list[int], constraint: StructuredOutputsParams | None, mode: ToolMode,
                 request_id: str) -> None:
        self.state = state
        self.req = req
        self.model = model.name
        self.id = f"chatcmpl-{request_id}"
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
        tool_parser = state.tool_parser if mode.kind == "auto" else None
        params = with_markup_tokens(sampling_params(req, max_tokens=max_tokens, logprobs=self.top_logprobs,
                                                    constraint=constraint), tool_parser)
        request = prepare(state, self.prompt_ids, params, prompt_param="messages", lora_request=model.lora_request)
        self.n = params.n
        self.mode = mode
        self.generation = Generation(state, self.id, [request], priority=req.priority, user=req.user,
                                     arrival=arrival)
        constrained = constraint is not None
        single = req.parallel_tool_calls is False
        self.choices = [_Choice(ChoiceOutput(mode, tool_parser, state.reasoning_parser, constrained=constrained,
                                             single_call=single)) for _ in range(self.n)]
        self.num_cached = 0
        self.num_generated = 0

    def apply(self, delta: RequestOutput, stream: bool = True) -> list[ChatChunkChoice]:
        """Fold a delta in; when streaming, the choices it adds to, as chunk choices."""
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
            if not stream:
                continue
            message = choice.output.feed(seq.text)
            if seq.finish_reason is not None:
                message = _joined(message, choice.output.finish())
            # As vLLM: a plain choice's new token whose text is held back still gets its chunk (empty
            # content), so that clients time each token; a parsed one's (tool calls, reasoning) does not.
            plain_token = choice.output.plain and bool(seq.token_ids)
            if _has_fields(message) or plain_token or logprobs is not None or seq.finish_reason is not None:
                reason = self._finish_reason(seq.finish_reason, choice.output.called)
                changed.append(ChatChunkChoice(index=seq.index, delta=message, logprobs=logprobs,
                                               finish_reason=reason))
        return changed

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's ``tool_calls`` where the model stopped after calls it chose to make (a named
        function's call ends with ``stop``, as OpenAI's does)."""
        return "tool_calls" if reason == "stop" and called and self.mode.kind in ("auto", "required") else reason

    def usage(self) -> Usage:
        prompt_tokens = len(self.prompt_ids)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self.num_generated,
                     total_tokens=prompt_tokens + self.num_generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached))

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            message = c.output.message("".join(c.text))
            choices.append(ChatChoice(
                index=i, message=message,
                logprobs=ChatLogprobs(content=c.logprobs) if self.top_logprobs is not None else None,
                # Only an aborted request ends without one, and that is answered with an error.
                finish_reason=self._finish_reason(c.finish_reason or "stop", bool(message.tool_calls)) or "stop"))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())

    def chunk(self, choices: list[ChatChunkChoice], include_usage: bool) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        if include_usage:
            chunk.usage = None
        return chunk


def _joined(first: DeltaMessage, second: DeltaMessage) -> DeltaMessage:
    """One delta carrying both (text fields joined, tool-call pieces in order)."""
    joined = DeltaMessage()
    for name in ("content", "reasoning_content", "tool_calls"):
        a, b = getattr(first, name), getattr(second, name)
        if a is not UNSET or b is not UNSET:
            setattr(joined, name, (a if a is not UNSET else type(b)()) + (b if b is not UNSET else type(a)()))
    return joined


def _has_fields(delta: DeltaMessage) -> bool:
    """Whether the delta says anything (an empty content alone does not)."""
    return any(getattr(delta, name) not in (UNSET, "") for name in ("content", "reasoning_content", "tool_calls"))


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
    req = await state.read(request, ChatCompletionRequest)
    model = state.check_model(req.model)
    include_usage = check_stream_options(req)
    tools = req.tools or []
    own = structured_outputs(req)  # response_format "text" is none
    mode = tool_mode(tools, req.tool_choice, auto_tool_choice=settings.enable_auto_tool_choice,
                     constrained=own is not None)
    constraint = tool_constraint(tools, mode, req.parallel_tool_calls) or own
    args = ChatTemplateArgs(add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message, tools=template_tools(tools),
                            template=settings.chat_template, kwargs=req.chat_template_kwargs)
    prompt_ids = await conversation_prompt(state, req.messages, args, constraint)
    chat = _Chat(state, req, model, arrival, prompt_ids, constraint[0] if constraint else None, mode,
                 request_id_of(request))
    with state.admitted(1) as entry:
        if not req.stream:
            async def collect(_: int, delta: RequestOutput) -> None:
                chat.apply(delta, stream=False)

            await chat.generation.run(entry, collect)
            return web.Response(body=encode(chat.response()), content_type="application/json")

        async def produce(stream: SSEStream) -> None:
            opened = False

            async def send(_: int, delta: RequestOutput) -> None:
                nonlocal opened
                if not opened:  # with the first token, as vLLM: a client times the first token by it
                    opened = True
                    for index in range(chat.n):
                        role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                        await stream.send(chat.chunk([role], include_usage))
                for choice in chat.apply(delta):
                    await stream.send(chat.chunk([choice], include_usage))

            await chat.generation.run(entry, send)
            if include_usage:
                last = chat.chunk([], include_usage)
                last.usage = chat.usage()
                await stream.send(last)

        return await stream_response(request, produce)
