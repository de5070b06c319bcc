"""Attention over the paged KV cache with FlashAttention 2's variable-length kernels (CUDA only).

One ``flash_attn_varlen_func`` call per layer serves the whole mixed batch: queries packed by
``cu_seqlens_q``, each request's context (cached prefix + new tokens, already written to the
cache) by ``cu_seqlens_k``, with FlashAttention's causal mask aligned to the bottom right, which
is exactly "query i of a request sees positions up to seq_len - q_len + i".

FlashAttention 2 reads a paged cache through ``block_table`` only when the block size is a
multiple of 256; with smaller blocks (cadence's default is 16) this backend gathers each layer's
contexts into contiguous K/V first, which costs one extra copy of the context per layer. Serve
with ``--block-size 256`` to use the zero-copy paged path.

A sliding window is FlashAttention's ``window_size=(window - 1, 0)`` (a query at position ``p``
sees ``p - (window - 1)`` to ``p``), the logit soft-cap its ``softcap``. On the gather path a
windowed layer gathers only the keys some query of its request can see: the tail of each context
(cached per window in the step's metadata, since layers of one step may have different windows).

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
class GatheredContexts:
    """The gather path's keys for one window: each request's context, or the part of it its
    queries can see, packed request-major."""

    slots: torch.Tensor  # [sum(lengths)] int64: cache slots to gather
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_k: int


@dataclass(frozen=True)
class FlashAttnMetadata:
    """One step's attention metadata on the device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_blocks] int32
    # On the host, so that the gather path sizes its contexts without waiting for the device.
    host_seq_lens: torch.Tensor  # [B] int64
    host_query_lens: torch.Tensor  # [B] int64
    _gathered: dict[tuple[int, int | None], GatheredContexts] = field(default_factory=dict, compare=False,
                                                                     repr=False)

    def gathered(self, block_size: int, window: int | None) -> GatheredContexts:
        """What a layer with this ``window`` gathers; computed by the first such layer of the step."""
        key = (block_size, window)
        if key not in self._gathered:
            self._gathered[key] = self._gather_plan(block_size, window)
        return self._gathered[key]

    def _gather_plan(self, block_size: int, window: int | None) -> GatheredContexts:
        seq_lens = self.host_seq_lens
        lengths = seq_lens
        if window is not None:
            # Keys before the first query's window are seen by none of the request's queries. Both
            # of FlashAttention's masks are aligned to the context's end, so leaving out keys at
            # its front changes nothing else.
            lengths = torch.minimum(seq_lens, self.host_query_lens + window - 1)
        cu_seqlens_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        total, device = int(cu_seqlens_k[-1]), self.block_table.device
        requests = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths.to(device),
                                           output_size=total)
        # Entry i of request r is position i - cu[r] + (seq_len - length)[r] of its context.
        shift = (seq_lens - lengths - cu_seqlens_k[:-1]).to(device)
        positions = torch.arange(total, device=device) + shift[requests]
        blocks = self.block_table[requests, positions // block_size].long()
        return GatheredContexts(slots=blocks * block_size + positions % block_size,
                                cu_seqlens_k=cu_seqlens_k.to(device=device, dtype=torch.int32),
                                max_seqlen_k=int(lengths.max()))


class FlashAttnBackend(AttentionBackend):
    """Paged attention with FlashAttention 2 (``pip install 'cadence[flash]'``), CUDA only."""

    name: ClassVar[str] = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap)
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
        query_start = layout.query_start_loc.long()
        return FlashAttnMetadata(
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            cu_seqlens_q=layout.query_start_loc.to(device=device, dtype=torch.int32),
            cu_seqlens_k=cu_seqlens_k.to(device=device, dtype=torch.int32),
            max_seqlen_q=layout.max_query_len,
            max_seqlen_k=layout.max_seq_len,
            block_table=layout.block_table.to(device=device, dtype=torch.int32),
            host_seq_lens=seq_lens,
            host_query_lens=query_start[1:] - query_start[:-1],
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
        if block_size % PAGED_BLOCK_MULTIPLE == 0:  # FlashAttention skips the blocks outside the window
            keys, values, block_table = k_cache, v_cache, meta.block_table
            cu_seqlens_k, max_seqlen_k = meta.cu_seqlens_k, meta.max_seqlen_k
        else:
            gathered = meta.gathered(block_size, self.sliding_window)
            keys, values = flat_k.index_select(0, gathered.slots), flat_v.index_select(0, gathered.slots)
            block_table, cu_seqlens_k, max_seqlen_k = None, gathered.cu_seqlens_k, gathered.max_seqlen_k
        return cast(torch.Tensor, self._varlen(
            q, keys, values, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q, max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self._window_size(),
            softcap=self.logits_soft_cap or 0.0, block_table=block_table,
        ))

    def _window_size(self) -> tuple[int, int]:
        """FlashAttention's ``(left, right)``: a query at ``p`` sees ``p - left`` to ``p + right``, and
        ``-1`` is unbounded; the contract's ``p - window + 1`` to ``p`` is ``(window - 1, 0)``."""
        return (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
