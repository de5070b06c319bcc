"""Gemma's structure: which layers slide and which RoPE table each rotates with, and Gemma's RMSNorm
bit for bit against transformers' in both dtypes. (Token-exact generation: test_families.py, and
the real Gemma 3 270M: tests/test_gemma3_270m.py.)"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import tiny_config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from cadence.backends.cpu_kernels import cpu_ops
from cadence.backends.sdpa_backend import SDPABackend
from cadence.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from cadence.models.layers import GemmaRMSNorm


def test_gemma3_layers_slide_by_layer_type_with_their_own_rope() -> None:
    config = tiny_config("gemma3_text", num_hidden_layers=6, sliding_window=32, query_pre_attn_scalar=64)
    model = Gemma3ForCausalLM(config, SDPABackend, torch.float32)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.backend.sliding_window for a in attention] == [32] * 5 + [None]
    assert {a.backend.scale for a in attention} == {64 ** -0.5}
    assert len({id(a.backend) for a in attention}) == 2  # one backend object per kind of layer
    tables = [a._rotary[0] for a in attention]
    assert tables[0] is model.rotary_emb["sliding_attention"] and tables[5] is model.rotary_emb["full_attention"]
    # 10k for the sliding layers, 1M for the global one: different angles past position 0.
    assert not torch.equal(tables[0].cos[7], tables[5].cos[7])


def test_gemma2_soft_caps_and_shares_one_rope_table() -> None:
    config = tiny_config("gemma2", num_hidden_layers=2, sliding_window=32, attn_logit_softcapping=50.0)
    model = Gemma2ForCausalLM(config, SDPABackend, torch.float32)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.backend.sliding_window for a in attention] == [32, None]
    assert {a.backend.logits_soft_cap for a in attention} == {50.0}
    assert list(model.rotary_emb) == ["all"] and not hasattr(attention[0], "q_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    ours, theirs = GemmaRMSNorm(48, 1e-6, dtype, "cpu"), Gemma3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_(0, 0.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(5, 48).to(dtype) * 3
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.skipif(cpu_ops() is None, reason="the C++ CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemma_rms_norm_follows_transformers_and_its_weight(dtype: torch.dtype) -> None:
    ours, theirs = GemmaRMSNorm(640, 1e-6, dtype, "cpu", fused=True), Gemma3RMSNorm(640, eps=1e-6).to(dtype)
    x = torch.randn(7, 640).to(dtype) * 3
    for _ in range(2):  # a new weight after the first call: the kernel's fp32 scale follows it
        with torch.no_grad():
            ours.weight.normal_(0, 0.5)
            theirs.weight.copy_(ours.weight)
        got, want = ours(x), theirs(x)
        # one cast at the end, as transformers; only the sum of squares' order differs (a few fp32
        # ulps of a row's scale, at most one bf16 ulp after the cast)
        ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -21
        assert ((got.float() - want.float()).abs() <= ulp * want.float().abs()).all()
