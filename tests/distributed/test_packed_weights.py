"""Prepacked GEMM weights for CPU models: cadence's bf16 GEMM (``csrc/bf16_linear.cpp``): its
VDPBF16PS path exact to the instruction's arithmetic, its AMX path within the output's rounding of
the exact product and batch-invariant; oneDNN's packed layout where it is missing (bf16: bit for
bit F.linear) and for float32 on x86; and the bf16 GEMM of CPUs with AVX2 alone
(``csrc/bf16_linear_avx2.cpp``), exactly a chain of float32 FMAs whatever the batch, which
``backends/dense_gemm.py`` packs bf16 weights for where neither of the others runs."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cadence.backends import dense_gemm, onednn
from cadence.backends.cpu_kernels import cpu_ops
from cadence.distributed import even_split
from cadence.distributed.group import SINGLE_RANK
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, pack_weights

needs_bf16_onednn = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                       reason="this CPU has no oneDNN bf16 GEMM, so nothing is packed")
needs_bf16_gemm = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().bf16_linear_supported(),
                                     reason="this CPU has no AVX512-BF16")
needs_avx2_gemm = pytest.mark.skipif(dense_gemm.avx2_ops_with_bf16() is None, reason="the CPU lacks AVX2 and FMA")


def _dot_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` as VDPBF16PS computes it: per output, an fp32 sum that adds the exact
    product of features 2p+1 then of 2p for each pair p in turn; the bias last; one rounding to bf16."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    return (acc if bias is None else acc + bias.float()).bfloat16()


_ROWS = [1, 7, 8, 9, 15, 16, 17, 64, 67, 300]  # tiles of 8 and 16 rows and their tails; blocks of 256 rows
# AMX takes input widths in steps of 32 (64, 576, 96); the rest go by VDPBF16PS on any CPU
_SHAPES = [(1, 2), (47, 64), (48, 576), (301, 96), (49, 40)]


@needs_bf16_gemm
@pytest.mark.parametrize("amx_path", [False], indirect=True)
@pytest.mark.parametrize("rows", _ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), _SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_is_exactly_the_instructions_arithmetic(rows: int, out_features: int, in_features: int,
                                                          with_bias: bool, amx_path: bool) -> None:
    ops = cpu_ops()
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    got = ops.bf16_linear(x, ops.pack_bf16_linear(weight), bias, out_features)
    assert got.shape == (rows, out_features)
    assert torch.equal(got, _dot_bf16(x, weight, bias))


@needs_bf16_gemm
@pytest.mark.parametrize("amx_path", [True], indirect=True)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), _SHAPES)
def test_amx_gemm_rounds_the_exact_product_and_is_batch_invariant(out_features: int, in_features: int,
                                                                  with_bias: bool, amx_path: bool) -> None:
    # Intel does not specify how a tile step rounds inside a pair's two products, so the AMX path is
    # held to the exact product's rounding (an fp32 sum of the input width's products, then bf16),
    # and to each row's result not depending on the rows beside it.
    ops = cpu_ops()
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(max(_ROWS), in_features, dtype=torch.bfloat16)
    packed = ops.pack_bf16_linear(weight)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T  # what the fp32 sum's rounding errors scale with
    got = ops.bf16_linear(x, packed, bias, out_features).double()
    assert ((got - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -20 * scale).all()
    for rows in _ROWS:
        assert torch.equal(ops.bf16_linear(x[:rows], packed, bias, out_features), got[:rows].bfloat16())


@needs_bf16_gemm
@pytest.mark.parametrize("amx_path", [False, True], indirect=True)
def test_bf16_gemm_reads_strided_and_misaligned_rows(amx_path: bool) -> None:
    ops = cpu_ops()
    weight = torch.randn(100, 32, dtype=torch.bfloat16)
    packed = ops.pack_bf16_linear(weight)
    wide = torch.randn(40, 70, dtype=torch.bfloat16)
    dense = ops.bf16_linear(wide[:, :32].contiguous(), packed, None, 100)
    for x in (wide[:, :32], wide[:, 1:33], wide[::2, 4:36]):  # padded rows, odd offset, skipped rows
        assert torch.equal(ops.bf16_linear(x, packed, None, 100), ops.bf16_linear(x.contiguous(), packed, None, 100))
    assert torch.equal(ops.bf16_linear(wide[:, :32], packed, None, 100), dense)
    if not amx_path:
        assert torch.equal(dense, _dot_bf16(wide[:, :32], weight, None))


@needs_bf16_gemm
@pytest.mark.parametrize("amx_path", [False, True], indirect=True)
@pytest.mark.parametrize(("half", "in_features"), [(48, 64), (96, 576), (40, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_gemm_with_silu_is_the_two_kernels(half: int, in_features: int, with_bias: bool,
                                                  amx_path: bool) -> None:
    # bf16_linear_silu does silu_and_mul in the gate/up GEMM's epilogue past 32 rows on the tile unit
    # where each half is whole 16-column blocks (48, 96; 40 is not), and runs the two kernels elsewhere:
    # the same bits either way, each row group's stores done inside the next group's tile loop.
    ops = cpu_ops()
    torch.manual_seed(half + in_features)
    weight = torch.randn(2 * half, in_features, dtype=torch.bfloat16)
    bias = torch.randn(2 * half, dtype=torch.bfloat16) if with_bias else None
    packed = ops.pack_bf16_linear(weight)
    for rows in _ROWS:
        x = 2 * torch.randn(rows, in_features, dtype=torch.bfloat16)
        expected = torch.empty(rows, half, dtype=torch.bfloat16)
        ops.silu_and_mul(expected, ops.bf16_linear(x, packed, bias, 2 * half))
        assert torch.equal(ops.bf16_linear_silu(x, packed, bias, 2 * half), expected)


@needs_bf16_gemm
def test_bf16_gemm_rejects_what_it_cannot_read() -> None:
    ops = cpu_ops()
    packed = ops.pack_bf16_linear(torch.randn(50, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be"):
        ops.bf16_linear(torch.randn(3, 30, dtype=torch.bfloat16), packed, None, 50)
    with pytest.raises(RuntimeError, match="pack_bf16_linear of 200 rows"):
        ops.bf16_linear(torch.randn(3, 32, dtype=torch.bfloat16), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        ops.bf16_linear(torch.randn(3, 32, dtype=torch.bfloat16), packed, torch.zeros(50), 50)


def _layers(dtype: torch.dtype, in_features: int = 24) -> nn.ModuleList:
    """A column and a row linear, an embedding that is also the (tied) LM head, and an untied LM head."""
    torch.manual_seed(0)
    # 40 + 13 output rows: one full 48-column panel and a partial one
    column = ColumnParallelLinear(in_features, [even_split(40, 0, 1), even_split(13, 0, 1)], True, dtype, "cpu")
    row = RowParallelLinear(even_split(48, 0, 1), in_features, False, SINGLE_RANK, dtype, "cpu")
    vocab = VocabParallelEmbedding(37, in_features, SINGLE_RANK, dtype, "cpu")
    head = VocabParallelEmbedding(61, in_features, SINGLE_RANK, dtype, "cpu", lookups=False)
    for layer in (column, row, vocab, head):
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape))
    return nn.ModuleList([column, row, vocab, head])


@needs_bf16_gemm
def test_packed_layers_run_the_bf16_gemm() -> None:
    layers_ = _layers(torch.bfloat16)
    column, row, vocab, head = layers_
    x, wide = torch.randn(2, 5, 24, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    ids = torch.tensor([3, 36])
    flat = x.flatten(0, 1)
    expected = (_dot_bf16(flat, column.weight, column.bias).view(2, 5, 53), _dot_bf16(wide, row.weight, None),
                _dot_bf16(flat, vocab.weight, None), F.embedding(ids, vocab.weight), _dot_bf16(flat, head.weight, None))
    pack_weights(layers_)
    assert column.weight.dim() == 4 and row.weight.dim() == 4 and vocab.packed_lm_head is not None
    assert vocab.weight.dim() == 2  # the lookup table stays plain
    assert head.weight.dim() == 4 and head.packed_lm_head is None  # no lookups: packed in place, one copy
    got = (column(x), row(wide), vocab.logits(flat), vocab(ids), head.logits(flat))
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


@needs_bf16_onednn
def test_onednn_packed_layers_give_f_linear_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_gemm, "has_bf16_panels", lambda: False)  # as on a CPU without AVX512-BF16
    layers_ = _layers(torch.bfloat16)
    column, row, vocab, head = layers_
    x, wide = torch.randn(5, 24, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    ids = torch.tensor([3, 36])
    expected = (F.linear(x, column.weight, column.bias), F.linear(wide, row.weight), F.linear(x, vocab.weight),
                F.embedding(ids, vocab.weight), F.linear(x, head.weight))
    pack_weights(layers_)
    assert column.weight.is_mkldnn and row.weight.is_mkldnn and vocab.packed_lm_head is not None
    assert not vocab.weight.is_mkldnn  # the lookup table stays plain
    assert head.weight.is_mkldnn and head.packed_lm_head is None
    got = (column(x), row(wide), vocab.logits(x), vocab(ids), head.logits(x))
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


@needs_bf16_onednn
def test_odd_input_widths_go_to_onednn() -> None:
    column = _layers(torch.bfloat16, in_features=25)[0]  # the bf16 GEMM reads input features in pairs
    x = torch.randn(5, 25, dtype=torch.bfloat16)
    expected = F.linear(x, column.weight, column.bias)
    pack_weights(column)
    assert column.weight.is_mkldnn
    assert torch.equal(column(x), expected)


# a CPU with AVX512-BF16 too: cadence's bf16 GEMM must leave float32 weights alone (it once took them
# and failed the load)
@pytest.mark.parametrize("bf16_gemm", [False, True])
def test_float32_layers_take_onednn_s_gemm_on_x86(bf16_gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN packs float32 (x86), the layers run its GEMM over the packed weight; its sums round
    differently from F.linear's (MKL's), within float32's precision. Elsewhere they stay plain."""
    monkeypatch.setattr(dense_gemm, "has_bf16_panels", lambda: bf16_gemm)
    layers_ = _layers(torch.float32)
    column, row, vocab, head = layers_
    x, wide, ids = torch.randn(5, 24), torch.randn(5, 48), torch.tensor([3, 36])
    weights = ((x, column.weight, column.bias), (wide, row.weight, None), (x, vocab.weight, None),
               (x, head.weight, None))
    packs = onednn.packs(torch.float32, torch.device("cpu"))
    assert packs == (platform.machine() == "x86_64")
    plain = [F.linear(*args) for args in weights]
    packed = [onednn.linear(a, onednn.pack(w), b) if packs else F.linear(a, w, b) for a, w, b in weights]
    lookup = F.embedding(ids, vocab.weight)
    pack_weights(layers_)
    assert [column.weight.is_mkldnn, row.weight.is_mkldnn, vocab.packed_lm_head is not None, head.weight.is_mkldnn] \
        == [packs] * 4
    assert not vocab.weight.is_mkldnn and torch.equal(vocab(ids), lookup)  # the lookup table stays plain
    got = (column(x), row(wide), vocab.logits(x), head.logits(x))
    for have, want, reference in zip(got, packed, plain, strict=True):
        assert torch.equal(have, want)
        torch.testing.assert_close(have, reference)
    if packs:
        with pytest.raises(ValueError, match="load weights before packing"):
            row.load("weight", torch.zeros(24, 48), 0)


# 1-2 rows go against 4 / 2 panels a tile, 3-4 against one, 5+ in tiles of 4 and a tail; 300 rows of
# 576 features cross a block of rows (256 KB of float32)
_AVX2_ROWS = [1, 2, 3, 4, 5, 9, 33, 300]
_AVX2_SHAPES = [(1, 1), (15, 17), (16, 64), (47, 576), (130, 96)]


def _fma_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` as the kernel computes it from bf16 ``x``: per output a float32 sum that
    adds the exact product (bf16 times bf16 is exact in float32) of each input feature in turn, the
    bias, then one rounding to ``x``'s dtype."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k, None] * wf[None, :, k]
    return (acc if bias is None else acc + bias.float()).to(x.dtype)


@needs_avx2_gemm
@pytest.mark.parametrize("rows", _AVX2_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), _AVX2_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx2_gemm_s_bf16_rows_are_exactly_a_chain_of_fmas(rows: int, out_features: int, in_features: int,
                                               with_bias: bool) -> None:
    ops = dense_gemm.avx2_ops_with_bf16()
    torch.manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    got = ops.bf16_linear(x, ops.pack_bf16_linear(weight), bias, out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert torch.equal(got, _fma_chain(x, weight, bias))


@needs_avx2_gemm
@pytest.mark.parametrize(("out_features", "in_features"), _AVX2_SHAPES)
def test_avx2_gemm_s_float32_rows_are_within_float32_rounding_and_batch_invariant(out_features: int,
                                                                                   in_features: int) -> None:
    ops = dense_gemm.avx2_ops_with_bf16()
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features)
    x = torch.randn(max(_AVX2_ROWS), in_features)
    packed = ops.pack_bf16_linear(weight)
    got = ops.bf16_linear(x, packed, bias, out_features)
    assert got.dtype == torch.float32
    exact = x.double() @ weight.double().T + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()  # what the sum's roundings scale with
    assert ((got.double() - exact).abs() <= (in_features + 1) * 2.0 ** -24 * scale).all()  # an FMA each, the bias
    for rows in _AVX2_ROWS:  # one chain per output whatever the tile: a row's bits do not depend on its neighbours
        assert torch.equal(ops.bf16_linear(x[:rows], packed, bias, out_features), got[:rows])
    assert torch.equal(ops.bf16_linear(x[7:8], packed, bias, out_features), got[7:8])


@needs_avx2_gemm
def test_avx2_gemm_reads_strided_rows_as_their_values() -> None:
    ops = dense_gemm.avx2_ops_with_bf16()
    weight = torch.randn(24, 40, dtype=torch.bfloat16)
    wide = torch.randn(6, 90, dtype=torch.bfloat16)
    x = wide[:, 3:43]  # rows 90 apart, starting off any alignment
    packed = ops.pack_bf16_linear(weight)
    assert torch.equal(ops.bf16_linear(x, packed, None, 24), ops.bf16_linear(x.contiguous(), packed, None, 24))


@needs_avx2_gemm
def test_avx2_gemm_rejects_what_it_cannot_read() -> None:
    ops = dense_gemm.avx2_ops_with_bf16()
    weight = torch.randn(20, 32, dtype=torch.bfloat16)
    packed = ops.pack_bf16_linear(weight)
    assert packed.shape == (2, 32, 16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="pack_bf16_linear of 40 rows"):
        ops.bf16_linear(x, packed, None, 40)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 32\]"):
        ops.bf16_linear(torch.randn(3, 31, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 32\] float32 or bfloat16"):
        ops.bf16_linear(x.half(), packed, None, 20)
    with pytest.raises(RuntimeError, match="bias must be dense"):
        ops.bf16_linear(x, packed, torch.randn(20), 20)  # float32 bias for bf16 rows
    with pytest.raises(RuntimeError, match="must be \\[out_features, in_features\\] bf16"):
        ops.pack_bf16_linear(weight.float())
    assert ops.bf16_linear(x[:0], packed, None, 20).shape == (0, 20)


def test_a_model_s_bf16_layers_run_the_avx2_panels(avx2_bf16_panels: None) -> None:
    layers_ = _layers(torch.bfloat16)
    column, row, vocab, head = layers_
    x, wide = torch.randn(2, 5, 24, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    ids, flat = torch.tensor([3, 36]), x.flatten(0, 1)
    expected = (_fma_chain(flat, column.weight, column.bias).view(2, 5, 53), _fma_chain(wide, row.weight, None),
                _fma_chain(flat, vocab.weight, None), F.embedding(ids, vocab.weight),
                _fma_chain(flat, head.weight, None))
    pack_weights(layers_)
    assert column.weight.dim() == 3 and row.weight.dim() == 3 and vocab.packed_lm_head.dim() == 3
    assert vocab.weight.dim() == 2 and head.weight.dim() == 3  # the lookup table stays plain
    got = (column(x), row(wide), vocab.logits(flat), vocab(ids), head.logits(flat))
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_float32_weights_stay_with_onednn_beside_the_avx2_panels(avx2_bf16_panels: None) -> None:
    weight = torch.randn(16, 8)
    assert dense_gemm.packs(weight) == onednn.packs(torch.float32, weight.device)
    assert dense_gemm.prepacked(weight).dim() == 2  # oneDNN's (x86) or the plain weight
