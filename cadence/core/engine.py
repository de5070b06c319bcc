"""Wires the engine's components together and runs its actors in one process.

The model, KV cache, allocator and scheduler live as long as the ``Engine``; the actors that move
messages between them are started by :meth:`Engine.running` for as long as a caller needs them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from cadence.config import EngineConfig
from cadence.core.actor import Actor, EngineDeadError, Mailbox, run_actors
from cadence.core.detokenizer_actor import DetokenizerActor
from cadence.core.engine_core import EngineCoreActor
from cadence.core.kv_allocator import KVAllocator
from cadence.core.request_manager import ModelLimits, RequestManager
from cadence.core.scheduler import Scheduler
from cadence.core.step_timing import StepTiming
from cadence.core.structured_output import StructuredOutputManager
from cadence.executor import Executor, create_executor
from cadence.executor.actor import ExecutorActor
from cadence.executor.base import UniExecutor
from cadence.executor.worker import Worker
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.policies.base import PolicyContext
from cadence.policies.loader import load_policy

logger = logging.getLogger(__name__)


@dataclass
class EngineCore:
    """The engine-core side: executor (and through it the workers), KV allocator and scheduler."""

    config: EngineConfig
    hf_config: PretrainedConfig
    executor: Executor
    allocator: KVAllocator
    scheduler: Scheduler
    timing: StepTiming = field(default_factory=StepTiming)

    @classmethod
    def build(cls, config: EngineConfig) -> EngineCore:
        sched = config.scheduler
        # Fail on a bad policy name before the (slower) model load.
        policy = load_policy(sched.policy, PolicyContext(
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold), sched.policy_options)
        hf_config = load_hf_config(config.model.path)
        executor = create_executor(config, hf_config)
        allocator = KVAllocator(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        # Loads the tokenizer and xgrammar only when the first constrained request arrives.
        grammars = StructuredOutputManager(functools.partial(load_tokenizer, config.model.path), hf_config.vocab_size)
        return cls(config, hf_config, executor, allocator, Scheduler(sched, allocator, policy, grammars))

    def actors(self, outputs_to: Mailbox[Any]) -> tuple[EngineCoreActor, ExecutorActor]:
        """Fresh engine-core and executor actors over these components."""
        core = EngineCoreActor(self.scheduler, self.config.model.max_model_len, self.timing)
        executor = ExecutorActor(self.executor, core)
        core.connect(executor, outputs_to)
        return core, executor

    def abort_all(self) -> None:
        self.scheduler.abort_requests(list(self.scheduler.requests))

    def shutdown(self) -> None:
        """Stop the workers (their processes or actors, under the mp and ray executors)."""
        self.executor.shutdown()


def model_limits(config: EngineConfig, hf_config: PretrainedConfig, num_blocks: int,
                 tokenizer: PreTrainedTokenizerBase) -> ModelLimits:
    return ModelLimits(
        max_model_len=config.model.max_model_len,
        vocab_size=hf_config.vocab_size,
        kv_capacity_tokens=(num_blocks - 1) * config.cache.block_size,
        eos_token_id=tokenizer.eos_token_id,
    )


class Engine:
    """The whole engine in one process, for offline generation and tests."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore.build(config)
        self.tokenizer = load_tokenizer(config.model.path)
        self.limits = model_limits(config, self.core.hf_config, self.core.executor.num_blocks, self.tokenizer)
        self.dead: str | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def allocator(self) -> KVAllocator:
        return self.core.allocator

    @property
    def worker(self) -> Worker:
        """The in-process worker of the uni executor.

        :raises RuntimeError: the workers run in other processes (mp or ray executor).
        """
        if not isinstance(self.core.executor, UniExecutor):
            raise RuntimeError(f"the {self.config.parallel.executor_backend} executor's workers run in other "
                               "processes; only the uni executor has an in-process worker")
        return self.core.executor.worker

    def shutdown(self) -> None:
        """Stop the workers; the engine cannot run afterwards."""
        self.core.shutdown()

    @contextlib.asynccontextmanager
    async def running(self, on_crash: Callable[[str], None] | None = None) -> AsyncIterator[RequestManager]:
        """Run the actors; yields the request manager to submit requests through.

        ``on_crash`` is told (after pending requests have failed) if an actor crashes.

        :raises EngineDeadError: if an earlier run crashed (the engine's state is no longer sound).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        detokenizer = DetokenizerActor(self.tokenizer)
        manager = RequestManager(self.tokenizer, self.limits)
        core, executor = self.core.actors(detokenizer)
        detokenizer.connect(core, manager)
        manager.connect(core, detokenizer)
        error: BaseException | None = None
        async with anyio.create_task_group() as group:
            actors: list[Actor[Any]] = [core, executor, detokenizer, manager]
            group.start_soon(run_actors, actors, self._on_crash(manager, on_crash))
            try:
                yield manager
            except BaseException as exc:  # re-raised below, unwrapped from the task group's ExceptionGroup
                error = exc
            finally:
                group.cancel_scope.cancel()
                # Whatever the caller left unfinished is aborted so the next run starts clean.
                self.core.abort_all()
        if error is not None:
            raise error

    def _on_crash(self, manager: RequestManager, hook: Callable[[str], None] | None) -> Callable[[str], None]:
        def crashed(error: str) -> None:
            self.dead = error
            manager.fail_all(error)
            if hook is not None:
                hook(error)
        return crashed
