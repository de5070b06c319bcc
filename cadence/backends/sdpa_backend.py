"""Attention over the paged KV cache with torch's ``scaled_dot_product_attention``.

The reference backend and the CPU default. Each layer writes the step's K/V into the cache, then
runs every decode (query length 1) of the batch in one SDPA call over keys gathered through the
block table, and each prefill (query length > 1) in its own call. Everything that does not change
between layers (which requests decode, masks, cache slots to gather) is worked out once per step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch
import torch.nn.functional as F

from cadence.backends.base import AttentionBackend, BatchLayout, store_kv


@dataclass(frozen=True)
class _Prefill:
    """One request with more than one query token this step."""

    tokens: slice  # its rows in q/k/v
    request: int  # its row in the block table
    seq_len: int  # cached context + new tokens
    # [q_len, seq_len] bool, True where a query may see a key; None when nothing was cached
    # before this step, so plain causal attention over the step's own k/v is exact.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _Slots:
    """Cache slots to gather for one block size (the layout does not carry it; the cache does)."""

    decode: torch.Tensor | None  # [Bd * max decode seq_len] int64, request-major
    prefill: tuple[torch.Tensor | None, ...]  # [seq_len] int64 per prefill with a cached prefix


@dataclass(frozen=True)
class SDPAMetadata:
    """One step's attention metadata, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_num_blocks] int64
    decode_tokens: slice | torch.Tensor  # rows of q that decode; a slice when they are contiguous
    decode_requests: torch.Tensor  # [Bd] rows of the block table
    decode_seq_len: int  # longest decode context (keys gathered per decode)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, decode_seq_len] bool; None when no padding
    prefills: tuple[_Prefill, ...]
    _slots: dict[int, _Slots] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_decodes(self) -> int:
        return self.decode_requests.shape[0]

    def slots(self, block_size: int) -> _Slots:
        """Cache slots of the decodes' and prefixed prefills' contexts, computed by the first layer."""
        cached = self._slots.get(block_size)
        if cached is None:
            cached = self._slots[block_size] = self._compute_slots(block_size)
        return cached

    def _compute_slots(self, block_size: int) -> _Slots:
        decode = None
        if self.num_decodes:
            rows = self.block_table[self.decode_requests]
            decode = _context_slots(rows, self.decode_seq_len, block_size).flatten()
        prefill = tuple(
            None if p.mask is None else _context_slots(self.block_table[p.request], p.seq_len, block_size)
            for p in self.prefills
        )
        return _Slots(decode, prefill)


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``0..seq_len-1`` for a block-table row ``[nb]`` or rows ``[B, nb]``."""
    positions = torch.arange(seq_len, device=block_table.device)
    blocks = block_table[..., positions // block_size]
    return blocks * block_size + positions % block_size


class SDPABackend(AttentionBackend):
    """Paged attention with torch SDPA: gathers each request's context from the cache."""

    name: ClassVar[str] = "sdpa"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
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
        decode_seq_len = max(decode_seq_lens, default=0)
        return SDPAMetadata(
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            block_table=layout.block_table.to(device=device, dtype=torch.int64),
            decode_tokens=_rows(decodes, query_start, device),
            decode_requests=torch.tensor(decodes, dtype=torch.int64, device=device),
            decode_seq_len=decode_seq_len,
            decode_mask=_decode_mask(decode_seq_lens, decode_seq_len, device),
            prefills=prefills,
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
        block_size = k_cache.shape[1]
        flat_k, flat_v = store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        slots = meta.slots(block_size)
        out = torch.empty_like(q)
        if slots.decode is not None:
            rows = meta.decode_tokens
            out[rows] = self._decode(q[rows], flat_k, flat_v, slots.decode, meta.decode_mask)
        for prefill, context in zip(meta.prefills, slots.prefill, strict=True):
            if context is None:
                keys, values = k[prefill.tokens], v[prefill.tokens]
            else:
                keys, values = flat_k.index_select(0, context), flat_v.index_select(0, context)
            out[prefill.tokens] = self._prefill(q[prefill.tokens], keys, values, prefill.mask)
        return out

    def _decode(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        # The query heads sharing a KV head become that head's query rows ([Bd, Hkv, G, D] against
        # [Bd, Hkv, S, D]): one query row per head sends bf16 SDPA down a path ~6x slower on CPU,
        # and enable_gqa is slower still. Head h reads KV head h // G, as repeat_interleave would.
        num_decodes = q.shape[0]
        grouped = q.reshape(num_decodes, self.num_kv_heads, -1, self.head_dim)
        # index_select over flat slots copies whole rows: ~10x faster than advanced indexing on CPU.
        shape = (num_decodes, -1, self.num_kv_heads, self.head_dim)
        keys = flat_k.index_select(0, slots).view(shape).transpose(1, 2)
        values = flat_v.index_select(0, slots).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(num_decodes, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        # [1, H, L, D] against [1, Hkv, S, D]; without a mask L == S and causal is top-left aligned
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)


def _rows(requests: list[int], query_start: list[int], device: torch.device) -> slice | torch.Tensor:
    """The token rows of single-token requests: a slice when contiguous (a view, no copy)."""
    rows = [query_start[i] for i in requests]
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _decode_mask(seq_lens: list[int], max_len: int, device: torch.device) -> torch.Tensor | None:
    if all(n == max_len for n in seq_lens):
        return None
    lens = torch.tensor(seq_lens, device=device)
    return (torch.arange(max_len, device=device) < lens[:, None])[:, None, None, :]


def _prefill(start: int, query_len: int, request: int, seq_len: int, device: torch.device) -> _Prefill:
    """Query ``i`` sits at position ``seq_len - query_len + i`` and sees keys up to that position."""
    mask = None
    if seq_len > query_len:
        first = seq_len - query_len
        query_pos = torch.arange(first, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return _Prefill(slice(start, start + query_len), request, seq_len, mask)
