"""What the dashboard shows (``docs/operations.md``, "Dashboard"): each request's phases and each
engine core's state, turned into snapshots of a sliding window.

The server's detokenizers feed it (wall seconds, as the front end sees them); the simulator feeds it
the same calls on its virtual clock, so a live server and a simulated run make the same page. A
request's phases: ``waiting`` from its arrival, ``prefill`` from its first step, ``decode`` from
its first token, ``preempted`` from a preemption until its next token (the recompute of what it
had is part of that span).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from cadence.messages import SchedulerStats

WAITING, PREFILL, DECODE, PREEMPTED = "waiting", "prefill", "decode", "preempted"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine core's state after a step (prefix-cache counts and preemptions are cumulative)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int

    @classmethod
    def of(cls, stats: SchedulerStats) -> EngineSample:
        return cls(stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.prefix_cache_queries,
                   stats.prefix_cache_hits, stats.num_preemptions)


class _Life:
    """One request's phases: (name, start) in order, and how it ended."""

    __slots__ = ("arrival", "end", "last_token", "phases", "preemptions", "reason", "seq")

    def __init__(self, arrival: float, seq: int) -> None:
        self.arrival = arrival
        self.seq = seq  # its place among the arrivals
        self.phases: list[tuple[str, float]] = [(WAITING, arrival)]
        self.last_token: float | None = None
        self.end: float | None = None
        self.reason: str | None = None
        # One span may hold several: preempted again after its recompute, before a token came out.
        self.preemptions = 0

    def enter(self, phase: str, t: float) -> None:
        if self.end is None and self.phases[-1][0] != phase:
            self.phases.append((phase, t))

    def spans(self) -> list[list[Any]]:
        """``[phase, start, end]`` each, the last one's end None while it lasts."""
        ends = [start for _, start in self.phases[1:]] + [self.end]
        return [[phase, start, end] for (phase, start), end in zip(self.phases, ends, strict=True)]


class _Window:
    """Timed samples of one quantity, the older than ``span`` seconds dropped as new ones come."""

    def __init__(self, span: float) -> None:
        self.span = span
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self._samples.append((t, value))

    def values(self, now: float) -> list[float]:
        samples = self._samples
        while samples and samples[0][0] < now - self.span:
            samples.popleft()
        return [value for _, value in samples]


class DashboardFeed:
    """Requests' phases and engine cores' states, on one clock; :meth:`snapshot` is what the page draws.

    ``window_s``: the span of the percentiles and the prefix-cache hit rate; ``rate_s``: of the
    output tokens/s (shorter, so that it follows load changes); ``timeline_requests``: how many of
    the latest arrivals the timeline shows (finished ones beyond those are forgotten).
    """

    def __init__(self, num_engines: int = 1, window_s: float = 30.0, rate_s: float = 5.0,
                 timeline_requests: int = 40) -> None:
        if window_s <= 0 or rate_s <= 0 or timeline_requests < 1:
            raise ValueError("the dashboard's window_s and rate_s must be > 0, and timeline_requests >= 1")
        self.window_s = window_s
        self.rate_s = rate_s
        self.timeline_requests = timeline_requests
        self._lives: dict[str, _Life] = {}  # by arrival
        self._done: deque[str] = deque()  # the finished among them, by finish
        self._num_finished = 0
        self._ttft = _Window(window_s)
        self._itl = _Window(window_s)
        self._tokens = _Window(rate_s)
        self._engines: list[EngineSample | None] = [None] * num_engines
        # Prefix-cache queries and hits summed over the engines' latest samples, kept by difference;
        # and (time, those sums) after each engine's step.
        self._prefix_queries = self._prefix_hits = 0
        self._prefix: deque[tuple[float, int, int]] = deque()
        self.num_requests = 0
        self.num_tokens = 0

    # ---- what happened -----------------------------------------------------------------------

    def arrived(self, request_id: str, t: float) -> None:
        self._lives[request_id] = _Life(t, self.num_requests)
        self.num_requests += 1

    def started(self, request_id: str, queue_s: float) -> None:
        """The request's first step (its prefill) began ``queue_s`` seconds after its arrival.

        The server learns it with the request's first tokens, which may come after a preemption
        the request suffered in its prefill: the span goes in after the waiting, before what was
        heard since."""
        life = self._lives.get(request_id)
        if life is None or any(phase == PREFILL for phase, _ in life.phases):
            return
        start = life.arrival + queue_s
        if len(life.phases) > 1:
            start = min(start, life.phases[1][1])  # the engine's clock and this one's may differ a little
        life.phases.insert(1, (PREFILL, start))

    def tokens(self, request_id: str, t: float, n: int) -> None:
        """``n`` tokens of the request came out at ``t``."""
        life = self._lives.get(request_id)
        if life is None or n <= 0:
            return
        if life.last_token is None:
            self._ttft.add(t, t - life.arrival)
        else:
            self._itl.add(t, t - life.last_token)
        life.last_token = t
        life.enter(DECODE, t)
        self._tokens.add(t, n)
        self.num_tokens += n

    def preempted(self, request_id: str, t: float) -> None:
        life = self._lives.get(request_id)
        if life is not None and life.end is None:
            life.preemptions += 1
            life.enter(PREEMPTED, t)

    def finished(self, request_id: str, t: float, reason: str) -> None:
        life = self._lives.get(request_id)
        if life is None or life.end is not None:
            return
        life.end, life.reason = t, reason
        self._num_finished += 1
        self._done.append(request_id)
        self._forget_old()

    def engine(self, rank: int, t: float, sample: EngineSample) -> None:
        """Engine core ``rank``'s state after a step that ended at ``t``."""
        before = self._engines[rank]
        self._engines[rank] = sample
        self._prefix_queries += sample.prefix_queries - (before.prefix_queries if before else 0)
        self._prefix_hits += sample.prefix_hits - (before.prefix_hits if before else 0)
        self._prefix.append((t, self._prefix_queries, self._prefix_hits))

    # ---- what the page draws -----------------------------------------------------------------

    @property
    def windows(self) -> dict[str, float]:
        """The spans the page names."""
        return {"window_s": self.window_s, "rate_s": self.rate_s}

    def snapshot(self, t: float) -> dict[str, Any]:
        """The state at ``t``: totals, each engine's state, rates and percentiles over the window, and
        the timeline of the latest arrivals (plain JSON data)."""
        engines = [s for s in self._engines if s is not None]
        tokens = self._tokens.values(t)
        return {
            "t": t,
            "running": sum(s.running for s in engines),
            "waiting": sum(s.waiting for s in engines),
            "kv_usage": max((s.kv_usage for s in engines), default=0.0),
            "preemptions": sum(s.preemptions for s in engines),
            "engines": [None if s is None else {"running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage}
                        for s in self._engines],
            "prefix_hit_rate": self._prefix_hit_rate(t),
            "tokens_per_s": sum(tokens) / self.rate_s,
            "ttft": _percentiles(self._ttft.values(t)),
            "itl": _percentiles(self._itl.values(t)),
            "requests": self.num_requests,
            "finished": self._num_finished,
            "output_tokens": self.num_tokens,
            "timeline": [{"id": rid, "arrival": life.arrival, "spans": life.spans(), "reason": life.reason,
                          "preemptions": life.preemptions} for rid, life in self._latest()],
        }

    def _latest(self) -> Iterator[tuple[str, _Life]]:
        latest = []
        for item in reversed(self._lives.items()):
            latest.append(item)
            if len(latest) == self.timeline_requests:
                break
        return reversed(latest)

    def _prefix_hit_rate(self, now: float) -> float | None:
        """Prompt tokens found in the prefix cache over those looked up, within the window (None
        when nothing was looked up in it): the latest totals less those before the window (none
        before it: the counts started within it)."""
        samples, start = self._prefix, now - self.window_s
        while len(samples) > 1 and samples[1][0] <= start:
            samples.popleft()
        if not samples:
            return None
        _, queries, hits = samples[-1]
        _, base_queries, base_hits = samples[0] if samples[0][0] <= start else (start, 0, 0)
        looked_up = queries - base_queries
        return None if looked_up <= 0 else (hits - base_hits) / looked_up

    def _forget_old(self) -> None:
        """Forget finished requests, the first finished first, while there are more than twice the
        timeline's, but none of the latest ``timeline_requests`` arrivals (unfinished ones stay)."""
        latest = self.num_requests - self.timeline_requests
        while len(self._lives) > 2 * self.timeline_requests and self._done:
            rid = self._done[0]
            if self._lives[rid].seq >= latest:
                break
            self._done.popleft()
            del self._lives[rid]


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50, p90, p99 in milliseconds, and how many samples they are of."""
    if not values:
        return {"n": 0, **{f"p{p}": None for p in PERCENTILES}}
    points = np.percentile(np.asarray(values), PERCENTILES)
    return {"n": len(values), **{f"p{p}": float(v) * 1000.0 for p, v in zip(PERCENTILES, points, strict=True)}}
