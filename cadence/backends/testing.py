"""Random paged batches for checking an attention backend against the ``sdpa`` reference.

Shared by the CPU tests and ``benchmarks/gpu_check.py``: a mixed batch of requests, each with a
context already in the cache (a prefix hit or earlier steps) and new tokens this step, over
scattered cache blocks, exactly as the model runner lays it out.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cadence.backends.base import AttentionBackend, BatchLayout
from cadence.backends.sdpa_backend import SDPABackend


@dataclass(frozen=True)
class PagedBatch:
    """One step's inputs: new tokens' q/k/v, caches holding the cached contexts, and the layout."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    layout: BatchLayout

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    def to(self, dtype: torch.dtype) -> PagedBatch:
        """The same batch with q/k/v and the caches converted (the layout is shared)."""
        return PagedBatch(self.q.to(dtype), self.k.to(dtype), self.v.to(dtype), self.k_cache.to(dtype),
                          self.v_cache.to(dtype), self.layout)


def random_paged_batch(
    requests: Sequence[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A batch of ``requests`` given as ``(cached tokens, new tokens)`` pairs, in that order.

    Blocks are drawn at random from a pool with ``spare_blocks`` never used (so stray reads or
    writes would show); block 0 is the null block that pads the block table.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = 1 + sum(needed) + spare_blocks
    pool = list(range(1, num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    width = max(needed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)  # garbage where nothing was written
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    starts, slots = [0], []
    for table, (cached, new) in zip(tables, requests, strict=True):
        context = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        index = torch.tensor(context[:cached], dtype=torch.int64)
        flat_k[index] = randn(cached, num_kv_heads, head_dim)
        flat_v[index] = randn(cached, num_kv_heads, head_dim)
        slots += context[cached:]
        starts.append(starts[-1] + new)
    num_tokens = starts[-1]
    layout = BatchLayout(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(c + n for c, n in requests),
    )
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    q, k, v, k_cache, v_cache = (t.to(device) for t in (q, k, v, k_cache, v_cache))
    return PagedBatch(q, k, v, k_cache, v_cache, layout)


def large_paged_batch(requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int,
                dtype: torch.dtype, device: torch.device) -> PagedBatch:
    """A batch of ``requests`` (``(cached tokens, new tokens)`` pairs) built on ``device`` in a few
    tensor ops, for timing batches far too large for :func:`random_paged_batch`'s loops: every cache
    slot random, the blocks a random permutation of the pool."""
    seq_lens = torch.tensor([c + n for c, n in requests])
    new = torch.tensor([n for _, n in requests])
    blocks = (seq_lens + block_size - 1) // block_size
    num_blocks = int(blocks.sum()) + 1
    ids = torch.randperm(num_blocks - 1) + 1
    width = int(blocks.max())
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    offsets = torch.cumsum(blocks, 0) - blocks
    for i, (start, count) in enumerate(zip(offsets.tolist(), blocks.tolist(), strict=True)):
        table[i, :count] = ids[start:start + count]
    req = torch.repeat_interleave(torch.arange(len(requests)), new)
    first = torch.cumsum(new, 0) - new
    pos = (seq_lens - new)[req] + torch.arange(int(new.sum())) - first[req]
    slots = table[req, pos // block_size].long() * block_size + pos % block_size
    layout = BatchLayout(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(new, 0).int()]),
        seq_lens=seq_lens.int(), block_table=table, slot_mapping=slots,
        max_query_len=int(new.max()), max_seq_len=int(seq_lens.max()))
    shape, tokens = (num_blocks, block_size, kv_heads, dim), int(new.sum())
    randn = functools.partial(torch.randn, dtype=dtype, device=device)
    return PagedBatch(randn(tokens, heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim),
                      randn(shape), randn(shape), layout)


def run_backend(backend: AttentionBackend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output, k_cache, v_cache)`` after one forward of ``backend`` on copies of the caches
    (handed to it in its own layout, returned in the canonical one)."""
    k_cache, v_cache = backend.to_kv_cache_layout(batch.k_cache), backend.to_kv_cache_layout(batch.v_cache)
    metadata = backend.build_metadata(batch.layout, batch.q.device)
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, metadata)
    return out, backend.from_kv_cache_layout(k_cache), backend.from_kv_cache_layout(v_cache)


def sdpa_reference(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``sdpa`` backend's result, computed in fp32 and rounded once to the batch's dtype."""
    wide = batch.to(torch.float32)
    backend = SDPABackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    return tuple(t.to(batch.q.dtype) for t in run_backend(backend, wide))  # type: ignore[return-value]


def naive_reference(batch: PagedBatch, scale: float, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention output ``[T, num_heads, head_dim]`` computed one query token at a time in fp64 from
    the canonical caches with the step's K/V written in, by the definition in
    :class:`~cadence.backends.base.AttentionBackend`: no kernel, no shared code with any backend.
    Computed on the CPU (a GPU would launch a kernel per head and token), returned on ``batch``'s device."""
    layout, group = batch.layout, batch.num_heads // batch.num_kv_heads
    block_size = batch.k_cache.shape[1]
    k_cache, v_cache = (c.to("cpu", torch.float64, copy=True) for c in (batch.k_cache, batch.v_cache))
    flat_k = k_cache.view(-1, batch.num_kv_heads, batch.head_dim)
    flat_v = v_cache.view(-1, batch.num_kv_heads, batch.head_dim)
    written = layout.slot_mapping.cpu()  # the step's own K/V
    flat_k[written] = batch.k.double().cpu()
    flat_v[written] = batch.v.double().cpu()
    q = batch.q.double().cpu()
    out = torch.empty(q.shape, dtype=torch.float64)
    starts, seq_lens = layout.query_start_loc.tolist(), layout.seq_lens.tolist()
    for request, seq_len in enumerate(seq_lens):
        table = layout.block_table[request].tolist()
        for token in range(starts[request], starts[request + 1]):
            position = seq_len - (starts[request + 1] - token)
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            slots = [table[p // block_size] * block_size + p % block_size for p in range(first, position + 1)]
            keys, values = flat_k[slots], flat_v[slots]  # [S, Hkv, D]
            for head in range(batch.num_heads):
                scores = keys[:, head // group] @ q[token, head] * scale
                if logits_soft_cap is not None:
                    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
                out[token, head] = torch.softmax(scores, dim=0) @ values[:, head // group]
    return out.to(batch.q.device)


def output_and_definition(backend: AttentionBackend, batch: PagedBatch,
                          metadata: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``backend``'s output on ``batch`` (through ``metadata`` built by another layer's backend, if
    given) and the contract's definition of it (:func:`naive_reference` with the backend's scale,
    window and soft cap), in the output's dtype."""
    if metadata is None:
        out = run_backend(backend, batch)[0]
    else:
        out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), metadata)
    ref = naive_reference(batch, backend.scale, backend.sliding_window, backend.logits_soft_cap)
    return out, ref.to(out.dtype)
