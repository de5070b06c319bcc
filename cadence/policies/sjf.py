"""Shortest job first on ``prompt length + max_tokens``, with aging so that nothing starves."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.policies.waiting_queue import WaitingQueue
from cadence.request import RequestView


class ShortestJobFirstPolicy(SchedulingPolicy):
    """Admit the waiting request with the smallest ``job length - aging * passes``.

    The job length is ``num_prompt_tokens + max_tokens``. ``passes`` counts the admissions (of any
    request) since this one arrived, so age is measured in admissions rather than seconds: the same
    in the engine, the simulator and tests. A request ``y`` that arrived after ``x`` is admitted
    first only while ``len(y) + aging * A(y) < len(x) + aging * A(x)``, ``A`` being the admission
    count at arrival; with ``aging > 0`` every waiting request therefore outranks all later arrivals
    after ``len(x) / aging`` admissions, and finishes. ``aging=0`` is plain SJF (can starve).

    Every waiting request's score drops by ``aging`` at each admission, so their order is that of
    ``len + aging * A``, fixed at arrival: the queue is kept sorted by it (a :class:`WaitingQueue`),
    not re-sorted every step.
    """

    name = "sjf"
    bulk_decodes = True

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        super().__init__(context, options)
        self.aging = self.float_option("aging", 1.0)
        self._admissions = 0
        self._arrived_at: dict[str, int] = {}  # request id -> admissions before its arrival
        self._waiting = WaitingQueue(self._rank)

    @classmethod
    def accepted_options(cls) -> Mapping[str, str]:
        return {**super().accepted_options(),
                "aging": "score taken off a waiting request per admission since its arrival (default 1; 0: plain SJF)"}

    def score(self, request: RequestView) -> float:
        length = request.num_prompt_tokens + request.max_tokens
        return length - self.aging * (self._admissions - self._arrived_at.get(request.request_id, self._admissions))

    def _rank(self, request: RequestView) -> tuple[float, float]:
        # score + aging * admissions, which orders the waiting requests as their scores do at any time.
        arrived_at = self._arrived_at.get(request.request_id, self._admissions)
        return request.num_prompt_tokens + request.max_tokens + self.aging * arrived_at, request.arrival_time

    def order_waiting(self, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        return self._waiting

    def on_arrival(self, request: RequestView) -> None:
        self._arrived_at[request.request_id] = self._admissions
        self._waiting.add(request)

    def on_preempted(self, request: RequestView) -> None:
        self._waiting.add(request)  # keeps its age, hence its place

    def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
        if self._waiting.discard(request.request_id):
            self._admissions += 1

    def on_finished(self, request: RequestView) -> None:
        self._arrived_at.pop(request.request_id, None)
        self._waiting.discard(request.request_id)
