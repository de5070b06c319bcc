"""Fixtures for the benchmark tests: an aiohttp app served on 127.0.0.1 from a thread of its own, so
that a load generator that runs its own event loop (``asyncio.run``) can load it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import aiohttp.web
import pytest
from support.sse_server import completions_app


@pytest.fixture
def run_app() -> Iterator[Callable[[aiohttp.web.Application], str]]:
    """``run_app(app)`` serves ``app`` on a free port until the test ends; returns its base URL."""
    started: list[tuple[asyncio.AbstractEventLoop, aiohttp.web.AppRunner, threading.Thread]] = []

    def run(app: aiohttp.web.Application) -> str:
        loop = asyncio.new_event_loop()
        runner = aiohttp.web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start())
        port = runner.addresses[0][1]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        started.append((loop, runner, thread))
        return f"http://127.0.0.1:{port}"

    yield run
    for loop, runner, thread in started:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.fixture
def server(run_app: Callable[[aiohttp.web.Application], str]) -> str:
    """The scripted completions server (``support/sse_server.py``); its base URL."""
    return run_app(completions_app())
