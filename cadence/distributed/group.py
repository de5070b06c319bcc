"""The tensor-parallel process group and the three collectives the parallel layers need.

Each engine core's tensor-parallel ranks form their own ``torch.distributed`` world (gloo on the
CPU, NCCL on CUDA). At world size 1 there is no process group and no collective is ever called, so
a single worker runs exactly the kernels it ran before tensor parallelism existed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

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


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> ParallelGroup:
    """Join the group of ``world_size`` ranks that rendezvous at ``init_method`` (``tcp://host:port``).

    Blocks until every rank has joined.
    """
    if world_size == 1:
        return SINGLE_RANK
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return ParallelGroup(rank, world_size, dist.group.WORLD)


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago, for rank 0's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
