"""First come, first served: admit in arrival order; whole prefills unless chunking is on."""

from __future__ import annotations

from collections.abc import Sequence

from cadence.policies.base import SchedulingPolicy
from cadence.request import RequestView


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def order_waiting(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        # The scheduler keeps the queue in arrival order with preempted requests at the front.
        return list(waiting)
