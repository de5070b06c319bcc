"""Tensor parallelism over ``torch.distributed``: the process group, its collectives, how a model's
dimensions are split across ranks, and the parallel layers that hold one rank's shard."""

from cadence.distributed.group import SINGLE_RANK, ParallelGroup, init_tensor_parallel
from cadence.distributed.partition import HeadShard, Split, check_shardable, even_split, head_shard

__all__ = [
    "SINGLE_RANK",
    "HeadShard",
    "ParallelGroup",
    "Split",
    "check_shardable",
    "even_split",
    "head_shard",
    "init_tensor_parallel",
]
