"""llama.cpp's GGML block formats, decoded from a tensor's raw bytes into :class:`BlockCodes`.

Each format stores a row as whole blocks of ``type_size`` bytes (``gguf.GGML_QUANT_SIZES``); the
decoders below read them as ggml's ``dequantize_row_*`` does (``ggml-quants.c``), checked value by
value against the ``gguf`` package's own dequantizer in ``tests/quantization/``. Types without a
decoder here (Q2_K, Q3_K, the IQ types ...) are read dequantized, through transformers, with a
warning (:mod:`cadence.models.gguf_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from cadence.quantization.blocks import BlockCodes

Q = GGMLQuantizationType
SUPER = 256  # the K-quants' super-block


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block of ``raw`` ``[rows, blocks, bytes]``."""
    return raw[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: the low nibbles, then the high ones (ggml's order)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Bit ``j`` of the little-endian integer in the bytes ``packed`` ``[..., count // 8]``, for ``j < count``."""
    j = torch.arange(count)
    return (packed[..., j // 8] >> (j % 8).to(torch.uint8)) & 1


def _codes(rows: int, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
           block: int) -> BlockCodes:
    return BlockCodes(codes.reshape(rows, -1).contiguous(), scale.reshape(rows, -1).to(torch.float16).contiguous(),
                      minimum.reshape(rows, -1).to(torch.float16).contiguous(), bits, block)


def _q8_0(raw: torch.Tensor) -> BlockCodes:
    d = _f16(raw, 0)
    codes = (raw[..., 2:34].view(torch.int8).int() + 128).to(torch.uint8)
    return _codes(raw.shape[0], codes, d, -128 * d.float(), 8, 32)


def _q4_0(raw: torch.Tensor) -> BlockCodes:
    d = _f16(raw, 0)
    return _codes(raw.shape[0], _nibbles(raw[..., 2:18]), d, -8 * d.float(), 4, 32)


def _q4_1(raw: torch.Tensor) -> BlockCodes:
    return _codes(raw.shape[0], _nibbles(raw[..., 4:20]), _f16(raw, 0), _f16(raw, 2), 4, 32)


def _q5_0(raw: torch.Tensor) -> BlockCodes:
    d = _f16(raw, 0)
    codes = _nibbles(raw[..., 6:22]) | (_bits(raw[..., 2:6], 32) << 4)
    return _codes(raw.shape[0], codes, d, -16 * d.float(), 5, 32)


def _q5_1(raw: torch.Tensor) -> BlockCodes:
    codes = _nibbles(raw[..., 8:24]) | (_bits(raw[..., 4:8], 32) << 4)
    return _codes(raw.shape[0], codes, _f16(raw, 0), _f16(raw, 2), 5, 32)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit sub-block scales and minimums, from the 12 bytes at 4
    (ggml's ``get_scale_min_k4``)."""
    s = raw[..., 4:16]
    scales = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_sub_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-32 scale and minimum of a Q4_K or Q5_K super-block, multiplied out: ``[..., 8]``."""
    scales, mins = _k_scales(raw)
    return _f16(raw, 0).float().unsqueeze(-1) * scales, -_f16(raw, 2).float().unsqueeze(-1) * mins


def _chunks(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 code bytes as 4 chunks of 32, each the low nibbles of one sub-block then the
    high nibbles of the next: ``[..., 256]`` in value order."""
    chunked = qs.unflatten(-1, (4, 32))
    return torch.stack([chunked & 0xF, chunked >> 4], dim=-2).flatten(-3)


def _q4_k(raw: torch.Tensor) -> BlockCodes:
    scale, minimum = _k_sub_blocks(raw)
    return _codes(raw.shape[0], _chunks(raw[..., 16:144]), scale, minimum, 4, 32)


def _q5_k(raw: torch.Tensor) -> BlockCodes:
    scale, minimum = _k_sub_blocks(raw)
    qh = raw[..., 16:48]  # bit 2c (low nibbles) and 2c+1 (high) of byte l: value l of chunk c's two sub-blocks
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh.unsqueeze(-2) >> shifts.view(8, 1)) & 1).flatten(-2)  # [..., 8 sub-blocks * 32]
    return _codes(raw.shape[0], _chunks(raw[..., 48:176]) | (high << 4), scale, minimum, 5, 32)


def _q6_k(raw: torch.Tensor) -> BlockCodes:
    ql, qh = raw[..., 0:128].unflatten(-1, (2, 64)), raw[..., 128:192].unflatten(-1, (2, 32))
    low = torch.cat([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    codes = (low | (high << 4)).flatten(-2)  # [..., 256]: each half's four quarters of 32
    # One scale per 16 values, rounded to float16 once; the offset of 32 then multiplies it exactly.
    scale = (_f16(raw, 208).float().unsqueeze(-1) * raw[..., 192:208].view(torch.int8).float()).to(torch.float16)
    return _codes(raw.shape[0], codes, scale, -32 * scale.float(), 6, 16)


DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], BlockCodes]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
# Read as plain floats, as before: their weights are no smaller quantized.
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


def decode(raw: torch.Tensor, ggml_type: GGMLQuantizationType, cols: int) -> BlockCodes:
    """Decode ``raw`` uint8 ``[rows, bytes per row]`` of a ``[rows, cols]`` tensor of ``ggml_type``.

    :raises ValueError: no decoder for the type, or rows that are not whole blocks.
    """
    if ggml_type not in DECODERS:
        raise ValueError(f"no decoder for GGML type {ggml_type.name}")
    block, size = GGML_QUANT_SIZES[ggml_type]
    if cols % block or raw.shape[1] != cols // block * size:
        raise ValueError(f"a row of {cols} {ggml_type.name} values is not {raw.shape[1]} bytes of whole blocks")
    return DECODERS[ggml_type](raw.reshape(raw.shape[0], cols // block, size))
