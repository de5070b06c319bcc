"""The one block form every quantized weight is decoded into, whatever its file format.

A ``[rows, cols]`` weight is cut along its input columns into blocks of ``block`` (16 or 32) values;
each value is ``scale * code + minimum`` with an unsigned integer code of ``bits`` (4, 5, 6 or 8) bits
and a float16 ``scale`` and ``minimum`` per (row, block). llama.cpp's symmetric formats fit it with
``minimum = -2**(bits-1) * scale`` (Q8_0: code = q + 128; Q4_0, Q5_0, Q6_K: the stored code, offset 8,
16, 32), which the packed layout then leaves out (:func:`symmetric`); its K-quants with their
sub-block scales multiplied out (rounded to float16 once, at load). One form means one kernel:
``x @ W.T`` becomes integer dot products of the codes with the activations quantized to int8, then
one multiply-add per block for the scale and one for the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (bits, block) pairs the kernel has layouts for: what the GGML formats decode to (Q6_K: 6 in 16), and
# int8 in either block.
FORMS = frozenset({(4, 32), (5, 32), (8, 32), (6, 16), (8, 16)})


@dataclass(frozen=True)
class BlockCodes:
    """``codes`` uint8 ``[rows, cols]``; ``scale`` and ``minimum`` float16 ``[rows, cols // block]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    block: int

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if (self.bits, self.block) not in FORMS or cols % self.block:
            raise ValueError(f"no block form for {self.bits}-bit codes in blocks of {self.block} over {cols} columns")
        if self.scale.shape != (rows, cols // self.block) or self.minimum.shape != self.scale.shape:
            raise ValueError(f"scales {tuple(self.scale.shape)} do not fit codes {tuple(self.codes.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``dtype`` (computed in float32, where every value is exact)."""
        rows, cols = self.shape
        values = self.codes.view(rows, -1, self.block).float() * self.scale.float().unsqueeze(-1)
        return (values + self.minimum.float().unsqueeze(-1)).view(rows, cols).to(dtype)

    def take(self, rows: slice | torch.Tensor, cols: slice) -> BlockCodes:
        """Those rows and that column range (whole blocks only: a tensor-parallel shard)."""
        start, stop, step = cols.indices(self.shape[1])
        if step != 1 or start % self.block or (stop - start) % self.block:
            raise ValueError(f"columns {start}:{stop} do not fall on the format's blocks of {self.block}")
        blocks = slice(start // self.block, stop // self.block)
        return BlockCodes(self.codes[rows][:, start:stop], self.scale[rows][:, blocks], self.minimum[rows][:, blocks],
                          self.bits, self.block)


def symmetric(codes: BlockCodes) -> bool:
    """Whether every minimum is ``-2**(bits-1) * scale`` (exact in float16: a power of two times it)."""
    offset = -(1 << (codes.bits - 1))
    return torch.equal(codes.minimum, (offset * codes.scale.float()).to(torch.float16))


def concat_rows(parts: list[BlockCodes]) -> BlockCodes:
    """Row blocks of one format stacked (a fused q/k/v or gate/up weight; parts in different formats
    stay apart: :func:`cadence.quantization.packed.pack_rows`).

    :raises ValueError: the parts' codes or blocks differ.
    """
    forms = {(p.bits, p.block) for p in parts}
    if len(forms) != 1:
        raise ValueError(f"cannot stack blocks of different forms {sorted(forms)} into one")
    bits, block = forms.pop()
    return BlockCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.minimum for p in parts]), bits, block)


def quantize_int8(weight: torch.Tensor, block: int = 32) -> BlockCodes:
    """Per output channel (row), symmetric int8: ``scale = max|w| / 127`` (float16), codes
    ``round(w / scale) + 128``; columns are padded with zeros to a whole block."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block))
    scale = (padded.abs().amax(dim=1) / 127).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), 1.0)
    codes = (torch.round(padded / safe.unsqueeze(1)).clamp(-127, 127) + 128).to(torch.uint8)
    blocks = padded.shape[1] // block
    scale = scale.unsqueeze(1).expand(rows, blocks).contiguous()
    return BlockCodes(codes, scale, (-128 * scale.float()).to(torch.float16), 8, block)
