"""The engine core in the caller's process: its scheduler and executor actors run in the front
end's task group, and messages pass between actors as they are (no encoding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cadence.config import EngineConfig
from cadence.core.engine_core import EngineCore
from cadence.engine.core_client import EngineCoreClient
from cadence.errors import EngineDeadError
from cadence.messages import EngineCoreInput, EngineCoreOutputs
from cadence.runtime.actor import Actor, Mailbox, NowaitMailbox


class InProcessCoreClient(EngineCoreClient):
    """Holds an :class:`EngineCore` for as long as the client lives; each run (``connect`` to
    ``disconnect``) gets fresh actors over it. Once an actor has crashed the core's state is no
    longer sound, and the client stays dead."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.rank = core.config.parallel.data_parallel_rank
        self.num_blocks = core.executor.num_blocks
        self.policy = core.scheduler.policy.describe()

    @classmethod
    def start(cls, config: EngineConfig) -> InProcessCoreClient:
        """Build the engine core (load the model, size the KV cache) in this process."""
        return cls(EngineCore.build(config))

    def connect(self, outputs_to: Mailbox[EngineCoreOutputs], on_dead: Callable[[str], None]
                ) -> tuple[NowaitMailbox[EngineCoreInput], list[Actor[Any]]]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        scheduler, executor = self.core.actors(outputs_to)
        return scheduler, [scheduler, executor]

    def disconnect(self) -> None:
        # Whatever the caller left unfinished is aborted, so that the next run starts clean.
        self.core.abort_all()

    def shutdown(self) -> None:
        self.core.shutdown()
