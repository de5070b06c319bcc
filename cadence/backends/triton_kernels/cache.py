"""Reshape-and-cache: each new token's K and V rows into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.backends.triton_kernels.launch import check_rows


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (slot -1) owns no cache slot
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    # A copy: no arithmetic, so even the interpreter's raw-integer bf16 moves through unchanged.
    key = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    value = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]`` (``-1``: skip)
    into the caches ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_rows(k, v, k_cache, v_cache)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )

