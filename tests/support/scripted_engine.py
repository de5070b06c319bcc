"""An ``AsyncEngine`` stand-in that lets :func:`cadence.api.app.build_app` run without a model, and
:func:`post_json`, which sends one JSON request to an app in-process through aiohttp's test client.

:class:`ScriptedEngine` records each ``generate`` call as a :class:`Call` and plays what its script
returns for that call: a list of deltas, or an iterable that builds them as they are asked for (and
may raise partway, as an engine that fails mid-request does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cadence.api.app import build_app
from cadence.api.serving import ServerSettings
from cadence.engine.admission import ModelLimits, PreparedRequest, prepare_request
from cadence.lora_request import LoRARequest
from cadence.messages import CompletionOutput, RequestOutput, SchedulerStats, TokenLogprobs
from cadence.sampling_params import SamplingParams
from support.tiny_models import build_tiny_tokenizer


@dataclass
class Call:
    """One ``generate`` call, as the app made it."""

    request_id: str | None
    request: PreparedRequest
    priority: int
    user: str | None


Script = Callable[[Call], Iterable[RequestOutput]]


def out(index: int, text: str, token_ids: list[int], finish: str | None = None,
        logprobs: list[TokenLogprobs] | None = None) -> CompletionOutput:
    """One sequence's part of a scripted delta."""
    return CompletionOutput(index=index, text=text, token_ids=token_ids, finish_reason=finish, logprobs=logprobs)


def step(*outputs: CompletionOutput, cached: int = 0) -> RequestOutput:
    """A scripted delta: these sequences' new text and tokens; finished once every one has a reason."""
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], outputs=list(outputs),
                         finished=all(o.finish_reason is not None for o in outputs), num_cached_tokens=cached)


class ScriptedEngine:
    """What the app needs of an ``AsyncEngine`` (one core, the tiny tokenizer); every ``generate`` is
    recorded in ``calls`` and plays ``script(call)``, one delta per engine step."""

    def __init__(self, script: Script, *, max_model_len: int = 64, stats: SchedulerStats | None = None,
                 num_pending: int = 0) -> None:
        self.tokenizer = build_tiny_tokenizer()
        self.limits = ModelLimits(max_model_len=max_model_len, vocab_size=320, kv_capacity_tokens=160,
                                  eos_token_id=0)
        self.dead: str | None = None
        # The pool's block count includes its null block.
        client = SimpleNamespace(num_blocks=11, policy="fcfs (chunked=true)")
        self.cores = [SimpleNamespace(stats=stats, num_pending=num_pending, client=client)]
        self.num_pending_requests = 0
        self.script = script
        self.calls: list[Call] = []

    def prepare(self, prompt: list[int], params: SamplingParams, lora_request: LoRARequest | None = None
                ) -> PreparedRequest:
        return prepare_request(self.tokenizer, self.limits, prompt, params, lora_request)

    async def generate(self, request: PreparedRequest, params: None = None, request_id: str | None = None, *,
                       priority: int = 0, user: str | None = None) -> AsyncIterator[RequestOutput]:
        call = Call(request_id, request, priority, user)
        self.calls.append(call)
        deltas = iter(self.script(call))
        while True:
            await asyncio.sleep(0)  # an engine step before each delta (and before a script's failure)
            delta = next(deltas, None)
            if delta is None:
                return
            yield delta


@dataclass
class Reply:
    status: int
    text: str
    # What ``GET /metrics`` answered afterwards: empty unless asked to scrape.
    metrics: str = ""
    metrics_content_type: str = ""


def post_json(target: ScriptedEngine | web.Application, path: str, body: dict[str, Any],
              settings: ServerSettings | None = None, *, scrape: bool = False) -> Reply:
    """POST ``body`` as JSON to ``path`` of ``target``: an app of the test's own, or the cadence app
    over an engine (with ``settings``; by default one served model, "m"); then, with ``scrape``, read
    ``/metrics``."""
    async def run() -> Reply:
        if isinstance(target, web.Application):
            app = target
        else:
            app = build_app(target, settings or ServerSettings(served_model_names=("m",)))  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            response = await client.post(path, json=body)
            reply = Reply(response.status, await response.text())
            if scrape:
                metrics = await client.get("/metrics")
                reply.metrics, reply.metrics_content_type = await metrics.text(), metrics.headers["Content-Type"]
            return reply
    return asyncio.run(run())
