"""Wires the engine's components together and runs its actors in one process.

The model, KV cache, allocator and scheduler live as long as the ``Engine``; the actors that move
messages between them are started by :meth:`Engine.running` for as long as a caller needs them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import torch

from cadence.config import EngineConfig
from cadence.core.actor import Actor, EngineDeadError, run_actors
from cadence.core.detokenizer_actor import DetokenizerActor
from cadence.core.engine_core import EngineCoreActor
from cadence.core.executor import ExecutorActor
from cadence.core.kv_allocator import KVAllocator
from cadence.core.request_manager import ModelLimits, RequestManager
from cadence.core.scheduler import Scheduler
from cadence.core.worker import Worker
from cadence.models.loader import load_hf_config, load_tokenizer
from cadence.policies.base import PolicyContext
from cadence.policies.loader import load_policy

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        sched = config.scheduler
        # Fail on a bad policy name before the (slower) model load.
        policy = load_policy(sched.policy, PolicyContext(
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold), sched.policy_options)
        torch.manual_seed(config.model.seed)
        self.hf_config = load_hf_config(config.model.path)
        self.tokenizer = load_tokenizer(config.model.path)
        self.worker = Worker(config, self.hf_config)
        self.allocator = KVAllocator(self.worker.num_blocks, config.cache.block_size,
                                     config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.allocator, policy)
        self.limits = ModelLimits(
            max_model_len=config.model.max_model_len,
            vocab_size=self.hf_config.vocab_size,
            kv_capacity_tokens=(self.worker.num_blocks - 1) * config.cache.block_size,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.dead: str | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RequestManager]:
        """Run the actors; yields the request manager to submit requests through.

        :raises EngineDeadError: if an earlier run crashed (the engine's state is no longer sound).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        core = EngineCoreActor(self.scheduler, self.config.model.max_model_len)
        executor = ExecutorActor(self.worker, core)
        detokenizer = DetokenizerActor(self.tokenizer)
        manager = RequestManager(self.tokenizer, self.limits)
        core.connect(executor, detokenizer)
        detokenizer.connect(core, manager)
        manager.connect(core, detokenizer)
        error: BaseException | None = None
        async with anyio.create_task_group() as group:
            actors: list[Actor[Any]] = [core, executor, detokenizer, manager]
            group.start_soon(run_actors, actors, self._on_crash(manager))
            try:
                yield manager
            except BaseException as exc:  # re-raised below, unwrapped from the task group's ExceptionGroup
                error = exc
            finally:
                group.cancel_scope.cancel()
                # Whatever the caller left unfinished is aborted so the next run starts clean.
                self.scheduler.abort_requests(list(self.scheduler.requests))
        if error is not None:
            raise error

    def _on_crash(self, manager: RequestManager) -> Callable[[str], None]:
        def crashed(error: str) -> None:
            self.dead = error
            manager.fail_all(error)
        return crashed
