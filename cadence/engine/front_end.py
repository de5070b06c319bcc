"""The front end of one engine core, and :func:`build_front_end`, the one place where the actor
graph is wired:

    request manager --requests, aborts--> engine core (client) --outputs--> detokenizer
    detokenizer --deltas--> request manager          detokenizer --aborts (stop strings)--> engine core

The engine core behind the client is in this process (its scheduler and executor actors join the
graph) or in its own (a forwarder reads its output socket); the front end is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from cadence.engine.admission import ModelLimits
from cadence.engine.core_client import EngineCoreClient
from cadence.engine.detokenizer_actor import DetokenizerActor
from cadence.engine.request_manager import RequestManager
from cadence.engine.routers.base import Router
from cadence.messages import EngineCoreOutputs, SchedulerStats
from cadence.runtime.actor import Actor, Mailbox


@dataclass(frozen=True, eq=False)
class CoreFrontEnd:
    """One engine core's client with the front-end actors that serve it."""

    client: EngineCoreClient
    manager: RequestManager
    detokenizer: DetokenizerActor
    actors: tuple[Actor[Any], ...]  # every actor of the graph, the engine core's own when in process

    @property
    def rank(self) -> int:
        return self.client.rank

    @property
    def stats(self) -> SchedulerStats | None:
        """The engine core's state after its latest step (None before the first step)."""
        return self.detokenizer.latest_stats

    @property
    def num_pending(self) -> int:
        return self.manager.num_pending

    def stalled_for(self, now: float) -> float:
        """Seconds the engine core has been silent while requests were pending here (0 when none
        are): since its last output batch, or since it was given work, whichever is later. A
        working engine core reports at least every second (``scheduler_actor.HEARTBEAT_S``)."""
        if not self.manager.num_pending:
            return 0.0
        return now - max(self.detokenizer.last_heard, self.manager.busy_since)

    @property
    def load(self) -> int:
        """What the data-parallel router balances: requests pending here, with those the engine core
        reported queued counted twice (a queue means its batch is full, so a new request waits longer)."""
        stats = self.stats
        return self.manager.num_pending + (stats.num_waiting if stats is not None else 0)


def build_front_end(client: EngineCoreClient, tokenizer: PreTrainedTokenizerBase, limits: ModelLimits,
                    on_dead: Callable[[str], None], router: Router | None = None) -> CoreFrontEnd:
    """Connect a fresh detokenizer and request manager to ``client``'s engine core.

    ``on_dead`` is told if the engine core reports its death; a router with prefix caching on sees
    each output batch's prefix-cache changes before the detokenizer does.

    :raises EngineDeadError: if the engine core is dead.
    """
    detokenizer = DetokenizerActor(tokenizer)
    manager = RequestManager(limits)
    outputs_to: Mailbox[EngineCoreOutputs] = detokenizer
    if router is not None and router.observes_prefix_caches:
        outputs_to = _PrefixCacheTap(router, client.rank, detokenizer)
    engine_core, core_actors = client.connect(outputs_to, on_dead)
    manager.connect(engine_core, detokenizer)
    detokenizer.connect(engine_core, manager)
    return CoreFrontEnd(client, manager, detokenizer, (detokenizer, manager, *core_actors))


class _PrefixCacheTap:
    """One engine core's outputs on their way to its detokenizer. The router takes in the prefix
    cache's changes first, so it knows a request's blocks by the time the request's caller sees
    the output of the step that cached them."""

    def __init__(self, router: Router, rank: int, detokenizer: DetokenizerActor) -> None:
        self.router = router
        self.rank = rank
        self.detokenizer = detokenizer

    async def send(self, message: EngineCoreOutputs) -> None:
        if message.kv_delta is not None:
            self.router.apply(self.rank, message.kv_delta)
        await self.detokenizer.send(message)

    def close(self) -> None:
        self.detokenizer.close()
