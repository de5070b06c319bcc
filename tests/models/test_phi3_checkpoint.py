"""Phi-3's fused checkpoint projections are cut into Llama's parts as lazy row ranges: a
tensor-parallel rank reads only its rows of q, of k and of v, never the whole fused tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.tiny_models import tiny_config

from cadence.distributed.layers import QuantizedCheckpointTensor
from cadence.models.phi3 import RowRange, fused_parts, split_fused
from cadence.quantization.blocks import BlockCodes, quantize_int8


class RecordingTensor:
    """A checkpoint tensor that records which rows were read."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.reads: list[Any] = []

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.reads.append(index)
        return self.data[index]


def test_fused_projections_split_into_parts_that_read_only_their_rows() -> None:
    config = tiny_config("phi3")  # 4 heads of 16, 2 KV heads: q 64 rows, k 32, v 32
    fused = RecordingTensor(torch.arange(128 * 3, dtype=torch.float32).view(128, 3))
    norm = torch.ones(64)
    parts = dict(split_fused([("model.layers.0.self_attn.qkv_proj.weight", fused),
                              ("model.layers.0.input_layernorm.weight", norm)], fused_parts(config)))
    assert list(parts) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight", "model.layers.0.input_layernorm.weight"]
    assert parts["model.layers.0.input_layernorm.weight"] is norm
    k = parts["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k, RowRange) and k.shape == (32, 3) and not fused.reads
    torch.testing.assert_close(k[16:32], fused.data[80:96])  # rank 1's half of k
    torch.testing.assert_close(k[4:6, 1:], fused.data[68:70, 1:])
    assert fused.reads == [slice(80, 96), (slice(68, 70), slice(1, None))]


def test_a_fused_tensor_of_the_wrong_size_names_its_parts() -> None:
    config = tiny_config("phi3")
    wrong = torch.zeros(100, 64)
    with pytest.raises(ValueError, match=r"gate_up_proj.weight: .* gate_proj 128 \+ up_proj 128 = 256"):
        list(split_fused([("model.layers.0.mlp.gate_up_proj.weight", wrong)], fused_parts(config)))


def test_a_row_range_is_read_by_contiguous_row_slices_only() -> None:
    rows = RowRange(torch.zeros(10, 2), 2, 4)
    with pytest.raises(TypeError):
        rows[1]
    with pytest.raises(TypeError):
        rows[::2]


class QuantizedRecording(RecordingTensor):
    """A quantized checkpoint tensor (a GGUF file's ``attn_qkv``): its blocks by rows and columns."""

    def __init__(self, codes: BlockCodes) -> None:
        super().__init__(codes.dequantize())
        self.codes = codes

    def block_codes(self, rows: slice, cols: slice) -> BlockCodes:
        return self.codes.take(rows, cols)


def test_a_quantized_fused_projection_splits_into_parts_that_keep_their_blocks() -> None:
    config = tiny_config("phi3")
    codes = quantize_int8(torch.randn(128, 64))
    parts = dict(split_fused([("model.layers.0.self_attn.qkv_proj.weight", QuantizedRecording(codes))],
                             fused_parts(config)))
    v = parts["model.layers.0.self_attn.v_proj.weight"]
    assert isinstance(v, QuantizedCheckpointTensor) and v.shape == (32, 64)
    assert torch.equal(v.block_codes(slice(16, 32), slice(32, 64)).dequantize(), codes.dequantize()[112:128, 32:64])
    plain = dict(split_fused([("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(256, 64))], fused_parts(config)))
    assert not isinstance(plain["model.layers.0.mlp.up_proj.weight"], QuantizedCheckpointTensor)
