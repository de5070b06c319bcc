"""Paged prefill ("extend") attention: several new query tokens per request, causal, over the
request's cached prefix plus the new tokens, all read from the paged cache (written just before).

One program per (request, query head, tile of ``BLOCK_M`` queries); it walks the context in tiles
of ``BLOCK_N`` keys up to its last query's position, with an online softmax. Query ``i`` of a
request with ``q_len`` new tokens and ``seq_len`` in all sits at position ``seq_len - q_len + i``
and sees the keys at positions up to its own.

With a sliding window (``WINDOW`` > 0) it sees only the last ``WINDOW`` of them, and a program's
walk starts at its first query's window: keys before it are seen by none of its queries and are
not read. ``SOFT_CAP`` > 0 caps the scaled scores with tanh (Gemma 2). Both are compile-time
constants: 0 compiles the kernel without them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.backends.triton_kernels.launch import check_rows, num_stages
from cadence.backends.triton_kernels.scores import soft_cap

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_ptr, query_lens_ptr, seq_lens_ptr, block_table_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + request)
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    q_start = tl.load(query_start_ptr + request).to(tl.int64)
    kv_head = head // GROUP

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = seq_len - q_len + m  # rows past q_len sit past the context: they see key 0, never stored

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)  # past this tile's last query
    lo = 0
    if WINDOW > 0:  # the first query's window reaches back furthest
        lo = tl.maximum(seq_len - q_len + m_block * BLOCK_M - WINDOW + 1, 0)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < seq_len
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
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        # Without a window the running max is finite from the first tile (key 0 is seen by all).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if WINDOW > 0:  # rows that have seen no key yet (padding rows; with BLOCK_M > BLOCK_N, rows whose
            # window starts in a later tile) would take exp(-inf - -inf)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if WINDOW > 0:  # padding rows (past q_len) may see no key at all: keep 0 / 0 out
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim]: the requests' rows are written
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start: torch.Tensor,  # [P] int32: each request's first row in q/out
    query_lens: torch.Tensor,  # [P] int32
    seq_lens: torch.Tensor,  # [P] int32
    block_table: torch.Tensor,  # [P, max_blocks] int32
    max_query_len: int,
    scale: float,
    upcast: bool,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Causal attention of each request's new tokens over its paged context (already in the cache).

    ``upcast`` converts Q/K/V to fp32 before the dots (fp32 caches, and the interpreter).
    ``sliding_window`` and ``logits_soft_cap`` as in :class:`~cadence.backends.base.AttentionBackend`.
    """
    num_requests = query_lens.shape[0]
    if num_requests == 0:
        return
    check_rows(q, out, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = (num_requests, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start, query_lens, seq_lens, block_table,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
        WINDOW=sliding_window or 0, SOFT_CAP=logits_soft_cap or 0.0,
        num_stages=num_stages(k_cache),
    )
