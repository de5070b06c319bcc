"""``POST /v1/responses``, OpenAI's Responses API over the chat machinery (docs/tools_and_reasoning.md):
the input items become a conversation (cadence/api/responses_conversation.py), after the stored one
that ``previous_response_id`` continues (cadence/api/response_store.py); it goes through the chat
template with the tools; the text the model writes becomes output items as it arrives
(cadence/api/responses_output.py), streamed as typed events (cadence/api/responses_events.py) or
answered whole.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from cadence.api.chat_output import ChoiceOutput, with_markup_tokens
from cadence.api.conversation import conversation_prompt
from cadence.api.errors import bad_request
from cadence.api.params import ChatTemplateArgs, max_tokens_for, sampling_params
from cadence.api.protocol import ChatMessage, encode
from cadence.api.request_body import request_id_of
from cadence.api.response_store import RESPONSE_STORE, ResponseStore
from cadence.api.responses_conversation import (
    chat_tool_choice,
    chat_tools,
    has_output_constraint,
    input_messages,
    output_constraint,
    output_messages,
    sampling_fields,
    template_kwargs,
    with_instructions,
)
from cadence.api.responses_events import (
    Event,
    EventStream,
    ResponseCompleted,
    ResponseCreated,
    ResponseIncomplete,
    ResponseInProgress,
    stream_events,
)
from cadence.api.responses_output import ResponseOutput
from cadence.api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    Response,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from cadence.api.serving import APIState, Generation, ServedModel, prepare
from cadence.api.tools import ToolMode, template_tools, tool_constraint, tool_mode
from cadence.messages import RequestOutput
from cadence.sampling_params import StructuredOutputsParams

# Output text's logprobs: not served here (the chat endpoint has them), refused rather than left out.
_LOGPROBS = "message.output_text.logprobs"


class _Run:
    """One response, validated and ready to run: its engine request, and its output as it arrives."""

    def __init__(self, state: APIState, req: ResponsesRequest, model: ServedModel, prompt_ids: list[int],
                 constraint: StructuredOutputsParams | None, mode: ToolMode, request_id: str,
                 arrival: float) -> None:
        self.req = req
        self.model = model.name
        # Made here, never taken from the client's X-Request-Id: the id is the key of its stored
        # conversation, which another client must not reach or overwrite by sending the same header.
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.num_prompt_tokens = len(prompt_ids)
        max_tokens = max_tokens_for(req.max_output_tokens, None, len(prompt_ids), state.limits,
                                    param="max_output_tokens", prompt_param="input")
        tool_parser = state.tool_parser if mode.kind == "auto" else None
        self.params = with_markup_tokens(sampling_params(sampling_fields(req), max_tokens=max_tokens, logprobs=None,
                                                         constraint=constraint), tool_parser)
        request = prepare(state, prompt_ids, self.params, prompt_param="input", lora_request=model.lora_request)
        self.generation = Generation(state, f"resp-{request_id}", [request], priority=req.priority, user=req.user,
                                     arrival=arrival)
        self.output = ResponseOutput(ChoiceOutput(mode, tool_parser, state.reasoning_parser,
                                                  constrained=constraint is not None,
                                                  single_call=req.parallel_tool_calls is False))
        self.cut = False  # by the token limit
        self.num_cached = 0
        self.num_generated = 0

    def apply(self, delta: RequestOutput) -> list[Event]:
        """Fold a delta in; the stream events it makes."""
        self.num_cached = max(self.num_cached, delta.num_cached_tokens)
        events: list[Event] = []
        for seq in delta.outputs:  # one sequence: a response has one output
            self.num_generated += len(seq.token_ids)
            events += self.output.feed(seq.text, len(seq.token_ids))
            if seq.finish_reason is not None:
                self.cut = seq.finish_reason == "length"
                events += self.output.finish(self.cut)
        return events

    def response(self, done: bool) -> Response:
        """The response object: in progress (no output yet), or done."""
        req = self.req
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        response = Response(
            id=self.id, created_at=self.created_at, status="in_progress", model=self.model, output=[],
            instructions=req.instructions, tools=list(req.tools or []), tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=self.params.temperature,
            top_p=self.params.top_p, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning, text=req.text or TextConfig(),
            metadata=req.metadata, store=req.store is not False)
        if req.user is not None:
            response.user = req.user
        if done:
            response.status = "incomplete" if self.cut else "completed"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if self.cut else None
            response.completed_at = int(time.time())
            response.output = list(self.output.items)
            response.usage = ResponseUsage(
                input_tokens=self.num_prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=self.num_cached),
                output_tokens=self.num_generated,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=self.output.reasoning_tokens),
                total_tokens=self.num_prompt_tokens + self.num_generated)
        return response


def _check_served(req: ResponsesRequest) -> None:
    """:raises APIError: 400 naming a field of OpenAI's that this server does not serve."""
    if req.background:
        raise bad_request("background responses are not served; send the request without background",
                          param="background")
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not served; send the conversation as input (or previous_response_id)",
                              param=name)
    if _LOGPROBS in (req.include or []):
        raise bad_request(f"include {_LOGPROBS!r} is not served on /v1/responses; /v1/chat/completions has "
                          "logprobs", param="include")


async def create_response(request: web.Request, state: APIState) -> web.StreamResponse:
    arrival = time.monotonic()
    settings = state.settings
    req = await state.read(request, ResponsesRequest)
    model = state.check_model(req.model)
    _check_served(req)
    store = request.app[RESPONSE_STORE]
    earlier: Sequence[ChatMessage] = () if req.previous_response_id is None else store.conversation(
        req.previous_response_id)
    tools = chat_tools(req)
    mode = tool_mode(tools, chat_tool_choice(req), auto_tool_choice=settings.enable_auto_tool_choice,
                     constrained=has_output_constraint(req), name_param="tool_choice.name")
    constraint = tool_constraint(tools, mode, req.parallel_tool_calls) or output_constraint(req)
    turn = [*earlier, *input_messages(req, earlier)]
    args = ChatTemplateArgs(tools=template_tools(tools), template=settings.chat_template, kwargs=template_kwargs(req))
    prompt_ids = await conversation_prompt(state, with_instructions(req, turn), args, constraint, param="input")
    run = _Run(state, req, model, prompt_ids, constraint[0] if constraint else None, mode, request_id_of(request),
               arrival)
    with state.admitted(1) as entry:
        if not req.stream:
            async def collect(_: int, delta: RequestOutput) -> None:
                run.apply(delta)

            await run.generation.run(entry, collect)
            response = _finished(run, store, turn)
            return web.Response(body=encode(response), content_type="application/json")

        async def produce(stream: EventStream) -> None:
            await stream.emit(ResponseCreated(response=run.response(done=False)))
            await stream.emit(ResponseInProgress(response=run.response(done=False)))

            async def send(_: int, delta: RequestOutput) -> None:
                for event in run.apply(delta):
                    await stream.emit(event)

            await run.generation.run(entry, send)
            response = _finished(run, store, turn)
            last = ResponseIncomplete(response=response) if run.cut else ResponseCompleted(response=response)
            await stream.emit(last)

        return await stream_events(request, produce)


def _finished(run: _Run, store: ResponseStore, turn: list[ChatMessage]) -> Response:
    """The done response, kept for a later turn unless the request said ``store: false``."""
    response = run.response(done=True)
    if response.store:
        store.keep(response.id, [*turn, *output_messages(response.output)])
    return response
