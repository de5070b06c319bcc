"""Attention over the paged KV cache with FlashAttention 2's variable-length kernels (CUDA only).

One ``flash_attn_varlen_func`` call per layer serves the whole mixed batch: queries packed by
``cu_seqlens_q``, each request's context (cached prefix + new tokens, already written to the
cache) by ``cu_seqlens_k``, with FlashAttention's causal mask aligned to the bottom right, which
is exactly "query i of a request sees positions up to seq_len - q_len + i".

FlashAttention 2 reads a paged cache through ``block_table`` only when the block size is a
multiple of 256; with smaller blocks (cadence's default is 16) this backend gathers each layer's
contexts into contiguous K/V first, which costs one extra copy of the context per layer. Serve
with ``--block-size 256`` to use the zero-copy paged path.

Installed as the ``cadence[flash]`` extra; flash-attn compiles against the installed CUDA torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch

from cadence.backends.base import AttentionBackend, BatchLayout, store_kv

# FlashAttention 2 reads a paged KV cache only in blocks of a multiple of this many tokens.
PAGED_BLOCK_MULTIPLE = 256


def _varlen_func() -> Callable[..., torch.Tensor]:
    """``flash_attn.flash_attn_varlen_func``, imported on first use (flash-attn is optional)."""
    from flash_attn import flash_attn_varlen_func

    return cast(Callable[..., torch.Tensor], flash_attn_varlen_func)


@dataclass(frozen=True)
class FlashAttnMetadata:
    """One step's attention metadata on the device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_blocks] int32
    # Each context position's request and position, request-major: the gather path's slots.
    context_requests: torch.Tensor  # [sum(seq_lens)] int64
    context_positions: torch.Tensor  # [sum(seq_lens)] int64
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def context_slots(self, block_size: int) -> torch.Tensor:
        """Cache slots of every request's context, request-major; computed by the first layer."""
        slots = self._slots.get(block_size)
        if slots is None:
            blocks = self.block_table[self.context_requests, self.context_positions // block_size].long()
            slots = self._slots[block_size] = blocks * block_size + self.context_positions % block_size
        return slots


class FlashAttnBackend(AttentionBackend):
    """Paged attention with FlashAttention 2 (``pip install 'cadence[flash]'``), CUDA only."""

    name: ClassVar[str] = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._varlen: Callable[..., Any] = _varlen_func()

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(
                f"the flash_attn attention backend runs FlashAttention's CUDA kernels and needs a CUDA device, "
                f"not {device.type!r}: use --attention-backend sdpa on the CPU (or leave the choice to cadence)")
        if not torch.cuda.is_available():
            raise RuntimeError("the flash_attn attention backend needs CUDA, but torch sees no CUDA device "
                               "(a CPU-only torch build, or no GPU visible)")
        try:
            _varlen_func()
        except ImportError as exc:
            raise RuntimeError(f"the flash_attn attention backend needs the flash-attn package ({exc}): "
                               "pip install 'cadence[flash]' --no-build-isolation, "
                               "or use --attention-backend triton") from exc
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise RuntimeError(f"FlashAttention 2 needs an Ampere or newer GPU (compute capability 8.0+); this one "
                               f"is {major}.{minor}: use --attention-backend triton")

    @classmethod
    def check_model(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashAttention computes in float16 or bfloat16 only, not {dtype}: run with "
                             "--dtype bfloat16, or use --attention-backend triton for float32")
        if head_dim > 256 or head_dim % 8:
            raise ValueError(f"FlashAttention needs a head_dim that is a multiple of 8 up to 256; the model has "
                             f"{head_dim}: use --attention-backend triton")

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> FlashAttnMetadata:
        seq_lens = layout.seq_lens.long()
        cu_seqlens_k = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)])
        context_requests = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), seq_lens)
        context_positions = torch.arange(int(cu_seqlens_k[-1])) - cu_seqlens_k[context_requests]
        return FlashAttnMetadata(
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            cu_seqlens_q=layout.query_start_loc.to(device=device, dtype=torch.int32),
            cu_seqlens_k=cu_seqlens_k.to(device=device, dtype=torch.int32),
            max_seqlen_q=layout.max_query_len,
            max_seqlen_k=layout.max_seq_len,
            block_table=layout.block_table.to(device=device, dtype=torch.int32),
            context_requests=context_requests.to(device),
            context_positions=context_positions.to(device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        meta = cast(FlashAttnMetadata, metadata)
        block_size = k_cache.shape[1]
        flat_k, flat_v = store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if block_size % PAGED_BLOCK_MULTIPLE == 0:
            keys, values, block_table = k_cache, v_cache, meta.block_table
        else:
            slots = meta.context_slots(block_size)
            keys, values, block_table = flat_k.index_select(0, slots), flat_v.index_select(0, slots), None
        return cast(torch.Tensor, self._varlen(
            q, keys, values, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=block_table,
        ))
