"""The attention backend contract.

A backend turns one step's batch layout (built once per step by the model runner) into its own
metadata, then, for every layer, writes the step's new K/V into the paged cache and computes
attention for a mixed batch of prefills (query length > 1) and decodes (query length 1).

Paged cache, per layer: ``k_cache`` and ``v_cache`` hold ``num_blocks`` blocks of ``block_size``
tokens; the slot of a token is ``block_id * block_size + offset``; block 0 is the null block that
pads block tables. The canonical layout is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
backend may store the same dims in another order (``kv_cache_dims``) when its kernels read that
faster, and the worker allocates the caches in the backend's order.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class BatchLayout:
    """One step's batch, in scheduler order, as plain CPU tensors built by the model runner.

    Requests are ordered decodes first is *not* assumed; each request ``i`` owns the query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` whose positions end at ``seq_lens[i] - 1``.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: cached context + new tokens
    block_table: torch.Tensor  # [B, max_num_blocks] int32, padded with 0 (null block)
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K/V at their slots with torch ops; returns the caches viewed as
    ``[num_slots, num_kv_heads, head_dim]`` for reading them back by slot."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k)
    flat_v.index_copy_(0, slot_mapping, v)
    return flat_k, flat_v


class AttentionBackend(abc.ABC):
    """One attention implementation over the paged KV cache.

    Registered in the entry-point group ``cadence.attention_backends``; the class is imported only
    when chosen, so optional dependencies live inside the backend's module.
    """

    name: ClassVar[str]
    # The cache tensors' dims as positions in the canonical [num_blocks, block_size, num_kv_heads, head_dim].
    kv_cache_dims: ClassVar[tuple[int, int, int, int]] = (0, 1, 2, 3)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (or V) cache in this backend's layout."""
        canonical = (num_blocks, block_size, num_kv_heads, head_dim)
        return tuple(canonical[d] for d in cls.kv_cache_dims)

    @classmethod
    def allocate_kv_caches(cls, count: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` (K, V) cache pairs in this backend's layout.

        Zeroed, not empty: padded reads of unwritten slots are masked, and 0 * NaN would not be.
        """
        shape = cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(count)]

    @classmethod
    def to_kv_cache_layout(cls, cache: torch.Tensor) -> torch.Tensor:
        """A canonical-layout cache copied into this backend's layout."""
        return cache.permute(cls.kv_cache_dims).contiguous()

    @classmethod
    def from_kv_cache_layout(cls, cache: torch.Tensor) -> torch.Tensor:
        """A view of this backend's cache in the canonical layout."""
        inverse = sorted(range(4), key=cls.kv_cache_dims.__getitem__)
        return cache.permute(inverse)

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ``RuntimeError`` saying why this backend cannot run on ``device``."""

    @classmethod
    def check_model(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        """Raise ``ValueError`` saying why this backend cannot serve this model dtype, head size or
        KV block size; the worker calls it at start-up, before loading weights."""

    @classmethod
    def prepare(cls, device: torch.device, dtype: torch.dtype) -> None:
        """One-time set-up before the first step (building kernels); the worker calls it at start-up
        so that no request waits for it."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        """One object per kind of attention layer: a model whose layers differ (Gemma's sliding and
        global layers) builds one per kind, all sharing the step's metadata.

        ``sliding_window``: a query at position ``p`` sees only the keys at positions ``p - window + 1``
        to ``p`` (transformers' sliding-window mask); None: every key up to ``p``.
        ``logits_soft_cap``: the scaled scores ``s`` become ``cap * tanh(s / cap)`` before the mask
        and softmax (Gemma 2); None: left as they are.
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, not {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, not {logits_soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @abc.abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> object:
        """Per-step metadata shared by every layer (moved to ``device`` once)."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """Store ``k``/``v`` at their slots, then return attention output ``[T, num_heads, head_dim]``."""
