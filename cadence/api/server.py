"""``cadence serve``: the engine core in its own process, the HTTP API in this one.

Lifecycle: start the engine core and wait until it is ready, then listen. On SIGTERM or Ctrl-C,
stop accepting, give in-flight requests ``--shutdown-timeout`` seconds to finish, abort the rest,
stop the engine core and exit 0. If the engine core dies, every in-flight request fails at once
and the server exits 1 after answering them, unless ``--stay-up-on-engine-death`` (then
``/health`` answers 503 until someone stops it).

With ``--data-parallel-size N`` there are N engine cores behind this one server (see
``AsyncEngine``). The death of any one of them counts as the engine's death: its requests fail at
once, ``/health`` answers 503 and new requests are refused, while the requests already on the
other engine cores run on (to the end of the ``--shutdown-timeout`` grace unless told to stay up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.api.limits import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PREPROCESS_TIMEOUT_S,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)
from cadence.api.lora_adapters import RUNTIME_UPDATING_ENV, LoRAModule, parse_lora_module
from cadence.engine_args import add_engine_args, engine_args_from
from cadence.runtime.fork_server import start_fork_server

if TYPE_CHECKING:
    from cadence.api.serving import ServerSettings
    from cadence.config import EngineConfig
    from cadence.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_API_KEY_ENV = "CADENCE_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout_s: float = 10.0
    stay_up_on_engine_death: bool = False
    log_level: str = "WARNING"
    engine_stall_timeout_s: float | None = 120.0  # None: no watchdog


def register(verbs: Any) -> None:
    """Add the ``serve`` verb to the CLI's subparsers."""
    serve = verbs.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                             description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; 0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API answers to; the first is reported in responses "
                        f"(default: the model folder's or file's name, {DEFAULT_MODEL_NAME} for the default model)")
    g.add_argument("--api-key", default=os.environ.get(_API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every route but /health, /version and "
                        f"/metrics (default: ${_API_KEY_ENV}; none: no key needed)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests admitted and not finished beyond which new ones get 503 "
                        "(default: %(default)s; 0: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM / Ctrl-C before they are aborted "
                        "(default: %(default)s)")
    g.add_argument("--stay-up-on-engine-death", action="store_true",
                   help="keep serving (503 on /health and on requests) if an engine core dies, instead of "
                        "exiting non-zero")
    g.add_argument("--engine-stall-timeout", type=float, default=120.0,
                   help="seconds an engine core may stay silent while requests are pending before it counts as "
                        "dead (a step that never ends): its requests fail, /health says why "
                        "(default: %(default)s; 0: never)")
    g.add_argument("--dashboard", action="store_true",
                   help="serve a live dashboard at /dashboard: queues, batch, KV cache, prefix hits, tokens/s, "
                        "latency percentiles and a timeline of recent requests (docs/operations.md; like /metrics, "
                        "it needs no API key)")
    limits = serve.add_argument_group("request limits (docs/operations.md)")
    limits.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="largest request body accepted; a larger one gets 413 (default: %(default)s, 4 MiB)")
    limits.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                        help="seconds a request body may take to arrive; a slower or truncated one gets 408 and "
                             "its connection is closed (default: %(default)s)")
    limits.add_argument("--preprocess-timeout", type=float, default=DEFAULT_PREPROCESS_TIMEOUT_S,
                        help="seconds tokenizing a request's prompts (and rendering its chat template) may take; "
                             "a slower one gets 400 (default: %(default)s)")
    limits.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                        help="seconds a request waits for its structured-output constraint (JSON schema, regex, "
                             "grammar) to compile; a slower one gets 400 (default: %(default)s)")
    tools = serve.add_argument_group("tools and reasoning (docs/tools_and_reasoning.md)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="parse tool calls out of the model's text with this plugin (group cadence.tool_parsers: "
                            "hermes, llama3_json, mistral, pythonic ...)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (the default with tools) through --tool-call-parser')
    tools.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split the model's reasoning from its answer (group cadence.reasoning_parsers: qwen3, "
                            "deepseek_r1 ...)")
    tools.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                       help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    lora = serve.add_argument_group("LoRA adapters (docs/lora.md; needs --enable-lora)")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                      help='PEFT adapters served as models of their own: NAME=PATH, or JSON {"name": ..., "path": '
                           '..., "base_model_name": ...} (the served name its /v1/models card gives as parent)')
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also turned on by "
                           f"{RUNTIME_UPDATING_ENV}=1 or true): any client that reaches the API (with --api-key, "
                           "any that has the key) may then make the server read adapters from its disk")
    serve.set_defaults(run=run_server)


def _lora_module(item: str) -> LoRAModule:
    try:
        return parse_lora_module(item)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def runtime_lora_updating(ns: argparse.Namespace) -> bool:
    """Whether the load and unload endpoints are served: the flag, or vLLM's environment variable.

    :raises ValueError: for the flag (or ``--lora-modules``) without ``--enable-lora``. (The
        variable alone is not refused, as vLLM does not: loads then answer 400 saying LoRA is off.)
    """
    flags = {"--lora-modules": ns.lora_modules, "--allow-runtime-lora-updating": ns.allow_runtime_lora_updating}
    for flag, given in flags.items():
        if given and not ns.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora (with --max-lora-rank at least the adapters' rank)")
    from_env = os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")
    return bool(ns.allow_runtime_lora_updating) or from_env


def default_model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/")).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def chat_template_text(value: str | None) -> str | None:
    """``--chat-template``: a file's text, else the value itself (a template), as vLLM takes it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text() if path.is_file() else value


def run_server(ns: argparse.Namespace) -> int:
    """The ``serve`` verb; the exit status.

    :raises ValueError: for a bad engine option (the CLI reports it).
    """
    # First: the engine core's imports (about 4 s on 2 cores) run beside this process's own, rather
    # than after them (prometheus_client and the HTTP server's modules, about 1 s).
    start_fork_server()
    import prometheus_client
    import torch

    from cadence.api.serving import ServerSettings

    # The engine core gets the cores; this process (HTTP, detokenizing) keeps one thread.
    torch.set_num_threads(1)
    # As vLLM does: no `_created` series next to every counter and histogram.
    prometheus_client.disable_created_metrics()
    if ns.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {ns.max_waiting_requests}")
    if not ns.engine_stall_timeout >= 0 or ns.engine_stall_timeout == math.inf:  # nan, negative or inf
        raise ValueError(f"--engine-stall-timeout must be >= 0 (0: never), got {ns.engine_stall_timeout}")
    allow_lora_updating = runtime_lora_updating(ns)
    config = engine_args_from(ns).create_config()
    settings = ServerSettings(
        served_model_names=tuple(ns.served_model_name or [default_model_name(ns.model)]),
        api_key=ns.api_key or None,
        max_waiting_requests=ns.max_waiting_requests or None,
        max_request_body_bytes=ns.max_request_body_bytes,
        request_read_timeout_s=ns.request_read_timeout,
        preprocess_timeout_s=ns.preprocess_timeout,
        grammar_compile_timeout_s=ns.grammar_compile_timeout,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        reasoning_parser=ns.reasoning_parser,
        chat_template=chat_template_text(ns.chat_template),
        lora_modules=tuple(ns.lora_modules or ()),
        allow_runtime_lora_updating=allow_lora_updating,
        dashboard=ns.dashboard,
    )
    options = ServeOptions(host=ns.host, port=ns.port, shutdown_timeout_s=ns.shutdown_timeout,
                           stay_up_on_engine_death=ns.stay_up_on_engine_death, log_level=ns.log_level.upper(),
                           engine_stall_timeout_s=ns.engine_stall_timeout or None)
    return asyncio.run(serve(config, settings, options))


class _Lifecycle:
    """Signals and engine death, turned into "stop now": an event once listening, a cancel before."""

    def __init__(self, stay_up_on_engine_death: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.main = asyncio.current_task()
        self.stop = asyncio.Event()
        self.listening = False
        self.signalled = False
        self._stay_up = stay_up_on_engine_death

    def install_signal_handlers(self) -> None:
        # Ctrl-C reaches the whole process group, the engine core too; it must not die of it, since
        # in-flight requests still need it. The fork server its process comes from ignores SIGINT
        # (runtime/fork_server.py), and the engine core ignores it from its first line on. This
        # process ignores it until the engine core is started: ``AsyncEngine.launch`` starts it before
        # its first await, which is when the callback below puts this process's handlers in.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def install() -> None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(sig, self._on_signal)

        self.loop.call_soon(install)

    def remove_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        self.signalled = True
        if self.listening:
            self.stop.set()
        elif self.main is not None:
            self.main.cancel()  # still starting: stop the engine core and leave

    def on_dead(self, _: str) -> None:
        if not self._stay_up:
            self.stop.set()


async def serve(config: EngineConfig, settings: ServerSettings, options: ServeOptions) -> int:
    """Run until a signal (exit 0) or the engine's death (exit 1 unless told to stay up)."""
    from cadence.engine.async_engine import AsyncEngine

    lifecycle = _Lifecycle(options.stay_up_on_engine_death)
    lifecycle.install_signal_handlers()
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                engine = await stack.enter_async_context(AsyncEngine.launch(
                    config, max_waiting_requests=settings.max_waiting_requests, on_dead=lifecycle.on_dead,
                    log_level=options.log_level, stall_timeout_s=options.engine_stall_timeout_s))
            except RuntimeError as exc:  # the engine core failed to start
                print(f"cadence: {exc}", file=sys.stderr)
                return 1
            return await _serve_http(engine, settings, options, lifecycle)
    except asyncio.CancelledError:
        if not lifecycle.signalled:
            raise
        return 0
    finally:
        lifecycle.remove_signal_handlers()


async def _serve_http(engine: AsyncEngine, settings: ServerSettings, options: ServeOptions,
                      lifecycle: _Lifecycle) -> int:
    """Listen until told to stop; then stop accepting, drain, and close. The exit status."""
    from aiohttp import web

    from cadence.api.app import STATE, build_app
    from cadence.api.connection import APIRunner
    from cadence.api.limits import KEEPALIVE_TIMEOUT_S

    try:
        app = build_app(engine, settings)
    except ValueError as exc:  # a --lora-modules adapter that does not fit the model
        print(f"cadence: {exc}", file=sys.stderr)
        return 1
    if settings.allow_runtime_lora_updating:
        logger.warning("runtime LoRA updating is on: any client that reaches the API (and has its key, if one is "
                       "set) may load adapters from this machine's files; serve it only to clients you trust")
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = APIRunner(app, handler_cancellation=True, shutdown_timeout=2.0, access_log=None,
                       keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"cadence: cannot listen on {options.host}:{options.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    lifecycle.listening = True
    cores = len(engine.cores)
    print(f"cadence: serving {settings.model_name} on http://{options.host}:{options.port}"
          + (f" with {cores} data-parallel engine cores" if cores > 1 else "")
          + f", scheduling policy {engine.cores[0].client.policy}", file=sys.stderr, flush=True)
    await lifecycle.stop.wait()
    state = app[STATE]
    logger.warning("shutting down: %d requests in flight", state.num_in_flight)
    await site.stop()
    await state.drain(options.shutdown_timeout_s)
    await runner.cleanup()
    return 0 if engine.dead is None else 1
