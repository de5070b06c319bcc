"""The dashboard (``serve --dashboard``; ``docs/operations.md``): one HTML page, ``dashboard.html``,
drawn from :class:`~cadence.engine.dashboard_feed.DashboardFeed` snapshots.

Live, ``GET /dashboard`` serves the page and ``GET /dashboard/events`` streams a snapshot a second
as server-sent events (the history so far first). ``cadence simulate --dashboard FILE`` writes the
same page with a run's snapshots inside it (:func:`render_report`): a static report with a slider
over the run's time instead of a stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

from aiohttp import web

from cadence.engine.async_engine import AsyncEngine
from cadence.engine.dashboard_feed import DashboardFeed

INTERVAL_S = 1.0
HISTORY = 600  # snapshots the page's charts get on connecting: ten minutes
EVENTS_PATH = "/dashboard/events"


def render_page(data: dict[str, Any]) -> str:
    """The page with ``data`` in it: ``{"meta": ..., "live": true, "events": URL}`` for a server,
    ``{"meta": ..., "live": false, "snapshots": [...]}`` for a report."""
    page = resources.files("cadence.api").joinpath("dashboard.html").read_text(encoding="utf-8")
    # Inside <script>: no "</" may end it early.
    return page.replace("__DASHBOARD_DATA__", json.dumps(data).replace("</", "<\\/"))


def render_report(meta: dict[str, Any], snapshots: Sequence[dict[str, Any]]) -> str:
    """A finished run as a static page (the simulator's report)."""
    return render_page({"meta": meta, "live": False, "snapshots": list(snapshots)})


class LiveDashboard:
    """A server's feed, sampled every ``interval_s`` into a history that new pages start from.

    The history keeps no timelines (only the latest snapshot's is drawn): a page gets ten minutes of
    charts in a few hundred kilobytes.
    """

    def __init__(self, engine: AsyncEngine, meta: dict[str, Any], interval_s: float = INTERVAL_S) -> None:
        self.feed = DashboardFeed(num_engines=len(engine.cores))
        engine.watch(self.feed)
        self.meta = {**meta, **self.feed.windows}
        self.interval_s = interval_s
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.latest: dict[str, Any] | None = None
        self._tick = asyncio.Event()
        self.closing = False

    async def sample(self) -> None:
        """Take a snapshot every ``interval_s`` until cancelled, waking the streams each time."""
        while True:
            snapshot = self.feed.snapshot(time.time())
            self.latest = snapshot
            self.history.append({k: v for k, v in snapshot.items() if k != "timeline"})
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()
            await asyncio.sleep(self.interval_s)

    async def snapshots(self) -> AsyncIterator[dict[str, Any]]:
        """Each new snapshot until the server shuts down."""
        while True:
            await self._tick.wait()
            if self.closing:
                return
            if self.latest is not None:
                yield self.latest

    def recent(self) -> list[dict[str, Any]]:
        """The history, its last snapshot whole (with the timeline)."""
        history = list(self.history)
        return history if self.latest is None else [*history[:-1], self.latest]

    def close(self) -> None:
        """End the streams (the server is shutting down)."""
        self.closing = True
        self._tick.set()


def add_dashboard_routes(app: web.Application, dashboard: LiveDashboard) -> None:
    """``/dashboard`` and its event stream, and the sampler running while the app does."""

    async def page(request: web.Request) -> web.StreamResponse:
        html = render_page({"meta": dashboard.meta, "live": True, "events": EVENTS_PATH})
        return web.Response(text=html, content_type="text/html")

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(_event("history", dashboard.recent()))
        async for snapshot in dashboard.snapshots():
            await response.write(_event("snapshot", snapshot))
        return response

    async def sampler(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(dashboard.sample())
        yield
        task.cancel()

    async def end_streams(app: web.Application) -> None:
        # on_shutdown comes before the server waits for its handlers: open pages do not hold it up.
        dashboard.close()

    app.router.add_get("/dashboard", page)
    app.router.add_get(EVENTS_PATH, events)
    app.cleanup_ctx.append(sampler)
    app.on_shutdown.append(end_streams)


def _event(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
