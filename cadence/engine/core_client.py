"""How the front end reaches one engine core: the :class:`EngineCoreClient` interface.

Two implementations: :class:`~cadence.engine.inproc_client.InProcessCoreClient` runs the engine
core's actors in the caller's process and event loop (offline ``LLM``, tests), and
:class:`~cadence.engine.zmq_client.ZmqCoreClient` starts the engine core in its own process and
talks to it over two ZMQ sockets (the server). The front end's actors are connected to either in
the same way, by :func:`cadence.engine.front_end.build_front_end`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import anyio

from cadence.messages import EngineCoreInput, EngineCoreOutputs
from cadence.runtime.actor import Actor, Mailbox, NowaitMailbox


class EngineCoreClient(abc.ABC):
    """One engine core as the front end sees it.

    ``num_blocks`` is the size of its KV pool (the null block included) and ``policy`` its
    scheduling policy with options (``SchedulingPolicy.describe``), known once it is ready;
    ``dead`` says why it stopped, once it has.
    """

    rank: int
    num_blocks: int
    policy: str
    dead: str | None = None

    @abc.abstractmethod
    def connect(self, outputs_to: Mailbox[EngineCoreOutputs], on_dead: Callable[[str], None]
                ) -> tuple[NowaitMailbox[EngineCoreInput], list[Actor[Any]]]:
        """Where to send requests and aborts (it takes them without waiting: see ``NowaitMailbox``),
        and the actors to run (in the front end's task group) so that the engine core's outputs
        reach ``outputs_to``. ``on_dead`` is told if the engine core reports its own death.

        :raises EngineDeadError: if the engine core is dead.
        """

    async def watch(self, on_dead: Callable[[str], None]) -> None:
        """Wait (using no CPU) for the engine core to go in a way its actors cannot see (its process
        exited), and tell ``on_dead`` why. The default waits forever: an engine core in this
        process fails through its actors."""
        await anyio.sleep_forever()

    def disconnect(self) -> None:
        """The actors of :meth:`connect` have stopped (a run ended)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine core and free what it holds; idempotent."""
