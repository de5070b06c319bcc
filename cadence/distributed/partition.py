"""How one rank's share of a dimension is chosen: attention heads, MLP columns, vocabulary rows.

Splits are contiguous and as even as possible. Attention is split by KV head groups, so every rank
holds whole groups of query heads with the KV heads they read (9 heads over 3 KV heads and 2 ranks:
6 + 3). With fewer KV heads than ranks, each KV head is replicated on ``world_size / num_kv_heads``
ranks, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Split:
    """The part ``[start, start + size)`` of a dimension of length ``total`` that one rank holds."""

    total: int
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def indices(self) -> slice:
        return slice(self.start, self.stop)

    def scaled(self, factor: int) -> Split:
        """The same split in units ``factor`` times smaller (heads -> features)."""
        return Split(self.total * factor, self.start * factor, self.size * factor)


def even_split(total: int, rank: int, world_size: int) -> Split:
    """Contiguous parts whose sizes differ by at most one; the first ranks take the larger ones."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return Split(total, start, base + (rank < extra))


@dataclass(frozen=True)
class HeadShard:
    """The query heads and KV heads one rank computes."""

    q: Split
    kv: Split


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """This rank's heads. Rank 0 always holds the most KV heads (the KV cache is sized for it).

    :raises ValueError: the heads cannot be split over ``world_size`` ranks.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = even_split(num_kv_heads, rank, world_size)
        return HeadShard(Split(num_heads, kv.start * group, kv.size * group), kv)
    if world_size % num_kv_heads or num_heads % world_size:
        raise ValueError(f"cannot split {num_heads} attention heads over {num_kv_heads} KV heads across "
                         f"{world_size} ranks: with fewer KV heads than ranks, the ranks must be a multiple "
                         f"of the KV heads and divide the heads; choose another --tensor-parallel-size")
    per_rank = num_heads // world_size
    q = Split(num_heads, rank * per_rank, per_rank)
    return HeadShard(q, Split(num_kv_heads, q.start // group, 1))


def check_shardable(hf_config: PretrainedConfig, world_size: int) -> None:
    """Fail before any worker starts if the model cannot run on ``world_size`` ranks.

    :raises ValueError: saying what to change.
    """
    if world_size > hf_config.num_attention_heads:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {hf_config.num_attention_heads} "
                         f"attention heads; choose a smaller --tensor-parallel-size")
    head_shard(hf_config.num_attention_heads, hf_config.num_key_value_heads, 0, world_size)
