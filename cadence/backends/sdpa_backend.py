"""Attention over the paged KV cache: C++ kernels on x86 CPUs, torch ops elsewhere.

The reference backend and the CPU default. Each layer writes the step's K/V into the cache, then
attends. On CPUs with AVX-512 (bf16/fp32, head_dim a multiple of 16) both are C++ kernels
(``csrc/paged_attention.cpp``): every query token, decode or prefill, attends to its own request's
cached keys up to its position, read in place through the block table (SmolLM2 here: 11.7 ms per
batch-64 decode step against 31 ms for the torch path, 57 ms per 2,048-token prefill step against
145-190 ms for per-prompt SDPA). With AVX2 only, the kernel's prefill tiles (over SIMDe) are
slower than SDPA, so there a step's decodes take the kernel and its prefills torch's ops
(``cpu_kernels.attention_takes_prefills``). Elsewhere every decode
(query length 1) of the batch runs at once as two batched matmuls over keys gathered block by
block, and each prefill (query length > 1) in its own ``scaled_dot_product_attention`` call.
Everything that does not change between layers (which requests decode, masks, cache blocks to
gather) is worked out once per step, and once per sliding window where layers differ in theirs.
A sliding window and soft-capped scores (:class:`~cadence.backends.base.AttentionBackend`) are
arguments of the C++ kernel; in torch ops the window is part of each mask, and soft-capping
computes the prefill's scores explicitly (SDPA cannot cap them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F

from cadence.backends.base import AttentionBackend, BatchLayout
from cadence.backends.cpu_kernels import KERNEL_DTYPES, attention_takes_prefills, cpu_ops, runs_kernels


@dataclass(frozen=True)
class _Prefill:
    """One request with more than one query token this step."""

    tokens: slice  # its rows in q/k/v
    request: int  # its row in the block table
    seq_len: int  # cached context + new tokens
    # [q_len, seq_len] bool, True where a query may see a key; None when nothing was cached
    # before this step, so plain causal attention over the step's own k/v is exact.
    mask: torch.Tensor | None

    def window_mask(self, window: int, device: torch.device) -> torch.Tensor:
        """``[q_len, seq_len]`` bool: the keys each query sees within a sliding ``window``."""
        query_len = self.tokens.stop - self.tokens.start
        query_pos = torch.arange(self.seq_len - query_len, self.seq_len, device=device)[:, None]
        keys = torch.arange(self.seq_len, device=device)[None, :]
        return (keys <= query_pos) & (keys > query_pos - window)


@dataclass(frozen=True)
class _Gather:
    """What to read back from the cache for one block size (the layout does not carry it; the cache does)."""

    decode_blocks: torch.Tensor | None  # [Bd * blocks per decode] int64, request-major
    # [1, Bd, 1, blocks per decode * block_size] fp32, -inf past each decode's context; None: no padding
    decode_bias: torch.Tensor | None
    prefill: tuple[torch.Tensor | None, ...]  # [seq_len] int64 slots per prefill with a cached prefix
    masks: tuple[torch.Tensor | None, ...]  # each prefill's mask (:attr:`_Prefill.mask`, or its window's)


@dataclass(frozen=True)
class SDPAMetadata:
    """One step's attention metadata, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_num_blocks] int64
    decode_tokens: slice | torch.Tensor  # rows of q that decode; a slice when they are contiguous
    decode_requests: torch.Tensor  # [Bd] rows of the block table
    decode_seq_lens: torch.Tensor  # [Bd] int64
    decode_seq_len: int  # longest decode context
    prefills: tuple[_Prefill, ...]
    token_requests: torch.Tensor  # [T] int64: each query token's row of the block table
    token_seq_lens: torch.Tensor  # [T] int64: each query token's position + 1 (the keys it sees)
    _gather: dict[int, _Gather] = field(default_factory=dict, compare=False, repr=False)
    _windowed: dict[tuple[int, int], _Gather] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_decodes(self) -> int:
        return self.decode_requests.shape[0]

    def gather(self, block_size: int) -> _Gather:
        """Blocks and slots of the decodes' and prefixed prefills' contexts, worked out by the first layer."""
        cached = self._gather.get(block_size)
        if cached is None:
            cached = self._gather[block_size] = self._compute_gather(block_size)
        return cached

    def gather_window(self, block_size: int, window: int | None) -> _Gather:
        """:meth:`gather` for layers with a sliding window: the decode bias and the prefills' masks also
        hide the keys before each query's window."""
        if window is None:
            return self.gather(block_size)
        cached = self._windowed.get((block_size, window))
        if cached is None:
            plain = self.gather(block_size)
            bias = None
            if self.num_decodes:
                width = -(-self.decode_seq_len // block_size) * block_size
                bias = _padding_bias(self.decode_seq_lens, width, window)
            masks = tuple(p.window_mask(window, self.block_table.device) for p in self.prefills)
            cached = self._windowed[(block_size, window)] = _Gather(plain.decode_blocks, bias, plain.prefill, masks)
        return cached

    def _compute_gather(self, block_size: int) -> _Gather:
        blocks = bias = None
        if self.num_decodes:
            num_blocks = -(-self.decode_seq_len // block_size)
            blocks = self.block_table[self.decode_requests, :num_blocks].flatten()
            bias = _padding_bias(self.decode_seq_lens, num_blocks * block_size)
        prefill = tuple(
            None if p.mask is None else _context_slots(self.block_table[p.request], p.seq_len, block_size)
            for p in self.prefills
        )
        return _Gather(blocks, bias, prefill, tuple(p.mask for p in self.prefills))


def _padding_bias(seq_lens: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor | None:
    """Additive mask hiding key positions at or past each sequence's length, and before its last
    ``window`` keys; None when none are hidden."""
    keys = torch.arange(width, device=seq_lens.device)[None, :]
    hidden = keys >= seq_lens[:, None]
    if window is not None:
        hidden |= keys < seq_lens[:, None] - window
    if not bool(hidden.any()):
        return None
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=seq_lens.device)
    return bias.masked_fill_(hidden, float("-inf"))[None, :, None, :]


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``0..seq_len-1`` for one block-table row."""
    positions = torch.arange(seq_len, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


class SDPABackend(AttentionBackend):
    """Paged attention in torch ops: gathers each request's context from a head-major cache.

    The cache is ``[num_kv_heads, num_blocks, block_size, head_dim]``: gathering a decode batch's
    blocks along dim 1 yields keys already laid out ``[Hkv, Bd, S, D]`` for batched matmuls, with
    whole 2 KiB blocks copied at a time and no transposing copy afterwards.
    """

    name: ClassVar[str] = "sdpa"
    kv_cache_dims: ClassVar[tuple[int, int, int, int]] = (2, 0, 1, 3)

    @classmethod
    def prepare(cls, device: torch.device, dtype: torch.dtype) -> None:
        # Built once per version of the sources (about 50 s on 2 cores), then loaded from cadence's cache.
        runs_kernels(device, dtype)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
        if layout.max_query_len == 1:
            return _decodes_metadata(layout, device)
        query_start = layout.query_start_loc.tolist()
        seq_lens = layout.seq_lens.tolist()
        query_lens = [end - start for start, end in itertools.pairwise(query_start)]
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        prefills = tuple(
            _prefill(query_start[i], query_lens[i], i, seq_lens[i], device)
            for i, n in enumerate(query_lens)
            if n > 1
        )
        decode_seq_lens = [seq_lens[i] for i in decodes]
        # In numpy: a dozen torch ops on these few numbers cost a decode step of one request about
        # 0.2 ms (docs/benchmarks.md, "One user's decode").
        counts = np.asarray(query_lens, dtype=np.int64)
        token_requests = np.repeat(np.arange(len(query_lens)), counts)
        # a token's position + 1: its request's context before the step, plus its index in the step,
        # which is the token's row less the request's first row
        row_to_position = layout.seq_lens.numpy() - counts - np.asarray(query_start[:-1], dtype=np.int64)
        token_seq_lens = np.repeat(row_to_position, counts) + np.arange(layout.num_tokens) + 1
        return SDPAMetadata(
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            block_table=layout.block_table.to(device=device, dtype=torch.int64),
            decode_tokens=_rows(decodes, query_start, device),
            decode_requests=torch.tensor(decodes, dtype=torch.int64, device=device),
            decode_seq_lens=torch.tensor(decode_seq_lens, dtype=torch.int64, device=device),
            decode_seq_len=max(decode_seq_lens, default=0),
            prefills=prefills,
            token_requests=torch.from_numpy(token_requests).to(device),
            token_seq_lens=torch.from_numpy(token_seq_lens).to(device),
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
        meta = cast(SDPAMetadata, metadata)
        ops = cpu_ops() if _kernel_reads(q, k_cache) else None
        if ops is not None and (not meta.prefills or attention_takes_prefills()):
            # Every token, decode or prefill, attends to its own request's cache up to its position.
            ops.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            return self._kernel(ops, q, k_cache, v_cache, meta.block_table, meta.token_requests, meta.token_seq_lens)
        num_kv_heads, _, block_size, head_dim = k_cache.shape
        flat_k, flat_v = k_cache.view(num_kv_heads, -1, head_dim), v_cache.view(num_kv_heads, -1, head_dim)
        flat_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        flat_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        rows = meta.decode_tokens
        gather = meta.gather_window(block_size, self.sliding_window)
        if ops is not None and meta.num_decodes:  # the kernel's decodes beside torch's prefills (AVX2)
            out[rows] = self._kernel(ops, q[rows], k_cache, v_cache, meta.block_table, meta.decode_requests,
                                     meta.decode_seq_lens)
        elif gather.decode_blocks is not None:
            out[rows] = self._decode(q[rows], k_cache, v_cache, gather.decode_blocks, gather.decode_bias)
        for prefill, context, mask in zip(meta.prefills, gather.prefill, gather.masks, strict=True):
            if context is None:
                keys, values = k[prefill.tokens].transpose(0, 1), v[prefill.tokens].transpose(0, 1)
            else:
                keys, values = flat_k.index_select(1, context), flat_v.index_select(1, context)
            out[prefill.tokens] = self._prefill(q[prefill.tokens], keys, values, mask)
        return out

    def _kernel(self, ops: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_table: torch.Tensor, requests: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The paged-attention kernel over rows ``q`` of ``requests`` (block-table rows) that see
        ``seq_lens`` keys each."""
        out = q.new_empty(q.shape)
        ops.paged_attention(out, q, k_cache, v_cache, block_table, requests, seq_lens, self.scale,
                            self.sliding_window or 0, self.logits_soft_cap or 0.0)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        # Two batched matmuls with an fp32 softmax between them: 2-3x faster on CPU than SDPA's
        # flash kernel for a few query rows per head. The query heads sharing a KV head become that
        # head's query rows ([Hkv, Bd, G, D] against [Hkv, Bd, S, D]); head h reads KV head h // G.
        num_decodes = q.shape[0]
        num_kv_heads, num_blocks, _, head_dim = k_cache.shape
        shape = (num_kv_heads, num_decodes, -1, head_dim)
        keys = k_cache.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape)
        values = v_cache.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape)
        grouped = q.view(num_decodes, num_kv_heads, -1, head_dim).transpose(0, 1)
        scores = self._cap(torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(self.scale))
        if bias is not None:
            scores += bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values)
        return out.transpose(0, 1).reshape(num_decodes, self.num_heads, head_dim)

    def _cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Soft-capped scores (in place), or the scores as they are without a cap."""
        if self.logits_soft_cap is None:
            return scores
        return scores.div_(self.logits_soft_cap).tanh_().mul_(self.logits_soft_cap)

    def _prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        if self.logits_soft_cap is not None:
            return self._capped_prefill(q, keys, values, mask)
        # [1, H, L, D] against [1, Hkv, S, D]; without a mask L == S and causal is top-left aligned
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)

    def _capped_prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor:
        # q [L, H, D] against keys/values [Hkv, S, D]: the scores spelled out, since SDPA cannot cap them.
        query_len, seq_len = q.shape[0], keys.shape[1]
        if mask is None:  # nothing cached before the step: causal over the step's own keys
            mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril_()
        grouped = q.transpose(0, 1).reshape(self.num_kv_heads, -1, query_len, self.head_dim)  # [Hkv, G, L, D]
        scores = self._cap(torch.matmul(grouped, keys.unsqueeze(1).transpose(-1, -2)).float().mul_(self.scale))
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.unsqueeze(1))  # [Hkv, G, L, D]
        return out.reshape(self.num_heads, query_len, self.head_dim).transpose(0, 1)


def _kernel_reads(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ paged-attention kernels handle these tensors (CPU, bf16/fp32, head_dim a multiple of 16)."""
    return (q.device.type == "cpu" and q.dtype in KERNEL_DTYPES and q.dtype == k_cache.dtype
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256)


def _decodes_metadata(layout: BatchLayout, device: torch.device) -> SDPAMetadata:
    """:meth:`SDPABackend.build_metadata` of a step where every request computes one token: request
    ``i`` is row ``i``, and attends to its whole context. At batch 1 the general form's per-token
    arithmetic costs more than the step's attention (docs/performance.md, "A step of decodes only")."""
    num = layout.num_requests
    requests = torch.arange(num, device=device)
    seq_lens = layout.seq_lens.to(device=device, dtype=torch.int64)
    return SDPAMetadata(
        slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
        block_table=layout.block_table.to(device=device, dtype=torch.int64),
        decode_tokens=slice(0, num),
        decode_requests=requests,
        decode_seq_lens=seq_lens,
        decode_seq_len=layout.max_seq_len,
        prefills=(),
        token_requests=requests,
        token_seq_lens=seq_lens,
    )


def _rows(requests: list[int], query_start: list[int], device: torch.device) -> slice | torch.Tensor:
    """The token rows of single-token requests: a slice when contiguous (a view, no copy)."""
    rows = [query_start[i] for i in requests]
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _prefill(start: int, query_len: int, request: int, seq_len: int, device: torch.device) -> _Prefill:
    """Query ``i`` sits at position ``seq_len - query_len + i`` and sees keys up to that position."""
    mask = None
    if seq_len > query_len:
        first = seq_len - query_len
        query_pos = torch.arange(first, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return _Prefill(slice(start, start + query_len), request, seq_len, mask)
