"""Priority: lower ``priority`` value first, ties by arrival; a higher-priority arrival may preempt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.waiting_queue import WaitingQueue
from cadence.request import RequestView


def _rank(request: RequestView) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityPolicy(SchedulingPolicy):
    """Strict priority with preemption by recompute.

    Waiting requests are admitted by ``(priority, arrival)``; a preempted request re-enters at its
    rank, so it keeps its place. When seats or KV blocks run out for a waiting request, the
    lowest-ranked running request is preempted if its priority is strictly lower (a larger value).
    Running requests also draw on the token budget by rank, and the victim for a running request
    that needs blocks is the lowest-ranked one (possibly itself). The waiting order is kept as
    requests come and go (a :class:`WaitingQueue`; equal ranks in the order they were queued).
    """

    name = "priority"
    bulk_decodes = True

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        super().__init__(context, options)
        self._waiting = WaitingQueue(_rank)

    def order_waiting(self, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        return self._waiting

    def on_arrival(self, request: RequestView) -> None:
        self._waiting.add(request)

    def on_preempted(self, request: RequestView) -> None:
        self._waiting.add(request)

    def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
        self._waiting.discard(request.request_id)

    def on_finished(self, request: RequestView) -> None:
        self._waiting.discard(request.request_id)

    def order_running(self, running: Sequence[RequestView]) -> list[RequestView]:
        return super().order_running(sorted(running, key=_rank))

    def pick_victim(self, running: Sequence[RequestView], needy: RequestView) -> RequestView:
        return _lowest(running)

    def preempt_for(self, request: RequestView, running: Sequence[RequestView]) -> RequestView | None:
        if not running:
            return None
        victim = _lowest(running)
        return victim if victim.priority > request.priority else None


def _lowest(running: Sequence[RequestView]) -> RequestView:
    # Among equal ranks, the most recently admitted loses the least work.
    return max(reversed(running), key=_rank)
