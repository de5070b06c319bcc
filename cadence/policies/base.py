"""The scheduling policy contract: the three decisions a policy makes, and nothing else.

The scheduler owns the mechanics (token budget, seats, KV blocks, preemption by recompute); a
policy only decides

1. the order in which waiting requests are considered (:meth:`SchedulingPolicy.order_waiting`),
2. how many of a request's remaining tokens it gets this step (:meth:`SchedulingPolicy.num_tokens`),
3. which running request gives up its blocks when KV memory runs out (:meth:`SchedulingPolicy.pick_victim`).

It sees read-only request views, may keep its own state, and is told when requests arrive, are
scheduled and finish. The same object drives the real engine and the simulator.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from cadence.request import RequestView


@dataclass(frozen=True)
class PolicyContext:
    """The scheduler limits a policy may take into account."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int  # 0: no cap


class SchedulingPolicy(abc.ABC):
    """Base class of every policy; subclasses are registered in ``cadence.policies`` entry points."""

    name: ClassVar[str]

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        self.context = context
        self.options = dict(options or {})
        unknown = set(self.options) - set(self.accepted_options())
        if unknown:
            raise ValueError(f"policy {self.name!r} does not take option(s) {sorted(unknown)}; "
                             f"it accepts {sorted(self.accepted_options()) or 'none'}")

    @classmethod
    def accepted_options(cls) -> Sequence[str]:
        """Names accepted by ``--policy-option KEY=VALUE``."""
        return ()

    # ---- the three decisions ------------------------------------------------------------------

    @abc.abstractmethod
    def order_waiting(self, waiting: Sequence[RequestView]) -> list[RequestView]:
        """The waiting requests in the order they should be admitted (first = next)."""

    def num_tokens(self, request: RequestView, token_budget: int) -> int:
        """Tokens to schedule for ``request`` this step, given what is left of the step's budget.

        Returning 0 skips the request this step. The default takes the whole remainder when it
        fits and, with chunked prefill on, a chunk of what fits (capped by the long-prefill threshold).
        """
        remaining = request.num_tokens - request.num_computed_tokens
        if self.context.enable_chunked_prefill:
            threshold = self.context.long_prefill_token_threshold
            if threshold:
                remaining = min(remaining, threshold)
            return min(remaining, token_budget)
        return remaining if remaining <= token_budget else 0

    def pick_victim(self, running: Sequence[RequestView], needy: RequestView) -> RequestView:
        """Which running request to preempt so that ``needy`` can get blocks.

        ``running`` is in admission order and includes ``needy`` when it is running; returning
        ``needy`` itself means it yields. The default preempts the most recently admitted.
        """
        return running[-1]

    # ---- notifications (default: nothing to track) -------------------------------------------

    def on_arrival(self, request: RequestView) -> None:
        """A request entered the waiting queue for the first time."""

    def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
        """``request`` got ``num_tokens`` in the step being built."""

    def on_finished(self, request: RequestView) -> None:
        """``request`` finished (any reason) and left the scheduler."""
