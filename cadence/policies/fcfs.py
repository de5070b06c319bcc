"""First come, first served: admit in arrival order; chunked prefill as the engine says (``chunked``)."""

from __future__ import annotations

from collections.abc import Sequence

from cadence.policies.base import SchedulingPolicy
from cadence.request import RequestView


class FCFSPolicy(SchedulingPolicy):
    """Arrival order. With whole prefills (``chunked=false``), a prefill that does not fit the step's
    remaining budget waits, and so does everything behind it (head of line)."""

    name = "fcfs"
    bulk_decodes = True

    def order_waiting(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        # The scheduler keeps the queue in arrival order with preempted requests at the front,
        # where they were: fcfs admits in arrival order, so they arrived before anything waiting.
        return list(waiting)
