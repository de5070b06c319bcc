"""The GGML block decoders (cadence/quantization/ggml.py) against the ``gguf`` package's own
dequantizer, and that reference itself on blocks whose values are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from support.ggml_blocks import QUANTIZED, Q, random_blocks

from cadence.quantization.blocks import BlockCodes, concat_rows, quantize_int8, symmetric
from cadence.quantization.ggml import decode

# The K-quants' sub-block scales are multiplied out once, into float16: each value moves by at most
# half a float16 ulp of its scale and minimum times the code (2^-11 relative); the rest are exact.
EXACT = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# Each format's codes, and whether its minimums are -2^(bits-1) scales (left out when packed).
FORMS = {Q.Q8_0: (8, 32, True), Q.Q4_0: (4, 32, True), Q.Q4_1: (4, 32, False), Q.Q5_0: (5, 32, True),
         Q.Q5_1: (5, 32, False), Q.Q4_K: (4, 32, False), Q.Q5_K: (5, 32, False), Q.Q6_K: (6, 16, True)}


def test_the_reference_dequantizer_on_known_blocks() -> None:
    # Q8_0: scale 0.5, codes -128, -1, 0, 1, 127 ...
    codes = np.array([-128, -1, 0, 1, 127] + [0] * 27, dtype=np.int8)
    q8 = np.concatenate([np.array([0.5], dtype=np.float16).view(np.uint8), codes.view(np.uint8)])
    assert quants.dequantize(q8[None], Q.Q8_0)[0, :5].tolist() == [-64.0, -0.5, 0.0, 0.5, 63.5]
    # Q4_1: scale 0.25, minimum -1; byte j holds value j (low nibble) and value j + 16 (high nibble)
    nibbles = np.array([0x10 * 15 + 0, 0x10 * 1 + 2] + [0] * 14, dtype=np.uint8)
    q4 = np.concatenate([np.array([0.25, -1.0], dtype=np.float16).view(np.uint8), nibbles])
    values = quants.dequantize(q4[None], Q.Q4_1)[0]
    assert values[[0, 1, 16, 17]].tolist() == [-1.0, -0.5, 2.75, -0.75]


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_decoders_match_the_gguf_dequantizer(kind: GGMLQuantizationType) -> None:
    raw = random_blocks(kind, rows=7, cols=512, seed=int(kind))
    reference = torch.from_numpy(quants.dequantize(raw, kind))
    ours = decode(torch.from_numpy(raw), kind, 512)
    assert ours.shape == (7, 512) and ours.codes.dtype == torch.uint8 and ours.scale.dtype == torch.float16
    assert int(ours.codes.max()) < 2 ** ours.bits
    assert (ours.bits, ours.block, symmetric(ours)) == FORMS[kind]
    values = ours.dequantize()
    if kind in EXACT:
        assert torch.equal(values, reference)
    else:
        codes = ours.codes.view(7, -1, ours.block).float()
        bound = (codes * ours.scale.float().abs().unsqueeze(-1) + ours.minimum.float().abs().unsqueeze(-1)) * 2 ** -11
        assert ((values - reference).abs().view_as(bound) <= bound + 1e-12).all()


def test_a_row_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        decode(torch.zeros(2, 20, dtype=torch.uint8), Q.Q4_1, 48)
    with pytest.raises(ValueError, match="no decoder for GGML type Q2_K"):
        decode(torch.zeros(2, 84, dtype=torch.uint8), Q.Q2_K, 256)


def test_fused_rows_stack_within_one_format_only() -> None:
    q4 = decode(torch.from_numpy(random_blocks(Q.Q4_1, 3, 64, seed=1)), Q.Q4_1, 64)
    q6 = decode(torch.from_numpy(random_blocks(Q.Q6_K, 2, 256, seed=2)), Q.Q6_K, 256)
    q6 = q6.take(slice(None), slice(0, 64))
    fused = concat_rows([q4, q4])
    assert (fused.bits, fused.block, fused.shape) == (4, 32, (6, 64))
    assert torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), q4.dequantize()]))
    with pytest.raises(ValueError, match=r"cannot stack blocks of different forms \[\(4, 32\), \(6, 16\)\]"):
        concat_rows([q4, q6])


def test_a_column_shard_must_fall_on_blocks() -> None:
    codes = decode(torch.from_numpy(random_blocks(Q.Q8_0, 2, 128, seed=3)), Q.Q8_0, 128)
    assert torch.equal(codes.take(slice(None), slice(32, 96)).dequantize(), codes.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="do not fall on the format's blocks of 32"):
        codes.take(slice(None), slice(0, 48))


def test_int8_is_per_channel_within_half_a_step() -> None:
    weight = torch.randn(5, 70) * torch.tensor([0.01, 1.0, 100.0, 0.0, 3.0]).unsqueeze(1)
    codes = quantize_int8(weight)
    assert (codes.bits, codes.block, codes.shape, symmetric(codes)) == (8, 32, (5, 96), True)
    step = codes.scale[:, :1].float()
    assert torch.equal(step.squeeze(1), (weight.abs().amax(1) / 127).half().float())
    error = (codes.dequantize()[:, :70] - weight).abs()
    assert (error <= step / 2 * (1 + 1e-3) + 1e-7).all()
    assert torch.equal(codes.dequantize()[:, 70:], torch.zeros(5, 26))
    assert isinstance(codes, BlockCodes)
