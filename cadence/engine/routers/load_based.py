"""Routers that look at the loads only: round robin, least loaded, and the power of two choices."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cadence.engine.routers.base import Router, RouterContext


class RoundRobinRouter(Router):
    """Each engine in turn, whatever its load."""

    name = "round-robin"

    def __init__(self, context: RouterContext) -> None:
        super().__init__(context)
        self._next = 0

    def choose(self, loads: Sequence[float], prompt_token_ids: Sequence[int]) -> int:
        rank, self._next = self._next, (self._next + 1) % self.context.num_engines
        return rank


class LeastLoadedRouter(Router):
    """The engine with the fewest pending requests; ties to the lowest rank."""

    name = "least-loaded"

    def choose(self, loads: Sequence[float], prompt_token_ids: Sequence[int]) -> int:
        return loads.index(min(loads))


class PowerOfTwoRouter(Router):
    """Two engines drawn at random (seeded), the less loaded of them (Mitzenmacher's power of two
    choices): nearly least-loaded balance without reading every engine's load."""

    name = "power-of-two"

    def __init__(self, context: RouterContext) -> None:
        super().__init__(context)
        self._rng = random.Random(context.seed)

    def choose(self, loads: Sequence[float], prompt_token_ids: Sequence[int]) -> int:
        if self.context.num_engines == 1:
            return 0
        a, b = self._rng.sample(range(self.context.num_engines), 2)
        return min(a, b) if loads[a] == loads[b] else (a if loads[a] < loads[b] else b)
