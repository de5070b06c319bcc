"""The aiohttp application: OpenAI's generation endpoints (completions, chat completions, responses)
plus health, models, version, tokenizer and metrics routes, vLLM's LoRA load and unload routes
when runtime updating is allowed, and the dashboard with ``--dashboard`` (``api/dashboard.py``),
behind two middlewares (API key, errors in OpenAI's shape).

``build_app`` takes an engine that is already running; starting and stopping it, signals and
graceful shutdown belong to ``server.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from msgspec import Struct
from prometheus_client import CONTENT_TYPE_LATEST

import cadence
from cadence.api.chat import create_chat_completion
from cadence.api.completions import create_completion
from cadence.api.dashboard import EVENTS_PATH, LiveDashboard, add_dashboard_routes
from cadence.api.errors import APIError, bad_request
from cadence.api.lora_adapters import ServedAdapter
from cadence.api.offload import in_thread
from cadence.api.params import ChatTemplateArgs, chat_prompt
from cadence.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    encode,
)
from cadence.api.request_body import REQUEST_ID_HEADER, request_id_of
from cadence.api.response_store import RESPONSE_STORE, ResponseStore
from cadence.api.responses import create_response
from cadence.api.serving import APIState, ServerSettings, engine_dead
from cadence.engine.async_engine import AsyncEngine
from cadence.errors import InvalidRequestError

logger = logging.getLogger(__name__)

STATE = web.AppKey("cadence_state", APIState)
# Probes, scrapers and the dashboard (what /metrics shows, drawn) reach these without the API key.
_OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/dashboard", EVENTS_PATH})

Handler = Callable[[web.Request, APIState], Awaitable[web.StreamResponse]]


def build_app(engine: AsyncEngine, settings: ServerSettings) -> web.Application:
    """The HTTP app over a running ``engine``; its state is at ``app[STATE]``.

    :raises ValueError: for a ``--lora-modules`` adapter that does not fit the model.
    """
    middlewares = [_errors] if settings.api_key is None else [_errors, _auth(settings.api_key)]
    # The handlers read bodies themselves (request_body.py); aiohttp's own limit, for anything else, is the same.
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_request_body_bytes)
    app[STATE] = APIState(engine, settings)
    app[RESPONSE_STORE] = ResponseStore()
    app.on_response_prepare.append(_echo_request_id)

    def route(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def bound(request: web.Request) -> web.StreamResponse:
            return await handler(request, request.app[STATE])
        return bound

    app.router.add_post("/v1/completions", route(create_completion))
    app.router.add_post("/v1/chat/completions", route(create_chat_completion))
    app.router.add_post("/v1/responses", route(create_response))
    app.router.add_get("/v1/models", route(_models))
    app.router.add_get("/v1/models/{model_id:.+}", route(_model))  # a served name may hold slashes
    app.router.add_get("/health", route(_health))
    app.router.add_get("/version", route(_version))
    app.router.add_get("/metrics", route(_metrics))
    app.router.add_post("/tokenize", route(_tokenize))
    app.router.add_post("/detokenize", route(_detokenize))
    if settings.allow_runtime_lora_updating:  # otherwise unknown routes (404), as in vLLM
        app.router.add_post("/v1/load_lora_adapter", route(_load_lora_adapter))
        app.router.add_post("/v1/unload_lora_adapter", route(_unload_lora_adapter))
    if settings.dashboard:
        meta = {"model": settings.model_name, "policy": engine.cores[0].client.policy, "engines": len(engine.cores),
                "started": time.time()}
        add_dashboard_routes(app, LiveDashboard(engine, meta))
    return app


def _json(body: Struct) -> web.Response:
    return web.Response(body=encode(body), content_type="application/json")


def _card(state: APIState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, max_model_len=state.limits.max_model_len,
                     root=state.engine.config.model.path)


def _adapter_card(state: APIState, adapter: ServedAdapter) -> ModelCard:
    lora = adapter.lora_request
    return ModelCard(id=lora.lora_name, created=adapter.created, max_model_len=state.limits.max_model_len,
                     root=lora.lora_path, parent=adapter.parent)


async def _models(request: web.Request, state: APIState) -> web.StreamResponse:
    """The base model's cards (one per served name), then each LoRA adapter's."""
    cards = [_card(state, name) for name in state.settings.served_model_names]
    return _json(ModelList(data=cards + [_adapter_card(state, adapter) for adapter in state.adapters]))


async def _model(request: web.Request, state: APIState) -> web.StreamResponse:
    """One served name's (or LoRA adapter's) card, or OpenAI's 404 ``model_not_found``."""
    name = request.match_info["model_id"]
    adapter = state.adapters.get(name)
    if adapter is not None:
        return _json(_adapter_card(state, adapter))
    state.check_model(name)
    return _json(_card(state, name))


async def _load_lora_adapter(request: web.Request, state: APIState) -> web.StreamResponse:
    """Serve another adapter (vLLM's endpoint and answers); 400 saying why when it cannot be."""
    req = await state.read(request, LoadLoRAAdapterRequest)
    try:
        lora = state.adapters.add(req.lora_name, req.lora_path)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    logger.info("LoRA adapter %r (id %d) loaded from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def _unload_lora_adapter(request: web.Request, state: APIState) -> web.StreamResponse:
    """Stop serving an adapter by name: new requests naming it get 404; those running finish with it."""
    req = await state.read(request, UnloadLoRAAdapterRequest)
    if state.adapters.remove(req.lora_name, req.lora_int_id) is None:
        with_id = "" if req.lora_int_id is None else f" with lora_int_id {req.lora_int_id}"
        raise APIError(404, f"The LoRA adapter `{req.lora_name}`{with_id} is not loaded", param="lora_name",
                       code="model_not_found")
    logger.info("LoRA adapter %r unloaded", req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _health(request: web.Request, state: APIState) -> web.StreamResponse:
    if state.engine.dead is not None:
        raise engine_dead(state.engine.dead)
    if state.closing:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return web.Response(status=200)


async def _version(request: web.Request, state: APIState) -> web.StreamResponse:
    return _json(VersionResponse(version=cadence.__version__))


async def _metrics(request: web.Request, state: APIState) -> web.StreamResponse:
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _tokenize(request: web.Request, state: APIState) -> web.StreamResponse:
    """Any length of text (counting tokens past the context is what it is for), within the body limit
    and the preprocessing deadline."""
    req = await state.read(request, TokenizeRequest)
    state.check_model(req.model)
    tokenizer = state.tokenizer
    if req.messages is not None and req.prompt is None:
        messages = req.messages
        args = ChatTemplateArgs(add_generation_prompt=req.add_generation_prompt, template=state.settings.chat_template)
        ids = await in_thread(lambda: chat_prompt(messages, tokenizer, args, encode=state.prompt_tokens.encode),
                              timeout_s=state.settings.preprocess_timeout_s, what="rendering and tokenizing the "
                              "messages", param="messages")
    elif req.prompt is not None and req.messages is None:
        prompt = req.prompt
        ids = await in_thread(lambda: state.prompt_tokens.encode(prompt, req.add_special_tokens),
                              timeout_s=state.settings.preprocess_timeout_s, what="tokenizing the prompt",
                              param="prompt")
    else:
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    return _json(TokenizeResponse(count=len(ids), max_model_len=state.limits.max_model_len, tokens=ids))


async def _detokenize(request: web.Request, state: APIState) -> web.StreamResponse:
    req = await state.read(request, DetokenizeRequest)
    state.check_model(req.model)
    vocab = state.limits.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise bad_request(f"tokens must be ids in [0, {vocab})", param="tokens")
    text = await in_thread(lambda: str(state.tokenizer.decode(req.tokens)),
                           timeout_s=state.settings.preprocess_timeout_s, what="decoding the tokens", param="tokens")
    return _json(DetokenizeResponse(prompt=text))


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape, aiohttp's own (404 route, 405, 413) included. (What the
    HTTP parser rejects never reaches the app: ``connection.py`` answers it.)"""
    try:
        return await handler(request)
    except APIError as exc:
        response = exc.response()
        if exc.close:
            # Sent now and the connection closed: aiohttp would otherwise wait up to its lingering
            # time (10 s) for the rest of a body that is not coming before closing it.
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error").response()


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID_HEADER] = request_id_of(request)


def _auth(api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # compare_digest: the time taken does not reveal how much of the key matched.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    return auth
