"""The quantized linear (cadence/quantization/packed.py over csrc/quant_linear.cpp with AVX512-VNNI,
csrc/quant_linear_avx2.cpp with AVX2) for every GGML type and int8: against the arithmetic it
documents (activations rounded to int8 per block), and against the reference of the ``gguf``
package's dequantizer and an fp32 matmul within the bound that rounding allows; over odd shapes,
partial panels, tails and strided rows; the two kernels equal bit for bit where both run. Also the
float GEMM over the weight dequantized once and kept, where no kernel runs (or, beside the AVX2
kernel, for large float32 batches)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from support.ggml_blocks import QUANTIZED, Q, random_blocks

from cadence.backends import dense_gemm, onednn
from cadence.backends.cpu_kernels import avx2_ops, cpu_ops
from cadence.quantization import packed
from cadence.quantization.blocks import FORMS, BlockCodes, quantize_int8
from cadence.quantization.ggml import decode
from cadence.quantization.packed import (
    QuantizedMatrix,
    QuantizedRowStack,
    dequantize,
    lookup_rows,
    pack,
    pack_rows,
    quantized_linear,
    unpack_rows,
)

needs_kernel = pytest.mark.skipif(not packed.kernel_runs(torch.zeros(1)), reason="the kernels need x86 with AVX2")


def _dense_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as the dense path computes it: oneDNN's GEMM over the packed weight where it
    runs that dtype (backends/onednn.py), else F.linear."""
    if onednn.packs(x.dtype, x.device):
        return onednn.linear(x, onednn.pack(weight), None)
    return F.linear(x, weight)


@pytest.fixture(autouse=True)
def _kernel_at_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel on batches of any size (quantized_linear sends batches past the AVX2 kernel's row
    limits, and bfloat16 ones beside AMX, to the dense GEMM; test_large_..._batches_... checks that)."""
    for kind in ("AVX2", "AVX2_BF16", "AMX"):
        for limit in (f"_{kind}_KERNEL_ROWS", f"_{kind}_KERNEL_ROWS_8_BIT"):
            monkeypatch.setattr(packed, limit, 1 << 30)


def _weight(kind: GGMLQuantizationType, rows: int, blocks: int) -> tuple[QuantizedMatrix, torch.Tensor]:
    """A random ``kind`` weight packed, and the gguf package's dequantization of the same bytes."""
    cols = blocks * GGML_QUANT_SIZES[kind][0]
    raw = random_blocks(kind, rows, cols, seed=rows + blocks)
    return pack(decode(torch.from_numpy(raw), kind, cols)), torch.from_numpy(quants.dequantize(raw, kind))


def _activations_as_quantized(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as the kernel reads it: per row and block, s * (hi + lo / 254) with s = max|x| / 127 and
    int8 parts hi, lo (half to even), as csrc/quant_linear.cpp documents."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    peak = blocks.abs().amax(-1, keepdim=True)
    step = peak / 127
    hi = torch.round(blocks * torch.where(peak > 0, 127 / peak, 0.0))
    lo = torch.round((blocks - hi * step) * torch.where(peak > 0, 127 * 254 / peak, 0.0))
    return (step * (hi + lo / 254)).reshape(x.shape)


def _bound(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """How far the kernel may be from ``x @ weight.T``: half a low part's step times each |w|."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    half_step = (blocks.abs().amax(-1, keepdim=True) / (127 * 254 * 2)).expand_as(blocks).reshape(x.shape)
    return half_step @ weight.abs().T


def _x(rows: int, cols: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """Activations whose rows are dense, padded apart, every other row, or column-strided."""
    if layout == "dense":
        return torch.randn(rows, cols).to(dtype)
    if layout == "padded":
        return torch.randn(rows, cols + 40).to(dtype)[:, 3:cols + 3]
    if layout == "every-other":
        return torch.randn(2 * rows, cols).to(dtype)[::2]
    return torch.randn(cols, rows).to(dtype).t()  # column-strided


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
# rows: one group of four 16-row panels holding one row, 3 panels' rows, a second group of one row,
# of 3 panels' rows, two panels, four groups (two for each thread); batch: one row, a few rows (whole
# groups at a time), tiles of 4 rows and a tail, row blocks of 256.
@pytest.mark.parametrize(("rows", "batch"),
                         [(1, 1), (40, 1), (65, 2), (100, 3), (17, 3), (200, 1), (40, 9), (200, 6), (33, 300)])
def test_kernel_against_the_gguf_reference(kind: GGMLQuantizationType, rows: int, batch: int) -> None:
    torch.manual_seed(rows * batch)
    matrix, reference = _weight(kind, rows, blocks=2 if GGML_QUANT_SIZES[kind][0] == 256 else 5)
    x = torch.randn(batch, matrix.cols)
    bias = torch.randn(rows)
    out = quantized_linear(x, matrix, bias)
    # Exactly the documented arithmetic, but for float32 rounding ...
    ours = dequantize(matrix)
    documented = _activations_as_quantized(x, matrix.block) @ ours.T + bias
    scale = x.abs() @ ours.abs().T + bias.abs()
    assert ((out - documented).abs() <= 1e-5 * scale + 1e-6).all()
    # ... and so within half an activation step (plus the format's own float16 rounding) of the reference.
    exact = x @ reference.T + bias
    allowed = _bound(x, reference, matrix.block) + x.abs() @ (ours - reference).abs().T + 1e-5 * scale
    assert ((out - exact).abs() <= allowed).all()


@needs_kernel
def test_a_rows_output_does_not_depend_on_the_rows_beside_it() -> None:
    """Bit for bit, whatever tile a row lands in (one at a time, two per whole-group tile, four per
    pair of panels): a request's tokens must not change with the batch, or with the drafts it verifies."""
    torch.manual_seed(4)
    matrix, _ = _weight(Q.Q4_1, rows=200, blocks=5)
    x = torch.randn(12, matrix.cols)
    alone = torch.cat([quantized_linear(x[i:i + 1], matrix, None) for i in range(12)])
    for batch in range(2, 13):
        assert torch.equal(quantized_linear(x[:batch], matrix, None), alone[:batch]), batch


@needs_kernel
@pytest.mark.parametrize("layout", ["dense", "padded", "every-other", "column-strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_rows_and_bf16(layout: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    matrix, _ = _weight(Q.Q4_1, rows=50, blocks=3)
    x = _x(7, matrix.cols, layout, dtype)
    bias = torch.randn(50).to(dtype)
    out = quantized_linear(x, matrix, bias)
    assert out.dtype == dtype and out.shape == (7, 50)
    ours = dequantize(matrix)
    documented = _activations_as_quantized(x, matrix.block) @ ours.T + bias.float()
    # bf16 output rounds each value once (to 2^-8 relative)
    tolerance = (x.float().abs() @ ours.abs().T + bias.float().abs()) * (1e-5 if dtype == torch.float32 else 2 ** -8)
    assert ((out.float() - documented).abs() <= tolerance + 1e-6).all()


@needs_kernel
def test_int8_weights_with_a_width_off_the_blocks() -> None:
    torch.manual_seed(2)
    weight = torch.randn(21, 50)
    matrix = pack(quantize_int8(weight), cols=50)
    x = torch.randn(4, 3, 50)  # any leading dimensions
    out = quantized_linear(x, matrix, None)
    assert out.shape == (4, 3, 21)
    ours = dequantize(matrix)
    assert ours.shape == (21, 50) and ((ours - weight).abs() <= weight.abs().amax(1, keepdim=True) / 254 + 1e-6).all()
    padded = F.pad(x.reshape(12, 50), (0, 14))
    documented = _activations_as_quantized(padded, 32)[:, :50] @ ours.T
    assert torch.allclose(out.reshape(12, 21), documented, rtol=1e-5, atol=1e-5)


def test_torch_path_dequantizes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "_kernel", lambda: None)
    torch.manual_seed(3)
    for kind in QUANTIZED:
        matrix, reference = _weight(kind, rows=19, blocks=1 if GGML_QUANT_SIZES[kind][0] == 256 else 3)
        x = torch.randn(5, matrix.cols)
        out = quantized_linear(x, matrix, None)
        ours = dequantize(matrix)
        assert torch.equal(out, _dense_gemm(x, ours)), kind.name
        # the K-quants' scales rounded to float16 are the one difference from the reference
        allowed = x.abs() @ (ours - reference).abs().T + 1e-5 * (x.abs() @ ours.abs().T)
        assert ((out - x @ reference.T).abs() <= allowed).all(), kind.name
    calls: list[torch.dtype] = []
    monkeypatch.setattr(packed, "dequantize", lambda m, dtype: calls.append(dtype) or dequantize(m, dtype))
    x = torch.randn(3, matrix.cols)
    first = quantized_linear(x, matrix, None)
    assert torch.equal(quantized_linear(x, matrix, None), first) and calls == []  # kept from the loop's call
    bf16 = quantized_linear(x.bfloat16(), matrix, None)
    assert quantized_linear(x.bfloat16(), matrix, None).dtype == torch.bfloat16 and calls == [torch.bfloat16]
    assert torch.equal(bf16, _dense_gemm(x.bfloat16(), ours.bfloat16()))


def _random_codes(bits: int, block: int, symmetric: bool, rows: int = 70, cols: int = 96) -> BlockCodes:
    scale = torch.rand(rows, cols // block).half()
    minimum = (-(1 << (bits - 1)) * scale.float()).half() if symmetric else torch.randn(rows, cols // block).half()
    return BlockCodes(torch.randint(0, 2 ** bits, (rows, cols), dtype=torch.uint8), scale, minimum, bits, block)


@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
@pytest.mark.parametrize(("bits", "block"), sorted(FORMS))
def test_pack_keeps_every_value_and_rows_unpack_alone(bits: int, block: int, symmetric: bool) -> None:
    torch.manual_seed(bits * block)
    codes = _random_codes(bits, block, symmetric)
    matrix = pack(codes)  # two groups of four 16-row panels, the second mostly zero rows
    # per (panel, block): 16 scales, 16 minimums unless symmetric, the codes at their own width
    assert matrix.symmetric == symmetric
    assert matrix.packed.shape == (2, 96 // block, 4, (32 if symmetric else 64) + 16 * block * bits // 8)
    assert torch.equal(dequantize(matrix), codes.dequantize())
    assert torch.equal(dequantize(matrix, torch.bfloat16), codes.dequantize().bfloat16())
    assert torch.equal(dequantize(matrix), unpack_rows(matrix, torch.arange(matrix.rows)))
    rows = torch.tensor([69, 0, 17, 17, 64, 63])
    assert torch.equal(unpack_rows(matrix, rows, torch.bfloat16), codes.dequantize()[rows].bfloat16())


@pytest.mark.skipif(cpu_ops() is None, reason="the C++ kernels need AVX-512 or AVX2")
@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
@pytest.mark.parametrize(("bits", "block"), sorted(FORMS))
def test_the_row_lookup_kernel_is_the_torch_paths(bits: int, block: int, symmetric: bool) -> None:
    torch.manual_seed(bits + block)
    matrix = pack(_random_codes(bits, block, symmetric), cols=90)  # the last block's tail is padding
    rows = torch.tensor([69, 0, 17, 17, 64, 63, 5])
    for dtype in (torch.float32, torch.bfloat16):
        ours = lookup_rows(matrix, rows, dtype)
        assert ours.shape == (7, 90) and torch.equal(ours, unpack_rows(matrix, rows, dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        lookup_rows(matrix, torch.tensor([128]), torch.float32)  # two groups of 64 rows


@needs_kernel
@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
@pytest.mark.parametrize(("bits", "block"), sorted(FORMS))
@pytest.mark.parametrize("batch", [1, 6])
def test_kernel_in_every_layout(bits: int, block: int, symmetric: bool, batch: int) -> None:
    torch.manual_seed(bits * block + batch)
    matrix = pack(_random_codes(bits, block, symmetric, rows=200, cols=192))
    x = torch.randn(batch, 192)
    ours = dequantize(matrix)
    documented = _activations_as_quantized(x, block) @ ours.T
    scale = x.abs() @ ours.abs().T
    assert ((quantized_linear(x, matrix, None) - documented).abs() <= 1e-5 * scale + 1e-6).all()


def test_fused_parts_of_different_formats_stay_in_their_own_layouts() -> None:
    torch.manual_seed(5)
    q4 = [decode(torch.from_numpy(random_blocks(Q.Q4_K, 70, 256, seed=s)), Q.Q4_K, 256) for s in (1, 2)]
    q6 = decode(torch.from_numpy(random_blocks(Q.Q6_K, 30, 256, seed=3)), Q.Q6_K, 256)
    stack = pack_rows([*q4, q6])  # q and k in Q4_K, v in Q6_K
    assert isinstance(stack, QuantizedRowStack) and stack.rows == 170
    assert [(m.rows, m.bits, m.block, m.symmetric) for m in stack.parts] == [(140, 4, 32, False), (30, 6, 16, True)]
    same = pack_rows(q4)
    assert isinstance(same, QuantizedMatrix) and same.rows == 140
    weight = torch.cat([c.dequantize() for c in (*q4, q6)])
    x, bias = torch.randn(3, 256), torch.randn(170)
    out = quantized_linear(x, stack, bias)
    parts = [quantized_linear(x, m, b) for m, b in zip(stack.parts, bias.split([140, 30]), strict=True)]
    assert out.shape == (3, 170) and torch.equal(out, torch.cat(parts, dim=-1))
    assert torch.allclose(out, x @ weight.T + bias, rtol=1e-4, atol=1e-4 * float((x.abs() @ weight.abs().T).max()))


@needs_kernel
@pytest.mark.parametrize(("bits", "block"), [(6, 32), (4, 16), (3, 32)])
def test_the_kernel_refuses_forms_it_has_no_code_for(bits: int, block: int) -> None:
    bytes_per_block = 64 + 16 * block * bits // 8
    weights = torch.zeros(1, 64 // block, 4, bytes_per_block, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"no kernel for {bits}-bit codes in blocks of {block}"):
        packed._kernel()(torch.zeros(1, 64), weights, None, 16, bits, block, False)
    assert (bits, block) not in FORMS


@pytest.mark.skipif(not packed.kernel_available(), reason="the kernels need an x86 CPU with AVX2")
def test_the_vnni_kernel_is_preferred_and_the_avx2_one_runs_without_it() -> None:
    assert packed._kernel() == (cpu_ops().quant_linear if packed.vnni_available() else avx2_ops().quant_linear)


@pytest.mark.skipif(not packed.vnni_available() or avx2_ops() is None, reason="needs AVX512-VNNI (and AVX2)")
@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
@pytest.mark.parametrize(("bits", "block"), sorted(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_avx2_kernel_equals_the_vnni_one_bit_for_bit(bits: int, block: int, symmetric: bool,
                                                         dtype: torch.dtype) -> None:
    """The same greedy tokens on every x86 machine: both do the same float steps in the same order."""
    torch.manual_seed(bits * block)
    matrix = pack(_random_codes(bits, block, symmetric, rows=200, cols=192))
    bias = torch.randn(200).to(dtype)
    for batch in (1, 2, 5, 12, 300):
        x = torch.randn(batch, 192).to(dtype)
        args = (x, matrix.packed, bias, matrix.rows, bits, block, symmetric)
        assert torch.equal(avx2_ops().quant_linear(*args), cpu_ops().quant_linear(*args)), batch


@needs_kernel
def test_large_float32_batches_take_the_dense_gemm_beside_the_avx2_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    torch.manual_seed(6)
    # 4-bit codes up to 16 rows, 8-bit ones (two nibbles a step: twice the kernel's work) up to 2
    for kind, limit in ((Q.Q4_1, 16), (Q.Q8_0, 2)):
        matrix, _ = _weight(kind, rows=70, blocks=3)
        dense = _dense_gemm(x := torch.randn(limit + 1, matrix.cols), dequantize(matrix))
        kernel = packed._kernel()(x, matrix.packed, None, matrix.rows, matrix.bits, matrix.block, matrix.symmetric)
        assert torch.equal(quantized_linear(x[:limit], matrix, None), kernel[:limit])
        assert torch.equal(quantized_linear(x, matrix, None), kernel if packed.vnni_available() else dense)


def _bfloat16_rows_past_the_limit(kind: GGMLQuantizationType, limit: int) -> tuple[QuantizedMatrix, torch.Tensor]:
    """A ``kind`` matrix whose bfloat16 row limit is ``limit``, and ``limit + 1`` rows of x, of which the
    first ``limit`` are checked to take the kernel (where the rest go is the caller's to check)."""
    matrix, _ = _weight(kind, rows=70, blocks=3)
    assert packed.kernel_row_limit(matrix, torch.bfloat16) == limit
    x = torch.randn(limit + 1, matrix.cols).bfloat16()
    kernel = packed._kernel()(x, matrix.packed, None, matrix.rows, matrix.bits, matrix.block, matrix.symmetric)
    assert torch.equal(quantized_linear(x[:limit], matrix, None), kernel[:limit])
    return matrix, x


@needs_kernel
def test_large_bfloat16_batches_take_the_avx2_bf16_gemm_beside_the_avx2_kernel(
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """As on a CPU with AVX2 alone: bfloat16 batches past the row limits run the AVX2 bf16 GEMM over
    the dense weight in its panels (backends/dense_gemm.py)."""
    monkeypatch.undo()
    request.getfixturevalue("avx2_bf16_panels")
    monkeypatch.setattr(packed, "vnni_available", lambda: False)  # the limits of the AVX2 kernel
    torch.manual_seed(9)
    # 4-bit codes up to 12 rows, 8-bit ones up to 2
    for kind, limit in ((Q.Q4_1, 12), (Q.Q8_0, 2)):
        matrix, x = _bfloat16_rows_past_the_limit(kind, limit)
        panels = dense_gemm.pack(dequantize(matrix, torch.bfloat16))
        assert panels.dim() == 3 and torch.equal(matrix.dense(torch.bfloat16), panels)
        assert torch.equal(quantized_linear(x, matrix, None), dense_gemm.linear(x, panels, None, matrix.rows))


@needs_kernel
@pytest.mark.skipif(not packed._amx_gemm(), reason="needs AMX (oneDNN's bfloat16 GEMM on tiles)")
def test_large_bfloat16_batches_take_the_dense_gemm_beside_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    torch.manual_seed(8)
    # 4-bit codes up to 16 rows, 8-bit ones up to 8
    for kind, limit in ((Q.Q4_1, 16), (Q.Q8_0, 8)):
        matrix, x = _bfloat16_rows_past_the_limit(kind, limit)
        assert torch.equal(quantized_linear(x, matrix, None), _dense_gemm(x, dequantize(matrix, torch.bfloat16)))


@needs_kernel
def test_a_stack_s_parts_go_one_way_at_its_narrowest_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused weight of 4-bit and 8-bit parts sends 3 rows to the dense GEMM for both parts, as the
    C++ decoder stack's Linear does with its one limit."""
    monkeypatch.undo()
    torch.manual_seed(7)
    parts = [_weight(Q.Q4_1, rows=40, blocks=3)[0], _weight(Q.Q8_0, rows=24, blocks=3)[0]]
    stack = QuantizedRowStack(tuple(parts))
    x = torch.randn(3, parts[0].cols)
    if packed.vnni_available():  # the VNNI kernel takes every batch
        assert packed.kernel_row_limit(stack, torch.float32) is None
        expected = torch.cat([packed._kernel()(x, p.packed, None, p.rows, p.bits, p.block, p.symmetric)
                              for p in parts], dim=-1)
    else:
        assert packed.kernel_row_limit(stack, torch.float32) == 2 < packed.kernel_row_limit(parts[0], torch.float32)
        expected = torch.cat([_dense_gemm(x, dequantize(p)) for p in parts], dim=-1)
    assert torch.equal(quantized_linear(x, stack, None), expected)


@needs_kernel
def test_a_model_s_row_limit_is_the_one_most_of_its_weights_have(monkeypatch: pytest.MonkeyPatch,
                                                                  request: pytest.FixtureRequest) -> None:
    """The cost model prices rows under the limit apart (``kernel_rows``): the model's is that of most
    of its quantized elements, an 8-bit head beside 4-bit layers taking the layers'."""
    monkeypatch.undo()
    request.getfixturevalue("avx2_bf16_panels")  # bfloat16 dense weights in the AVX2 GEMM's panels
    monkeypatch.setattr(packed, "vnni_available", lambda: False)  # the AVX2 kernel, whatever this CPU has

    def linear(kind: GGMLQuantizationType, rows: int) -> torch.nn.Module:
        module = torch.nn.Module()
        module.weight = _weight(kind, rows=rows, blocks=3)[0]  # type: ignore[assignment]
        return module

    cpu = torch.device("cpu")
    layers = torch.nn.Sequential(linear(Q.Q4_1, 70), linear(Q.Q4_1, 70), linear(Q.Q8_0, 100))
    assert packed.model_row_limit(layers, torch.float32, cpu) == 16
    assert packed.model_row_limit(torch.nn.Sequential(linear(Q.Q4_1, 70), linear(Q.Q8_0, 200)),
                                  torch.float32, cpu) == 2
    # bfloat16 rows up to 12 beside the AVX2 bf16 GEMM (beside AMX, which the process found once, up to
    # 16); another device never takes the kernel; nor does a float weight.
    assert packed.model_row_limit(layers, torch.bfloat16, cpu) == (16 if packed._amx_gemm() else 12)
    assert packed.model_row_limit(layers, torch.float32, torch.device("meta")) is None
    assert packed.model_row_limit(torch.nn.Linear(4, 4), torch.float32, cpu) is None
