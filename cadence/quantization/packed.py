"""Quantized weights in the layout of the CPU kernels (``backends/csrc/quant_linear.cpp`` with
AVX512-VNNI, ``quant_linear_avx2.cpp`` with AVX2: the same values bit for bit), and the linear layer
over them: a kernel where one runs, else a float GEMM over the weight dequantized once, on first use,
and kept (memory traded for speed: dequantizing on every call ran the default model 24x slower
without a kernel, docs/quantization.md).

Rows go in panels of 16 (one 32-bit lane per row). Per panel and block of input columns, one run of
bytes holds the 16 rows' float16 scales, their 16 minimums (left out where the block form is
symmetric: the kernel derives them), then the codes: in steps of 4 columns, 64 bytes per step, bytes
``4j .. 4j+3`` the codes of row ``j`` (the operand layout of one VPDPBUSD). Codes narrower than 8
bits go in a nibble plane, step ``s`` in the low nibbles of the vector it shares with step
``s + block/8`` in the high ones, then (5 and 6 bits) a plane of the high bits, one vector per 8
steps (bit ``s % 8`` of each byte: step ``s``'s fifth bit) or per 4 (bits ``2(s % 4)`` and the next:
its fifth and sixth). So each format keeps about its file's size (docs/quantization.md).

Panels go in groups of 4 (64 rows, zero rows appended), whose runs interleave block by block: one
decode row reads a group as one sequential stream, which the prefetchers follow (four streams, one
per panel, ran at 60-75% of the speed). A thread streams whole groups, each block's bytes once per
call (per 256 rows of activations).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from cadence.backends import dense_gemm, onednn
from cadence.backends.cpu_kernels import KERNEL_DTYPES, avx2_ops, cpu_ops, runs_kernels
from cadence.quantization.blocks import BlockCodes, concat_rows, symmetric

logger = logging.getLogger(__name__)

LANES = 16
_GROUP_PANELS = 4
_GROUP_ROWS = _GROUP_PANELS * LANES
_HALF_BYTES = 2 * LANES  # 16 float16 scales; as many minimums


@dataclass(frozen=True)
class QuantizedMatrix:
    """A ``[rows, cols]`` weight packed for the kernel: ``packed`` uint8 ``[ceil(rows/64), blocks, 4, bytes]``
    (group, block, panel in the group); ``symmetric``: no minimums stored (each is ``-2**(bits-1)``
    times its scale)."""

    packed: torch.Tensor
    rows: int
    cols: int
    bits: int
    block: int
    symmetric: bool

    @functools.cached_property
    def padded_cols(self) -> int:
        return self.packed.shape[1] * self.block

    def to(self, device: torch.device) -> QuantizedMatrix:
        return replace(self, packed=self.packed.to(device))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized to ``dtype`` (in oneDNN's layout where that GEMM runs it:
        ``backends/onednn.py``, else as ``backends/dense_gemm.py`` packs it), computed on the first
        call and kept for the later ones."""
        kept: dict[torch.dtype, torch.Tensor] = self.__dict__.setdefault("_dense", {})  # frozen: no setattr
        if dtype not in kept:
            device = self.packed.device
            _say_dequantized_once(device, dtype, kernel_available())
            weight = dequantize(self, dtype)
            # oneDNN first where it packs the dtype: the row limits below were measured against it
            kept[dtype] = onednn.pack(weight) if onednn.packs(dtype, device) else dense_gemm.prepacked(weight)
        return kept[dtype]


@functools.cache
def _say_dequantized_once(device: torch.device, dtype: torch.dtype, kernel: bool) -> None:
    why = (f"{dtype} batches past the quantized kernel's row limit run faster through a float GEMM" if kernel
           else f"no quantized-weight kernel for {dtype} activations on {device} (it needs an x86 CPU with AVX2)")
    logger.warning("%s: the quantized weights are dequantized once, on first use, and kept beside their blocks; "
                   "--quantization none loads them dequantized only", why)


@dataclass(frozen=True)
class QuantizedRowStack:
    """A fused weight (q/k/v, gate/up) whose parts came in different formats, kept as matrices of
    their own stacked along the output rows: each part at its file's size, where one matrix would
    take the widest codes and shortest blocks of all (a Q4_K_M file's Q4_K q/k and Q6_K v: 8 bits
    per weight for all three). One kernel call per matrix."""

    parts: tuple[QuantizedMatrix, ...]

    @functools.cached_property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def to(self, device: torch.device) -> QuantizedRowStack:
        return QuantizedRowStack(tuple(part.to(device) for part in self.parts))


def pack_rows(parts: list[BlockCodes]) -> QuantizedMatrix | QuantizedRowStack:
    """Row blocks stacked (a fused weight): one matrix where their formats match, else one per run
    of parts in the same format."""
    matrices = tuple(pack(concat_rows(list(run)), bare=form[2]) for form, run in itertools.groupby(parts, key=_form))
    return matrices[0] if len(matrices) == 1 else QuantizedRowStack(matrices)


def _form(codes: BlockCodes) -> tuple[int, int, bool]:
    return codes.bits, codes.block, symmetric(codes)


def _steps_per_high_vector(bits: int) -> int:
    return 8 if bits == 5 else 4


def pack(weight: BlockCodes, cols: int | None = None, *, bare: bool | None = None) -> QuantizedMatrix:
    """``weight`` in the kernel's layout; ``cols``: the logical input width where the codes pad it;
    ``bare``: whether the format is symmetric, when the caller already knows (else found here)."""
    rows, width = weight.shape
    groups, blocks, steps = -(-rows // _GROUP_ROWS), width // weight.block, weight.block // 4
    panels, pad = groups * _GROUP_PANELS, groups * _GROUP_ROWS - rows
    if bare is None:
        bare = symmetric(weight)

    def panel_major(t: torch.Tensor) -> torch.Tensor:  # [rows, ...] -> [panels, 16, ...], zero rows appended
        return F.pad(t, (0, 0, 0, pad)).view(panels, LANES, *t.shape[1:])

    halves = [weight.scale] if bare else [weight.scale, weight.minimum]
    scales = torch.stack([panel_major(h) for h in halves], dim=2)  # [P, 16, 1 or 2, blocks]
    scale_bytes = scales.permute(0, 3, 2, 1).contiguous().view(torch.uint8).view(panels, blocks, -1)
    codes = panel_major(weight.codes).view(panels, LANES, blocks, steps, 4).permute(0, 2, 3, 1, 4)
    codes = codes.reshape(panels, blocks, steps, LANES * 4)
    planes = [codes]
    if weight.bits < 8:
        low = codes & 0xF
        planes = [low[:, :, :steps // 2] | (low[:, :, steps // 2:] << 4)]
    if 4 < weight.bits < 8:
        per, high_bits = _steps_per_high_vector(weight.bits), weight.bits - 4
        high = (codes >> 4).view(panels, blocks, steps // per, per, LANES * 4)
        plane = torch.zeros_like(high[:, :, :, 0])
        for j in range(per):
            plane |= high[:, :, :, j] << (j * high_bits)
        planes.append(plane)
    packed = torch.cat([scale_bytes] + [p.reshape(panels, blocks, -1) for p in planes], dim=2)
    packed = packed.view(groups, _GROUP_PANELS, blocks, -1).transpose(1, 2).contiguous()
    return QuantizedMatrix(packed, rows, width if cols is None else cols, weight.bits, weight.block, bare)


def lookup_rows(matrix: QuantizedMatrix, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unpack_rows` (an embedding lookup), by the C++ kernel ``quant_rows`` where the kernels
    run: the same values, without the dozen torch ops per call (0.37 ms of a one-token step)."""
    if runs_kernels(rows.device, dtype):
        return cast(Any, cpu_ops()).quant_rows(matrix.packed, rows, matrix.cols, matrix.bits, matrix.block,
                                               matrix.symmetric, dtype)
    return unpack_rows(matrix, rows, dtype)


def unpack_rows(matrix: QuantizedMatrix, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[T]``) of the weight, dequantized: ``[T, cols]`` (an embedding lookup)."""
    lane = rows % LANES
    picked = matrix.packed[rows // _GROUP_ROWS, :, rows // LANES % _GROUP_PANELS]  # [T, blocks, bytes]
    count, blocks, steps = picked.shape[0], picked.shape[1], matrix.block // 4
    at = torch.arange(count, device=rows.device)

    def lanes(part: torch.Tensor) -> torch.Tensor:  # [T, blocks, n * 64] -> row's [T, blocks, n, 4]
        return part.reshape(count, blocks, -1, LANES, 4)[at, :, :, lane]

    header = _HALF_BYTES if matrix.symmetric else 2 * _HALF_BYTES
    scales = picked[..., :header].contiguous().view(torch.float16).view(count, blocks, -1, LANES)
    scale = scales[at, :, 0, lane].float()  # [T, blocks]
    minimum = -(1 << (matrix.bits - 1)) * scale if matrix.symmetric else scales[at, :, 1, lane].float()
    codes = _codes(picked[..., header:], matrix.bits, steps, lanes)  # [T, blocks, steps, 4]
    values = codes.reshape(count, blocks, matrix.block).float() * scale.unsqueeze(-1) + minimum.unsqueeze(-1)
    return values.reshape(count, -1)[:, :matrix.cols].to(dtype)


def _codes(body: torch.Tensor, bits: int, steps: int, split: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The codes of :func:`pack`'s planes ``body`` (``[..., bytes]`` of one panel and block): ``[..., steps, W]``,
    where ``split`` turns a plane ``[..., n * 64]`` into its ``[..., n, W]`` (W: the bytes of a step kept:
    all 64, or one row's 4)."""
    if bits == 8:
        return split(body)
    nibbles = split(body[..., :steps * 32])
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-2)
    if bits > 4:
        per, high_bits = _steps_per_high_vector(bits), bits - 4
        high = split(body[..., steps * 32:]).repeat_interleave(per, dim=-2)  # each step's vector
        shifts = (torch.arange(steps, device=body.device) % per * high_bits).to(torch.uint8).view(steps, 1)
        codes = codes | (((high >> shifts) & ((1 << high_bits) - 1)) << 4)
    return codes


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight ``[rows, cols]`` as ``dtype``: :func:`pack` undone by reshapes (the same values
    as :func:`unpack_rows` of every row, 4-5x faster than its gathers: 1.6 s -> 0.37 s over the default model)."""
    groups, blocks = matrix.packed.shape[:2]
    panels, steps = groups * _GROUP_PANELS, matrix.block // 4
    runs = matrix.packed.transpose(1, 2).reshape(panels, blocks, -1)  # [panel, block, its bytes]
    header = _HALF_BYTES if matrix.symmetric else 2 * _HALF_BYTES
    scales = runs[..., :header].contiguous().view(torch.float16).view(panels, blocks, -1, LANES)
    scale = scales[:, :, 0].float()  # [panel, block, lane]
    minimum = -(1 << (matrix.bits - 1)) * scale if matrix.symmetric else scales[:, :, 1].float()
    codes = _codes(runs[..., header:], matrix.bits, steps, lambda part: part.reshape(panels, blocks, -1, LANES * 4))
    # [panel, block, step, lane, 4] -> [panel, lane, block, step * 4]: a row's block of codes
    codes = codes.view(panels, blocks, steps, LANES, 4).permute(0, 3, 1, 2, 4).reshape(panels, LANES, blocks, -1)
    values = codes.float() * scale.transpose(1, 2).unsqueeze(-1) + minimum.transpose(1, 2).unsqueeze(-1)
    return values.reshape(panels * LANES, -1)[:matrix.rows, :matrix.cols].to(dtype)


@functools.cache
def vnni_available() -> bool:
    """Whether the AVX512-VNNI kernel runs here (else ``csrc/decoder_stack.cpp`` calls the AVX2 one)."""
    ops = cpu_ops()
    return ops is not None and bool(ops.quant_linear_supported())


@functools.cache
def _kernel() -> Any | None:
    """The kernel op: AVX512-VNNI's where the CPU has it and the kernels built, else AVX2's where
    that built, else None."""
    if vnni_available():
        return cast(Any, cpu_ops()).quant_linear
    avx2 = avx2_ops()
    return None if avx2 is None else avx2.quant_linear


# Up to this many rows of float32 activations the AVX2 kernel runs, by code width, beyond them the GEMM
# over the dense weights (oneDNN's, backends/onednn.py). Per row the kernel pays two VPMADDUBSWs per
# 32 multiply-adds (the activations' two int8 parts), 8-bit codes twice that (two nibbles), where the
# float GEMM's cost grows more slowly. SmolLM2's 30 Q4_1 layers and its Q8_0 LM head, float32
# (docs/quantization.md): on the 2-core Zen 3 both together took 39-41 ms at 16 rows through the
# kernel against 42-44 dense; on the 2-core Zen 1 the layers 153-161 against 144-151 at 16 rows and
# 214 against 151 at 32, the head 7-9 against 9-10 at 2 rows, 12-17 against 12 at 4, 93 against 33
# at 32.
_AVX2_KERNEL_ROWS = 16
_AVX2_KERNEL_ROWS_8_BIT = 2
# On CPUs with AMX oneDNN runs bfloat16 GEMMs on the tile unit, and past these rows a bfloat16 dense
# weight beats either kernel. On the 2-core Sapphire Rapids-class VM (2026-12-05, `python
# benchmarks/quant_row_limit.py --dtype bfloat16`) SmolLM2's 30 Q4_1 layers took 13.0 ms through the
# VNNI kernel against 13.8 dense at 16 rows, 16.9 against 15.5 at 24, 36.7 against 17.5 at 64; its
# Q8_0 LM head 1.3 against 1.4 at 8 rows, 1.8 against 1.4 at 12.
_AMX_KERNEL_ROWS = 16
_AMX_KERNEL_ROWS_8_BIT = 8
# On CPUs with AVX2 alone bfloat16 batches past these rows run faster through the AVX2 bf16 GEMM over
# the dense bf16 weights (backends/dense_gemm.py). On the 2-core Zen 3 (2026-12-06, `python
# benchmarks/quant_row_limit.py --dtype bfloat16`) the 30 Q4_1 layers took 47.2 ms through the kernel
# against 47.3 dense at 12 rows, 86.0 against 62.2 at 24; the Q8_0 LM head 2.6 against 3.0 at 2 rows,
# 6.3 against 4.7 at 4.
_AVX2_BF16_KERNEL_ROWS = 12
_AVX2_BF16_KERNEL_ROWS_8_BIT = 2


def _row_limits(dtype: torch.dtype) -> tuple[int, int] | None:
    """The most rows of ``dtype`` a kernel here takes, by code width (4-bit, 8-bit); None for every batch."""
    if dtype == torch.bfloat16 and _amx_gemm():
        return _AMX_KERNEL_ROWS, _AMX_KERNEL_ROWS_8_BIT
    if vnni_available():
        return None
    if dtype == torch.bfloat16:
        avx2_gemm = dense_gemm.avx2_ops_with_bf16() is not None and not onednn.packs(dtype, torch.device("cpu"))
        return (_AVX2_BF16_KERNEL_ROWS, _AVX2_BF16_KERNEL_ROWS_8_BIT) if avx2_gemm else None
    return (_AVX2_KERNEL_ROWS, _AVX2_KERNEL_ROWS_8_BIT) if dtype == torch.float32 else None


@functools.cache
def _amx_gemm() -> bool:
    """Whether oneDNN's bfloat16 GEMM over a dense weight runs on AMX tiles here."""
    return torch.cpu._is_amx_tile_supported() and onednn.packs(torch.bfloat16, torch.device("cpu"))


def kernel_takes_every_batch(dtype: torch.dtype) -> bool:
    """Whether a kernel here takes every batch of ``dtype``: the VNNI one, but not bfloat16 beside AMX;
    the AVX2 one for bfloat16, likewise."""
    return kernel_available() and _row_limits(dtype) is None


def kernel_row_limit(matrix: QuantizedMatrix | QuantizedRowStack, dtype: torch.dtype) -> int | None:
    """The most rows of ``dtype`` the kernel takes in one call to ``matrix`` (a stack's parts all
    go one way, the C++ decoder stack's Linear as :func:`quantized_linear`), more going to the dense
    weights; None where it takes every batch."""
    if kernel_takes_every_batch(dtype):
        return None
    four_bit, eight_bit = _row_limits(dtype) or (_AVX2_KERNEL_ROWS, _AVX2_KERNEL_ROWS_8_BIT)
    parts = matrix.parts if isinstance(matrix, QuantizedRowStack) else (matrix,)
    return min(eight_bit if part.bits == 8 else four_bit for part in parts)


def model_row_limit(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int | None:
    """The row limit (:func:`kernel_row_limit`) of most of ``model``'s quantized weights, counted by
    their elements: the one a step's linear layers follow (an 8-bit LM head's lower limit covers a
    sliver of the model). None where the kernel takes every batch, or none runs (another device or
    dtype, no kernel built), or nothing is quantized. The cost model prices rows under it apart
    (``core/cost_model.py``, ``kernel_rows``)."""
    if not kernel_runs_on(device, dtype):
        return None
    elements: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedMatrix | QuantizedRowStack):
            limit = kernel_row_limit(weight, dtype)
            if limit is not None:
                parts = weight.parts if isinstance(weight, QuantizedRowStack) else (weight,)
                elements[limit] = elements.get(limit, 0) + sum(p.rows * p.cols for p in parts)
    return max(elements, key=elements.__getitem__, default=None)


def kernel_available() -> bool:
    """Whether a kernel runs here (an x86 CPU with AVX2, the kernel built)."""
    return _kernel() is not None


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether ``x @ W.T`` goes through a kernel: ``x`` float32 or bfloat16 on the CPU, a kernel here."""
    return kernel_runs_on(x.device, x.dtype)


def kernel_runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`kernel_runs` of activations of ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and kernel_available()


def quantized_linear(x: torch.Tensor, matrix: QuantizedMatrix | QuantizedRowStack,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., cols]``: :func:`kernel_linear` where the kernel takes the
    batch, else :func:`dense_linear` (a stack's parts all go the same way)."""
    linear = kernel_linear if _kernel_takes(math.prod(x.shape[:-1]), matrix, x) else dense_linear
    if isinstance(matrix, QuantizedRowStack):
        biases = [None] * len(matrix.parts) if bias is None else bias.split([p.rows for p in matrix.parts])
        return torch.cat([linear(x, part, b) for part, b in zip(matrix.parts, biases, strict=True)], dim=-1)
    return linear(x, matrix, bias)


def _kernel_takes(num_rows: int, matrix: QuantizedMatrix | QuantizedRowStack, x: torch.Tensor) -> bool:
    """Whether the kernel, rather than the dense GEMM, takes ``num_rows`` rows of ``x`` for ``matrix``."""
    if not kernel_runs(x):
        return False
    # under every limit (one user's decode)
    if num_rows <= min(_AVX2_KERNEL_ROWS, _AVX2_KERNEL_ROWS_8_BIT, _AVX2_BF16_KERNEL_ROWS, _AVX2_BF16_KERNEL_ROWS_8_BIT,
                       _AMX_KERNEL_ROWS, _AMX_KERNEL_ROWS_8_BIT):
        return True
    limit = kernel_row_limit(matrix, x.dtype)
    return limit is None or num_rows <= limit


def kernel_linear(x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` through the kernel: activations quantized to int8 per block, as llama.cpp
    does (docs/quantization.md)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if matrix.padded_cols != matrix.cols:
        rows = F.pad(rows, (0, matrix.padded_cols - matrix.cols))
    out = cast(Any, _kernel())(rows, matrix.packed, bias, matrix.rows, matrix.bits, matrix.block, matrix.symmetric)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], matrix.rows)


def dense_linear(x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` by a float GEMM over the weight dequantized to ``x``'s dtype, once
    (:meth:`QuantizedMatrix.dense`), as ``backends/dense_gemm.py`` runs its layout."""
    return dense_gemm.linear(x, matrix.dense(x.dtype), bias, matrix.rows)
