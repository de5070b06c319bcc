"""Attention over the paged KV cache with cadence's own Triton kernels.

The GPU backend that needs nothing beyond triton (which CUDA builds of torch already bring). Each
layer writes the step's K/V into the cache with one kernel, then runs the decodes (query length 1)
through the split-K decode kernel and the prefills (query length > 1, with or without a cached
prefix) through the causal prefill kernel; both read the whole context from the paged cache, or
with a sliding window only the part of it some query of theirs can see. Window and logit soft-cap
are the kernels' compile-time constants: a model with sliding and global layers (Gemma) runs two
compiled variants of each kernel, and a model with neither runs them compiled exactly as before.

On the CPU the kernels run only in Triton's interpreter, which must be switched on with
``TRITON_INTERPRET=1`` before cadence first imports them: it is 10³–10⁴× slower than torch and
exists so that the kernels are tested on machines without a GPU. ``check_device`` refuses the CPU
otherwise, rather than this module setting a process-wide variable behind the user's back.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, cast

import torch

from cadence.backends.base import AttentionBackend, BatchLayout

logger = logging.getLogger(__name__)

# Tiles (tokens) of the interpreter: small, so that tiny test shapes still cross tile and
# partition boundaries. Compiled kernels use the kernel modules' defaults.
_INTERPRETER_TILE = 16


def _kernels() -> ModuleType:
    """The kernel package, imported on first use: triton is an optional dependency."""
    import cadence.backends.triton_kernels as kernels

    return kernels


@dataclass(frozen=True)
class _Decodes:
    """The step's single-token requests."""

    rows: torch.Tensor  # [Bd] int32: each one's row in q/out
    seq_lens: torch.Tensor  # [Bd] int32
    block_table: torch.Tensor  # [Bd, max_blocks] int32
    # The split-K partitions depend on each layer's window, so forward derives them from this.
    max_seq_len: int


@dataclass(frozen=True)
class _Prefills:
    """The step's multi-token requests (fresh prompts, prompt chunks, prompts after a prefix hit)."""

    query_start: torch.Tensor  # [P] int32
    query_lens: torch.Tensor  # [P] int32
    seq_lens: torch.Tensor  # [P] int32
    block_table: torch.Tensor  # [P, max_blocks] int32
    max_query_len: int


@dataclass(frozen=True)
class TritonMetadata:
    """One step's attention metadata on the device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    decodes: _Decodes | None
    prefills: _Prefills | None


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels: compiled on CUDA, interpreted on the CPU (tests)."""

    name: ClassVar[str] = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap)
        kernels = _kernels()
        self.interpreted: bool = kernels.INTERPRETED
        tile = _INTERPRETER_TILE if self.interpreted else None
        self.decode_block_n: int = tile or kernels.decode.BLOCK_N
        self.prefill_block_m: int = tile or kernels.prefill.BLOCK_M
        self.prefill_block_n: int = tile or kernels.prefill.BLOCK_N
        # Tokens per split-K partition; None: split by occupancy (see num_decode_splits).
        self.partition_tokens: int | None = None

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        try:
            kernels = _kernels()
        except ImportError as exc:
            raise RuntimeError(f"the triton attention backend needs the triton package ({exc}): "
                               "pip install 'cadence[triton]'") from exc
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("the triton attention backend was asked for CUDA, but torch sees no CUDA "
                                   "device (a CPU-only torch build, or no GPU visible)")
            if kernels.INTERPRETED:
                logger.warning("TRITON_INTERPRET=1: the triton backend runs its kernels in the interpreter, "
                               "on the host, thousands of times slower than compiled")
        elif device.type == "cpu":
            if not kernels.INTERPRETED:
                raise RuntimeError(
                    "the triton attention backend runs on the CPU only in Triton's interpreter, a slow mode "
                    "for tests: set TRITON_INTERPRET=1 in the environment before starting cadence (it must be "
                    "set before the kernels are first imported), or use --attention-backend sdpa on the CPU")
        else:
            raise RuntimeError(f"the triton attention backend runs on CUDA devices (or on the CPU in Triton's "
                               f"interpreter), not on {device.type!r}")

    @classmethod
    def check_model(cls, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the triton attention backend supports float32, float16 and bfloat16, not {dtype}")
        if head_dim < 16:  # tl.dot needs 16 along every dimension
            raise ValueError(f"the triton attention backend needs head_dim >= 16, the model has {head_dim}")

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TritonMetadata:
        query_start = layout.query_start_loc.to(torch.int32)
        query_lens = query_start[1:] - query_start[:-1]
        seq_lens = layout.seq_lens.to(torch.int32)
        block_table = layout.block_table.to(torch.int32)
        is_decode = query_lens == 1
        decode_ids = is_decode.nonzero().flatten()
        prefill_ids = (~is_decode).nonzero().flatten()
        decodes = None
        if decode_ids.numel():
            decode_seq_lens = seq_lens[decode_ids]
            decodes = _Decodes(
                rows=_to(query_start[decode_ids], device),
                seq_lens=_to(decode_seq_lens, device),
                block_table=_to(block_table[decode_ids], device),
                max_seq_len=int(decode_seq_lens.max()),
            )
        prefills = None
        if prefill_ids.numel():
            prefill_lens = query_lens[prefill_ids]
            prefills = _Prefills(
                query_start=_to(query_start[prefill_ids], device),
                query_lens=_to(prefill_lens, device),
                seq_lens=_to(seq_lens[prefill_ids], device),
                block_table=_to(block_table[prefill_ids], device),
                max_query_len=int(prefill_lens.max()),
            )
        slot_mapping = layout.slot_mapping.to(device=device, dtype=torch.int64)
        return TritonMetadata(slot_mapping=slot_mapping, decodes=decodes, prefills=prefills)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        meta = cast(TritonMetadata, metadata)
        kernels = _kernels()
        kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        # fp32 caches keep fp32 dots (IEEE, not TF32); the interpreter cannot do arithmetic on bf16.
        upcast = self.interpreted or k_cache.dtype == torch.float32
        window, cap = self.sliding_window, self.logits_soft_cap
        if (d := meta.decodes) is not None:
            num_splits, partition_tokens = self.decode_splits(d, q.device)
            kernels.paged_decode_attention(out, q, k_cache, v_cache, d.rows, d.seq_lens, d.block_table, self.scale,
                                           num_splits, partition_tokens, upcast, block_n=self.decode_block_n,
                                           sliding_window=window, logits_soft_cap=cap)
        if (p := meta.prefills) is not None:
            kernels.paged_prefill_attention(out, q, k_cache, v_cache, p.query_start, p.query_lens, p.seq_lens,
                                            p.block_table, p.max_query_len, self.scale, upcast,
                                            block_m=self.prefill_block_m, block_n=self.prefill_block_n,
                                            sliding_window=window, logits_soft_cap=cap)
        return out

    def decode_splits(self, decodes: _Decodes, device: torch.device) -> tuple[int, int]:
        """``(num_splits, partition_tokens)`` for this layer's decodes: the partitions tile what the
        longest context's query sees (its window, where the layer has one). Worked out per layer, from
        integers, because the layer that built the metadata may have another window."""
        span = decodes.max_seq_len
        if self.sliding_window is not None:
            span = min(span, self.sliding_window)
        num_programs = decodes.rows.shape[0] * self.num_kv_heads
        return cast(tuple[int, int], _kernels().num_decode_splits(
            span, num_programs, _target_programs(device), self.partition_tokens, self.decode_block_n))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.contiguous().to(device)


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Decode programs worth launching: a few per SM on a GPU; one on the CPU, where the interpreter
    runs programs one after another and a split only adds work."""
    if device.type != "cuda":
        return 1
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
