"""Quantized weights in the layout of the CPU kernel (``backends/csrc/quant_linear.cpp``), and the
linear layer over them: the kernel where it runs, else a torch path that dequantizes per call.

Rows go in panels of 16 (one 32-bit lane per row). Per panel and block of input columns, one run of
bytes holds the 16 rows' float16 scales, their 16 minimums, then the codes: in steps of 4 columns,
64 bytes per step, bytes ``4j .. 4j+3`` the codes of row ``j`` (the operand layout of one VPDPBUSD).
4-bit codes pair step ``s`` (low nibble) with step ``s + block/8`` (high nibble). Panels go in
groups of 4 (64 rows, zero rows appended), whose runs interleave block by block: one decode row
reads a group as one sequential stream, which the prefetchers follow (four streams, one per panel,
ran at 60-75% of the speed; docs/quantization.md). A thread streams whole groups, each block's
bytes once per call (per 256 rows of activations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from cadence.backends.cpu_kernels import cpu_ops, runs_kernels
from cadence.quantization.blocks import BlockCodes

LANES = 16
_GROUP_PANELS = 4
_GROUP_ROWS = _GROUP_PANELS * LANES
_SCALE_BYTES = 4 * LANES  # 16 float16 scales, 16 float16 minimums


@dataclass(frozen=True)
class QuantizedMatrix:
    """A ``[rows, cols]`` weight packed for the kernel: ``packed`` uint8 ``[ceil(rows/64), blocks, 4, bytes]``
    (group, block, panel in the group)."""

    packed: torch.Tensor
    rows: int
    cols: int
    bits: int
    block: int

    @functools.cached_property
    def padded_cols(self) -> int:
        return self.packed.shape[1] * self.block


def pack(weight: BlockCodes, cols: int | None = None) -> QuantizedMatrix:
    """``weight`` in the kernel's layout; ``cols``: the logical input width where the codes pad it."""
    rows, width = weight.shape
    groups, blocks, steps = -(-rows // _GROUP_ROWS), width // weight.block, weight.block // 4
    panels, pad = groups * _GROUP_PANELS, groups * _GROUP_ROWS - rows

    def panel_major(t: torch.Tensor) -> torch.Tensor:  # [rows, ...] -> [panels, 16, ...], zero rows appended
        return F.pad(t, (0, 0, 0, pad)).view(panels, LANES, *t.shape[1:])

    scales = torch.stack([panel_major(weight.scale), panel_major(weight.minimum)], dim=2)  # [P, 16, 2, blocks]
    scale_bytes = scales.permute(0, 3, 2, 1).contiguous().view(torch.uint8).view(panels, blocks, _SCALE_BYTES)
    codes = panel_major(weight.codes).view(panels, LANES, blocks, steps, 4).permute(0, 2, 3, 1, 4)
    codes = codes.reshape(panels, blocks, steps, LANES * 4)
    if weight.bits == 4:
        codes = codes[:, :, :steps // 2] | (codes[:, :, steps // 2:] << 4)
    packed = torch.cat([scale_bytes, codes.reshape(panels, blocks, -1)], dim=2)
    packed = packed.view(groups, _GROUP_PANELS, blocks, -1).transpose(1, 2).contiguous()
    return QuantizedMatrix(packed, rows, width if cols is None else cols, weight.bits, weight.block)


def unpack_rows(matrix: QuantizedMatrix, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[T]``) of the weight, dequantized: ``[T, cols]`` (an embedding lookup)."""
    lane = rows % LANES
    picked = matrix.packed[rows // _GROUP_ROWS, :, rows // LANES % _GROUP_PANELS]  # [T, blocks, bytes]
    count, blocks = picked.shape[0], picked.shape[1]
    at = torch.arange(count, device=rows.device)
    scales = picked[..., :_SCALE_BYTES].contiguous().view(torch.float16).view(count, blocks, 2, LANES)
    scale, minimum = scales[at, :, 0, lane], scales[at, :, 1, lane]  # [T, blocks]
    codes = picked[..., _SCALE_BYTES:].reshape(count, blocks, -1, LANES, 4)[at, :, :, lane]  # [T, blocks, s, 4]
    if matrix.bits == 4:
        codes = torch.cat([codes & 0xF, codes >> 4], dim=2)
    values = codes.reshape(count, blocks, matrix.block).float() * scale.float().unsqueeze(-1)
    values += minimum.float().unsqueeze(-1)
    return values.reshape(count, -1)[:, :matrix.cols].to(dtype)


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight ``[rows, cols]`` as ``dtype``."""
    return unpack_rows(matrix, torch.arange(matrix.rows, device=matrix.packed.device), dtype)


@functools.cache
def _kernel() -> Any | None:
    """The kernel op where the CPU has AVX512-VNNI and the kernels built, else None."""
    ops = cpu_ops()
    return ops.quant_linear if ops is not None and ops.quant_linear_supported() else None


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether ``x @ W.T`` goes through the kernel: ``x`` of the CPU kernels' devices and dtypes, on a
    CPU with AVX512-VNNI."""
    return runs_kernels(x.device, x.dtype) and _kernel() is not None


def quantized_linear(x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., cols]``: the kernel (activations quantized to int8 per
    block, as llama.cpp does; docs/quantization.md), or the weight dequantized to ``x``'s dtype and
    ``F.linear``."""
    if not kernel_runs(x):
        return F.linear(x, dequantize(matrix, x.dtype), bias)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if matrix.padded_cols != matrix.cols:
        rows = F.pad(rows, (0, matrix.padded_cols - matrix.cols))
    out = cast(Any, _kernel())(rows, matrix.packed, bias, matrix.rows, matrix.bits, matrix.block)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], matrix.rows)
