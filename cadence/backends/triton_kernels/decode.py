"""Paged decode attention: one query token per request against its whole cached context.

One program per (request, KV head, context partition) serves every query head of the KV head's
group at once, so each K/V tile is read once per group (GQA), padded to 16 rows for ``tl.dot``.
Long contexts are split into partitions ("split-K", as in flash-decoding) so a small batch still
fills the GPU: each partition keeps an online softmax (running max, sum, weighted values) and a
second kernel merges the partitions by their log-sum-exp. With one partition the first kernel
writes the output itself.

With a sliding window (``WINDOW`` > 0) the query at position ``seq_len - 1`` sees only the last
``WINDOW`` keys, and the partitions tile that window instead of the whole context: nothing before
it is read, and the split count follows the window, not the context (:func:`num_decode_splits` of
``min(max_seq_len, window)``). ``SOFT_CAP`` > 0 caps the scaled scores with tanh (Gemma 2). Both are
compile-time constants: 0 compiles the kernel without them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.backends.triton_kernels.launch import check_rows, num_stages
from cadence.backends.triton_kernels.scores import soft_cap

# Context tokens per tile; a tile may span several cache blocks (gathered through the table).
BLOCK_N = 64
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    rows_ptr, seq_lens_ptr, block_table_ptr,
    scale, partition_tokens, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + request)
    row = tl.load(rows_ptr + request).to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # query head h reads KV head h // GROUP
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    start = split * partition_tokens
    if WINDOW > 0:  # partitions tile the window: every position from `start` on is visible
        start += tl.maximum(seq_len - WINDOW, 0)
    end = tl.minimum(start + partition_tokens, seq_len)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Every tile of the loop holds at least one valid position, so the running max is finite
    # after the first one and no exp(-inf - -inf) appears.
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_table_ptr + request * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFT_CAP > 0:
            s = soft_cap(s, SOFT_CAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty partition (context, or window, shorter than its start) leaves l_i = 0: output 0, weight 0.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        part = (request * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
    else:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, rows_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + request).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    part = (request * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # partition 0 is never empty, so the max is finite
    weight = weight / tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_decode_splits(max_seq_len: int, num_programs: int, target_programs: int,
                      partition_tokens: int | None = None, block_n: int = BLOCK_N) -> tuple[int, int]:
    """``(num_splits, partition_tokens)`` for a decode batch whose longest context is ``max_seq_len``.

    ``num_programs`` is the programs one partition per request gives (requests x KV heads); the
    context is split until about ``target_programs`` run (a few per SM), never into partitions
    shorter than one tile, nor into more than ``MAX_SPLITS``. ``partition_tokens`` forces the
    partition length instead (rounded up to whole tiles).
    """
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    if partition_tokens is None:
        wanted = triton.cdiv(target_programs, max(num_programs, 1))
        tiles_per_split = triton.cdiv(tiles, min(wanted, MAX_SPLITS))
    else:
        tiles_per_split = max(triton.cdiv(partition_tokens, block_n), triton.cdiv(tiles, MAX_SPLITS))
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_n


def paged_decode_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim]: rows `rows` are written
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B] int32: each decode's row in q/out
    seq_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    num_splits: int,
    partition_tokens: int,
    upcast: bool,
    block_n: int = BLOCK_N,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention of one query token per request over its paged context (already in the cache).

    ``num_splits`` and ``partition_tokens`` come from :func:`num_decode_splits` with the same
    ``block_n``, over ``min(max_seq_len, sliding_window)`` tokens; ``upcast`` converts K/V to fp32
    before the dots (fp32 caches, and the interpreter). ``sliding_window`` and ``logits_soft_cap``
    as in :class:`~cadence.backends.base.AttentionBackend`.
    """
    num_decodes = rows.shape[0]
    if num_decodes == 0:
        return
    check_rows(q, out, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_decodes, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused: the kernel writes `out` directly
        part_out = part_lse = out
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, rows, seq_lens, block_table,
        scale, partition_tokens, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, SPLIT=num_splits > 1, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
        WINDOW=sliding_window or 0, SOFT_CAP=logits_soft_cap or 0.0,
        num_stages=num_stages(k_cache),
    )
    if num_splits > 1:
        _merge_kernel[(num_decodes, num_heads)](
            out, part_out, part_lse, rows, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
