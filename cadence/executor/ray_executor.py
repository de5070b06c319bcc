"""The ``ray`` executor: one Ray actor per tensor-parallel rank, placed with a placement group.

The executor connects to the cluster at ``RAY_ADDRESS`` (else to a local one, started if need be),
reserves one bundle per rank (``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU; PACK, so a group
fills a machine before it spans several) and starts the actors in it. Rank 0 hosts the
torch.distributed rendezvous (a ``TCPStore`` on a port the system gives it, so nothing can take the
port in between) on its own node. Each step is encoded once and put in the object store once; every
actor runs the same object, and rank 0's result is the step's output. A rank that raises or dies
(its actor gone) fails the step with an error naming it; between steps, the executor pings the
actors every :data:`WATCH_INTERVAL_S` seconds, so a rank that dies while the engine is idle fails
the engine too.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import anyio
import torch.distributed as dist

from cadence.config import EngineConfig
from cadence.distributed.group import RENDEZVOUS_TIMEOUT
from cadence.executor.base import Executor, WorkerError, start_worker
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.runtime.codec import Codec

logger = logging.getLogger(__name__)

# How long the cluster may take to find room for the whole group (an autoscaler may add machines).
PLACEMENT_TIMEOUT_S = 300.0
# How often the actors are pinged while no step runs: a death is seen within about this long.
WATCH_INTERVAL_S = 1.0


class RayWorker:
    """One rank, inside a Ray actor (the class is made remote when the executor starts)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self._steps: Codec[SchedulerOutput] = Codec(SchedulerOutput)
        self._outputs: Codec[ModelRunnerOutput] = Codec(ModelRunnerOutput)

    def rendezvous_address(self) -> str:
        """Host a rendezvous on this actor's node for the group to meet at (asked of rank 0):
        ``host:port`` of a store listening on a port the system chose."""
        import ray

        ip = ray.util.get_node_ip_address()
        self._store = _store(ip, 0, self.config.parallel.tensor_parallel_size, is_master=True)
        return f"{_url_host(ip)}:{self._store.port}"

    def start(self, rendezvous: str) -> tuple[int, int | None]:
        """Join the group, load this rank's shard, allocate its KV cache; the KV block count and the
        kernel's row limit."""
        if self.rank != 0:
            host, port = rendezvous.rsplit(":", 1)
            self._store = _store(host.strip("[]"), int(port), self.config.parallel.tensor_parallel_size,
                                 is_master=False)
        # Ray shows each actor only its own GPU, so it is always device 0.
        self.worker = start_worker(self.config, self.rank, self._store, local_rank=0)
        return self.worker.num_blocks, self.worker.kernel_row_limit

    def ping(self) -> None:
        """Answers while the actor lives (the executor's watch between steps)."""

    def execute_model(self, frame: bytes) -> bytes | None:
        """Run one encoded step; rank 0 returns its encoded output, the others None."""
        output = self.worker.execute_model(self._steps.decode(frame))
        return self._outputs.encode(output) if self.rank == 0 else None


class RayExecutor(Executor):
    """Places ``tensor_parallel_size`` :class:`RayWorker` actors and waits until all are ready.

    :raises RuntimeError: the cluster has no room for the group.
    :raises WorkerError: a rank failed or died while starting (the group is released).
    """

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        _connect(ray)
        world_size = config.parallel.tensor_parallel_size
        on_gpu = config.device.torch_device.type == "cuda"
        bundle = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self.actors: list[Any] = []
        self._finalizer = weakref.finalize(self, _release, ray, self.actors, group)
        # Held for each step and each ping: the watch pings only between steps.
        self._stepping = threading.Lock()
        self._failed = False
        try:
            _wait_for_placement(ray, group, world_size, bundle)
            actor_class = ray.remote(RayWorker)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
                options = actor_class.options(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0,
                                              scheduling_strategy=strategy)
                self.actors.append(options.remote(config, rank))
            rendezvous = self._gather([self.actors[0].rendezvous_address.remote()])[0]
            self.num_blocks, self.kernel_row_limit = self._gather([actor.start.remote(rendezvous)
                                                                   for actor in self.actors])[0]
        except BaseException:
            self.shutdown()
            raise
        self._codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
        self._outputs: Codec[ModelRunnerOutput] = Codec(ModelRunnerOutput)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        with self._stepping:
            frame = self._ray.put(self._codec.encode(step))  # serialised once, read by every rank
            try:
                outputs = self._gather([actor.execute_model.remote(frame) for actor in self.actors])
            except WorkerError:
                self._failed = True
                raise
        return self._outputs.decode(outputs[0])

    async def watch_workers(self) -> None:
        while True:
            await anyio.sleep(WATCH_INTERVAL_S)
            error = await anyio.to_thread.run_sync(self._ping_between_steps)
            if error is not None:
                raise error

    def _ping_between_steps(self) -> WorkerError | None:
        """The error for a dead actor; None if all answer, a step is running (it sees a death
        itself) or one already failed (and reported it)."""
        if not self._stepping.acquire(blocking=False):
            return None
        try:
            if not self._failed:
                self._gather([actor.ping.remote() for actor in self.actors])
        except WorkerError as error:
            self._failed = True
            return error
        finally:
            self._stepping.release()
        return None

    def shutdown(self) -> None:
        self._finalizer()

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every result, in order; fails as soon as any rank fails, without waiting for the others
        (which may be stuck in a collective with the failed rank).

        :raises WorkerError: naming the first rank that raised or died.
        """
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as exc:
                raise WorkerError(f"worker rank {rank_of[done[0]]} (Ray actor) failed: {_reason(exc)}") from None
        return [ray.get(ref) for ref in refs]


def _connect(ray: Any) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    logger.info("connecting to the Ray cluster at %s", address or "this machine (started if none runs)")
    ray.init(address=address)


def _store(host: str, port: int, world_size: int, *, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)


def _wait_for_placement(ray: Any, group: Any, world_size: int, bundle: dict[str, float]) -> None:
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise RuntimeError(f"the Ray cluster found no room for {world_size} workers of {bundle} within "
                           f"{PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.available_resources()} free. Add machines "
                           "or lower --tensor-parallel-size")


def _release(ray: Any, actors: list[Any], group: Any) -> None:
    if not ray.is_initialized():
        return  # the cluster connection is gone, and the actors with it
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _reason(exc: BaseException) -> str:
    """The worker's own exception for a task that raised, else the first line of Ray's message."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
