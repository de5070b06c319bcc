"""Prepacked oneDNN weights for bf16 CPU models: the same numbers as F.linear, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cadence.distributed import even_split
from cadence.distributed.group import SINGLE_RANK
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, pack_weights

needs_bf16_onednn = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                       reason="this CPU has no oneDNN bf16 GEMM, so nothing is packed")


def _layers(dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    column = ColumnParallelLinear(24, [even_split(40, 0, 1), even_split(8, 0, 1)], True, dtype, "cpu")
    row = RowParallelLinear(even_split(48, 0, 1), 24, False, SINGLE_RANK, dtype, "cpu")
    vocab = VocabParallelEmbedding(37, 24, SINGLE_RANK, dtype, "cpu")
    for layer in (column, row, vocab):
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape))
    return nn.ModuleList([column, row, vocab])


@needs_bf16_onednn
def test_packed_layers_give_f_linear_bit_for_bit() -> None:
    column, row, vocab = _layers(torch.bfloat16)
    x, wide = torch.randn(5, 24, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    ids = torch.tensor([3, 36])
    expected = (F.linear(x, column.weight, column.bias), F.linear(wide, row.weight), F.linear(x, vocab.weight),
                F.embedding(ids, vocab.weight))
    pack_weights(nn.ModuleList([column, row, vocab]))
    assert column.weight.is_mkldnn and row.weight.is_mkldnn and vocab.packed_lm_head is not None
    assert not vocab.weight.is_mkldnn  # the lookup table stays plain
    got = (column(x), row(wide), vocab.logits(x), vocab(ids))
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_float32_models_stay_on_f_linear() -> None:
    layers = _layers(torch.float32)
    pack_weights(layers)
    column, row, vocab = layers
    assert not column.weight.is_mkldnn and not row.weight.is_mkldnn and vocab.packed_lm_head is None
