"""``POST /v1/completions``: text in, text out, streamed or not; a batch of prompts gives
``len(prompts) * n`` choices, indexed prompt-major."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from cadence.api.errors import bad_request
from cadence.api.logprobs import completion_logprobs, merge_completion_logprobs, prompt_completion_logprobs
from cadence.api.offload import in_thread
from cadence.api.params import (
    DEFAULT_COMPLETION_TOKENS,
    check_stream_options,
    completion_prompts,
    max_tokens_for,
    num_prompts,
    sampling_params,
    structured_outputs,
)
from cadence.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    encode,
)
from cadence.api.request_body import request_id_of
from cadence.api.serving import APIState, Generation, ServedModel, prepare
from cadence.api.streaming import SSEStream, stream_response
from cadence.engine.admission import PreparedRequest
from cadence.messages import RequestOutput
from cadence.sampling_params import StructuredOutputsParams


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[CompletionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # Where the next token's text starts (text_offset), counting the echoed prompt.
    offset: int = 0
    started: bool = False


class _Completion:
    """One completions request, validated and ready to run (its prompts tokenized, its constraint
    checked)."""

    def __init__(self, state: APIState, req: CompletionRequest, model: ServedModel, arrival: float,
                 prompts: list[tuple[list[int], str]], constraint: StructuredOutputsParams | None,
                 request_id: str) -> None:
        self.state = state
        self.req = req
        self.model = model.name
        self.lora_request = model.lora_request
        self.id = f"cmpl-{request_id}"
        self.created = int(time.time())
        self.constraint = constraint
        self.prompt_ids = [ids for ids, _ in prompts]
        self.echo = [text if req.echo else "" for _, text in prompts]
        requests = [self._prepare(ids) for ids in self.prompt_ids]
        self.n = requests[0].params.n
        self.generation = Generation(state, self.id, requests, priority=req.priority, user=req.user, arrival=arrival)
        self.choices = [_Choice(offset=len(self.echo[i // self.n])) for i in range(len(prompts) * self.n)]
        self.num_cached = [0] * len(prompts)
        self.num_generated = 0
        # With echo and logprobs: each prompt's own logprobs, in the completions format (first null).
        self.prompt_logprobs: list[CompletionLogprobs | None] = [None] * len(prompts)

    def _prepare(self, prompt_ids: list[int]) -> PreparedRequest:
        req = self.req
        max_tokens = max_tokens_for(req.max_tokens, DEFAULT_COMPLETION_TOKENS, len(prompt_ids), self.state.limits)
        params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, constraint=self.constraint)
        if req.echo and req.logprobs is not None:  # the echoed prompt comes with its logprobs
            params = msgspec.structs.replace(params, prompt_logprobs=req.logprobs)
        return prepare(self.state, prompt_ids, params, prompt_param="prompt", lora_request=self.lora_request)

    def apply(self, prompt_index: int, delta: RequestOutput) -> list[CompletionChoice]:
        """Fold a delta in; the choices it adds to (text, logprobs, finish reason) as chunk choices."""
        self.num_cached[prompt_index] = max(self.num_cached[prompt_index], delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:  # the prompt's once, for each of its n choices
            self.prompt_logprobs[prompt_index] = prompt_completion_logprobs(
                self.prompt_ids[prompt_index], delta.prompt_logprobs, self.state.texts)
        changed = []
        for seq in delta.outputs:
            index = prompt_index * self.n + seq.index
            choice = self.choices[index]
            text = seq.text
            first = not choice.started
            if first:
                choice.started = True
                text = self.echo[prompt_index] + text
            logprobs = None
            if self.req.logprobs is not None:
                echoed = self.prompt_logprobs[prompt_index] if first else None
                if echoed is not None:  # offsets run on from the prompt's tokens' texts, as vLLM's
                    choice.offset = echoed.text_offset[-1] + len(echoed.tokens[-1])
                logprobs = completion_logprobs(seq.logprobs or [], self.state.texts, choice.offset)
                choice.offset += sum(len(t) for t in logprobs.tokens)
                if echoed is not None:  # the echoed prompt's logprobs lead its first chunk
                    logprobs = merge_completion_logprobs([echoed, logprobs])
                choice.logprobs.append(logprobs)
            choice.text.append(text)
            choice.finish_reason = seq.finish_reason or choice.finish_reason
            self.num_generated += len(seq.token_ids)
            # A new token whose text is held back (a partial character, a possible stop string) still
            # gets its chunk, with no text, as vLLM sends it: clients time each token by its chunk.
            if text or seq.token_ids or logprobs is not None or seq.finish_reason is not None:
                changed.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                finish_reason=seq.finish_reason))
        return changed

    def usage(self) -> Usage:
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self.num_generated,
                     total_tokens=prompt_tokens + self.num_generated,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.num_cached)))

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i, text="".join(c.text),
                logprobs=merge_completion_logprobs(c.logprobs) if self.req.logprobs is not None else None,
                finish_reason=c.finish_reason)
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())

    def chunk(self, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices)


async def create_completion(request: web.Request, state: APIState) -> web.StreamResponse:
    arrival = time.monotonic()
    settings = state.settings
    req = await state.read(request, CompletionRequest)
    model = state.check_model(req.model)
    _check_unsupported(req)
    include_usage = check_stream_options(req)
    constraint = structured_outputs(req)
    state.check_admission(num_prompts(req))  # before the slow work, which an overloaded server should not do
    prompts = await in_thread(lambda: completion_prompts(req, state.tokenizer, state.text_bound,
                                                         state.prompt_tokens.encode),
                              timeout_s=settings.preprocess_timeout_s, what="tokenizing the prompt", param="prompt")
    if constraint is not None:
        await state.constraints.check(*constraint)
    completion = _Completion(state, req, model, arrival, prompts, constraint[0] if constraint else None,
                             request_id_of(request))
    with state.admitted(len(completion.prompt_ids)) as entry:
        if not req.stream:
            async def collect(prompt_index: int, delta: RequestOutput) -> None:
                completion.apply(prompt_index, delta)

            await completion.generation.run(entry, collect)
            return web.Response(body=encode(completion.response()), content_type="application/json")

        async def produce(stream: SSEStream) -> None:
            async def send(prompt_index: int, delta: RequestOutput) -> None:
                for choice in completion.apply(prompt_index, delta):
                    await stream.send(completion.chunk([choice]))

            await completion.generation.run(entry, send)
            if include_usage:
                last = completion.chunk([])
                last.usage = completion.usage()
                await stream.send(last)

        return await stream_response(request, produce)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise bad_request(f"best_of must equal n ({n}): cadence does not rank extra candidates", param="best_of")

