"""Per-tenant fairness with virtual token counters (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024). The tenant is the request's ``user`` (the OpenAI ``user`` field)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from cadence.policies.base import PolicyContext, SchedulingPolicy
from cadence.request import RequestView


def tenant_of(request: RequestView) -> str:
    """Requests without a ``user`` share one anonymous tenant."""
    return request.user or ""


class FairPolicy(SchedulingPolicy):
    """Admit from the tenant that has received the least service so far.

    Each tenant has a counter of the service it received, in weighted tokens: ``input_weight``
    (``w_p``, default 1) per prompt token, charged in full when the request is admitted (as VTC
    does; chunks are not charged again, nor is recomputation after preemption), and
    ``output_weight`` (``w_q``, default 2) per generated token. Waiting requests are ordered by
    repeatedly taking the oldest request of the tenant with the smallest counter, adding its prompt
    charge to that counter as it is taken. A tenant that becomes backlogged (gets a waiting request
    while it had none) has its counter lifted to the smallest counter among backlogged tenants, or,
    when none is, to the counter of the tenant that last left the queue, so idle time earns no
    credit.

    The paper's bound: the service of two continuously backlogged tenants over any interval differs
    by at most ``2 * (w_p * L_input + w_q * M)``, ``L_input`` the longest prompt and ``M`` the output
    tokens a full batch can still owe (here ``max_num_seqs * max_tokens``); see ``docs/policies.md``.
    """

    name = "fair"

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        super().__init__(context, options)
        self.input_weight = self.float_option("input_weight", 1.0)
        self.output_weight = self.float_option("output_weight", 2.0)
        self.counters: dict[str, float] = {}
        self._waiting: dict[str, set[str]] = {}  # tenant -> ids of its waiting requests
        self._prompt_charged: set[str] = set()
        self._last_left = 0.0

    @classmethod
    def accepted_options(cls) -> Mapping[str, str]:
        return {**super().accepted_options(),
                "input_weight": "service charged per prompt token, at admission (w_p; default 1)",
                "output_weight": "service charged per generated token (w_q; default 2)"}

    def order_waiting(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        queues: dict[str, list[RequestView]] = {}
        for request in waiting:
            queues.setdefault(tenant_of(request), []).append(request)
        heads = {tenant: 0 for tenant in queues}
        projected = {tenant: self.counters.get(tenant, 0.0) for tenant in queues}
        heap = [(projected[t], q[0].arrival_time, i, t) for i, (t, q) in enumerate(queues.items())]
        heapq.heapify(heap)
        ordered: list[RequestView] = []
        while heap:
            _, _, i, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            request = queue[heads[tenant]]
            heads[tenant] += 1
            ordered.append(request)
            projected[tenant] += self._prompt_charge(request)
            if heads[tenant] < len(queue):
                heapq.heappush(heap, (projected[tenant], queue[heads[tenant]].arrival_time, i, tenant))
        return ordered

    def pick_victim(self, running: Sequence[RequestView], needy: RequestView) -> RequestView:
        # The most recently admitted request of the most served tenant.
        return max(reversed(running), key=lambda r: self.counters.get(tenant_of(r), 0.0))

    # ---- accounting ---------------------------------------------------------------------------

    def on_arrival(self, request: RequestView) -> None:
        self._enqueue(request)

    def on_preempted(self, request: RequestView) -> None:
        self._enqueue(request)

    def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
        tenant = tenant_of(request)
        queued = self._waiting.get(tenant, set())
        admitted = request.request_id in queued
        charge = 0.0
        if admitted:
            queued.discard(request.request_id)
            charge += self._prompt_charge(request)
            self._prompt_charged.add(request.request_id)
        if request.num_computed_tokens + num_tokens == request.num_tokens:  # samples a token
            charge += self.output_weight
        self.counters[tenant] = self.counters.get(tenant, 0.0) + charge
        if admitted and not queued:
            self._last_left = self.counters[tenant]

    def on_finished(self, request: RequestView) -> None:
        self._prompt_charged.discard(request.request_id)
        queued = self._waiting.get(tenant_of(request))
        if queued is not None:
            queued.discard(request.request_id)

    def _enqueue(self, request: RequestView) -> None:
        tenant = tenant_of(request)
        queued = self._waiting.setdefault(tenant, set())
        if not queued:  # becomes backlogged: no credit for the time it was not
            backlogged = [self.counters.get(t, 0.0) for t, ids in self._waiting.items() if ids and t != tenant]
            floor = min(backlogged) if backlogged else self._last_left
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        queued.add(request.request_id)

    def _prompt_charge(self, request: RequestView) -> float:
        if request.request_id in self._prompt_charged:
            return 0.0
        return self.input_weight * request.num_prompt_tokens
