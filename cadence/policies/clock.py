"""The clock a policy reads: one abstraction over the engine's wall time and the simulator's virtual time.

Its ``now()`` is on the timeline of :attr:`~cadence.request.RequestView.arrival_time`: seconds since
the epoch in the engine (the request manager stamps arrivals with ``time.time()``), seconds of the
trace in the simulator. A policy should only use differences (``now() - request.arrival_time`` is
how long a request has waited, in both), so the same policy runs unchanged in either.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds, on the timeline of the requests' ``arrival_time``."""
        ...


class WallClock:
    """The engine's clock: ``time.time()``, the clock arrivals are stamped with (possibly by another
    process on this machine, so a monotonic clock would not do)."""

    def now(self) -> float:
        return time.time()


class VirtualClock:
    """The simulator's clock: it moves only when the simulation sets :attr:`time` (step ends, arrivals)."""

    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def now(self) -> float:
        return self.time
