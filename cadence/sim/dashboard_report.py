"""A simulated run seen as the live dashboard sees a server (``cadence simulate --dashboard FILE``).

The run loop tells :class:`SimDashboard` what the server's detokenizers tell the feed, on the virtual
clock: arrivals, each request's first step and preemptions (from the scheduler's output), tokens and
finishes (at each step's end) and each engine's state after its step. Snapshots are taken every
``interval_s`` of virtual time; past :data:`MAX_SNAPSHOTS`, every other one is dropped and the
interval doubles, so a long run's report stays a few megabytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.api.dashboard import render_report
from cadence.core.scheduler import Scheduler
from cadence.engine.dashboard_feed import DashboardFeed, EngineSample
from cadence.messages import EngineCoreOutput, SchedulerOutput

MAX_SNAPSHOTS = 400


class SimDashboard:
    """Feeds a :class:`DashboardFeed` from a simulation and keeps its snapshots."""

    def __init__(self, num_engines: int, interval_s: float = 0.25) -> None:
        self.feed = DashboardFeed(num_engines=num_engines)
        self.interval_s = interval_s
        self.snapshots: list[dict[str, Any]] = []
        self._next = 0.0

    def arrived(self, request_id: str, now: float) -> None:
        self.feed.arrived(request_id, now)

    def step_started(self, scheduler: Scheduler, out: SchedulerOutput, now: float) -> None:
        feed = self.feed
        for new in out.new_requests:
            request = scheduler.requests[new.request_id]
            if request.first_run:
                feed.started(new.request_id, now - request.arrival_time)
        for request_id in out.preempted_request_ids:
            feed.preempted(request_id, now)

    def step_finished(self, rank: int, scheduler: Scheduler, outputs: list[EngineCoreOutput], now: float) -> None:
        feed = self.feed
        for output in outputs:
            feed.tokens(output.request_id, now, len(output.new_token_ids))
            if output.finish_reason is not None:
                feed.finished(output.request_id, now, output.finish_reason)
        allocator = scheduler.allocator
        feed.engine(rank, now, EngineSample(len(scheduler.running), len(scheduler.waiting), allocator.usage,
                                            allocator.prefix_cache_queries, allocator.prefix_cache_hits,
                                            scheduler.num_preemptions))

    def tick(self, now: float) -> None:
        """The clock moved to ``now``: a snapshot if one is due."""
        if now < self._next:
            return
        self.snapshots.append(self.feed.snapshot(now))
        if len(self.snapshots) >= MAX_SNAPSHOTS:
            self.snapshots = self.snapshots[1::2]
            self.interval_s *= 2
        self._next = now + self.interval_s

    def finish(self, now: float) -> None:
        """The run ended at ``now``: its last snapshot."""
        if not self.snapshots or self.snapshots[-1]["t"] < now:
            self.snapshots.append(self.feed.snapshot(now))

    def write(self, path: str | Path, meta: dict[str, Any]) -> Path:
        """The report: the dashboard's page with this run's snapshots."""
        out = Path(path)
        out.write_text(render_report({**meta, **self.feed.windows}, self.snapshots), encoding="utf-8")
        return out
