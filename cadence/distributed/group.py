"""The tensor-parallel process group and the three collectives the parallel layers need.

Each engine core's tensor-parallel ranks form their own ``torch.distributed`` world (gloo on the
CPU, NCCL on CUDA). At world size 1 there is no process group and no collective is ever called, so
a single worker runs exactly the kernels it ran before tensor parallelism existed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None at world size 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the step's tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all), concatenated in rank order along the last dimension."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place; returns ``x``."""
        if self.world_size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x


SINGLE_RANK = ParallelGroup()


# How long the ranks may take to meet (they all start together; one missing by then has failed to
# start), and how long a collective may then wait for a rank that stopped answering.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)


def init_tensor_parallel(rank: int, world_size: int, rendezvous: str | dist.Store,
                         device: torch.device) -> ParallelGroup:
    """Join the group of ``world_size`` ranks that meet at ``rendezvous``: an ``init_method`` URL
    (``file://`` under mp) or a store (the Ray executor's ``TCPStore``, hosted by rank 0).

    Blocks until every rank has joined.

    :raises RuntimeError: the others did not join within :data:`RENDEZVOUS_TIMEOUT`.
    """
    if world_size == 1:
        return SINGLE_RANK
    backend = "nccl" if device.type == "cuda" else "gloo"
    where: dict[str, Any] = {"init_method": rendezvous} if isinstance(rendezvous, str) else {"store": rendezvous}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=RENDEZVOUS_TIMEOUT, **where)
    return ParallelGroup(rank, world_size, dist.group.WORLD)
