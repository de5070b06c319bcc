"""The reusable layers against Hugging Face transformers, op for op: RMSNorm, the RoPE frequencies
and cos/sin tables of each supported RoPE type, the rotation itself, and the config facts they read
(head size, sliding window). Whole models are compared in tests/models/test_models.py, and the C++ kernels
against torch ops in tests/backends/test_cpu_kernels.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.tiny_models import tiny_config
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from cadence.backends.cpu_kernels import cpu_ops
from cadence.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    head_dim_of,
    layer_windows,
    rope_inv_freq,
    sliding_window_of,
)

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="the C++ CPU kernels do not run here")

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def rope_config(kind: str, **overrides: Any) -> PretrainedConfig:
    params = ROPE[kind]
    return tiny_config("llama", **overrides) if params is None else tiny_config("llama", rope_parameters=params,
                                                                                **overrides)


# ---- RMSNorm ---------------------------------------------------------------------------------


def _norms(hidden: int, dtype: torch.dtype, fused: bool) -> tuple[RMSNorm, LlamaRMSNorm]:
    ours = RMSNorm(hidden, 1e-5, dtype, CPU, fused)
    theirs = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    weight = torch.rand(hidden, generator=torch.Generator().manual_seed(hidden)) + 0.5
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_op_for_op(dtype: torch.dtype) -> None:
    ours, theirs = _norms(48, dtype, fused=False)
    x = (torch.randn(7, 48, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@needs_kernels
def test_fused_rms_norm_matches_transformers_in_fp32() -> None:
    ours, theirs = _norms(40, torch.float32, fused=True)  # 40: a tail past the vector width
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_kernels)], ids=["torch", "fused"])
def test_add_forward_normalises_the_sum_and_writes_it_into_the_residual(fused: bool) -> None:
    ours, theirs = _norms(32, torch.float32, fused)
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    x_before, summed = x.clone(), x + residual
    with torch.no_grad():
        out, new_residual = ours.add_forward(x, residual)
        expected = theirs(summed)
    assert new_residual is residual and torch.equal(residual, summed)
    assert torch.equal(x, x_before)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


# ---- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_frequencies_and_scale_are_transformers(kind: str) -> None:
    config = rope_config(kind)
    inv_freq, scale = rope_inv_freq(config)
    reference = LlamaRotaryEmbedding(config)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (8,)  # head_dim 16
    assert torch.equal(inv_freq, reference.inv_freq)
    assert scale == reference.attention_scaling
    assert (scale != 1.0) == (kind == "yarn")  # yarn scales cos/sin too


def test_default_rope_follows_an_explicit_head_dim() -> None:
    config = tiny_config("llama", head_dim=32)
    inv_freq, _ = rope_inv_freq(config)
    assert torch.equal(inv_freq, LlamaRotaryEmbedding(config).inv_freq) and inv_freq.shape == (16,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_tables_are_transformers_cos_and_sin(kind: str, dtype: torch.dtype) -> None:
    config = rope_config(kind)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 200, 511])
    step = RotaryEmbedding(config, dtype, CPU, fused=False)(positions)
    cos, sin = LlamaRotaryEmbedding(config)(torch.empty(0, dtype=dtype), positions[None])
    assert step.positions is positions
    assert step.cos is not None and step.sin is not None
    assert step.cos.shape == step.sin.shape == (8, 1, 16) and step.cos.dtype == dtype
    assert torch.equal(step.cos[:, 0], cos[0]) and torch.equal(step.sin[:, 0], sin[0])  # fp32 tables, then cast


def test_rope_tables_on_the_cpu_grow_with_the_positions_a_step_needs() -> None:
    config = rope_config("default")
    config.max_position_embeddings = 20_000
    rope = RotaryEmbedding(config, torch.float32, CPU, fused=False)
    assert rope.cos.shape[0] == 4096  # not 20,000 rows from the start
    positions = torch.tensor([3, 9000, 4095])
    step = rope(positions)
    assert rope.cos.shape[0] == 9001 and rope.sin.shape == rope.cos.shape  # the step's need (over twice 4,096)
    cos, sin = LlamaRotaryEmbedding(config)(torch.empty(0), positions[None])
    assert step.cos is not None and step.sin is not None
    assert torch.equal(step.cos[:, 0], cos[0]) and torch.equal(step.sin[:, 0], sin[0])
    rope(torch.tensor([9500]))
    assert rope.cos.shape[0] == 18002  # doubled
    rope(torch.tensor([19_999]))
    assert rope.cos.shape[0] == 20_000  # never past the model's positions


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    return torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(4))


def test_rotate_splits_the_projections_and_rotates_q_and_k_as_transformers() -> None:
    config = rope_config("llama3")
    heads, kv_heads, head_dim = 4, 2, 16
    positions = torch.tensor([3, 0, 9, 130, 17])
    rope = RotaryEmbedding(config, torch.float32, CPU, fused=False)
    qkv = _qkv(5, heads, kv_heads, head_dim)
    before = qkv.clone()
    q, k, v = rope.rotate(qkv, rope(positions), heads, kv_heads, head_dim)

    cos, sin = LlamaRotaryEmbedding(config)(qkv, positions[None])
    q_in, k_in, v_in = before.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    # transformers' layout: [batch, heads, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(q_in.view(5, heads, head_dim).transpose(0, 1)[None],
                                          k_in.view(5, kv_heads, head_dim).transpose(0, 1)[None], cos, sin)
    assert q.shape == (5, heads, head_dim) and k.shape == v.shape == (5, kv_heads, head_dim)
    assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(k, want_k[0].transpose(0, 1))
    assert torch.equal(v, v_in.view(5, kv_heads, head_dim))
    assert torch.equal(qkv, before)  # the torch path does not write into the projections


@needs_kernels
def test_fused_rotate_rotates_in_place_as_the_torch_path_does() -> None:
    config = rope_config("linear")
    heads, kv_heads, head_dim = 4, 2, 16
    positions = torch.tensor([1, 5, 300, 42])
    plain = RotaryEmbedding(config, torch.float32, CPU, fused=False)
    fused = RotaryEmbedding(config, torch.float32, CPU, fused=True)
    qkv = _qkv(4, heads, kv_heads, head_dim)
    want = plain.rotate(qkv.clone(), plain(positions), heads, kv_heads, head_dim)
    step = fused(positions)
    assert step.cos is None and step.sin is None  # the kernel reads the tables itself
    got = fused.rotate(qkv, step, heads, kv_heads, head_dim)
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert got[0].data_ptr() == qkv.data_ptr()  # views into the projections


def test_unsupported_rope_types_are_refused_with_the_supported_ones() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "made-up", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="RoPE type 'made-up' is not supported; supported: default, ") as info:
        rope_inv_freq(config)  # type: ignore[arg-type]
    assert "llama3" in str(info.value) and "longrope" in str(info.value)


# ---- config facts ----------------------------------------------------------------------------


def test_head_dim_is_the_configs_or_hidden_over_heads() -> None:
    assert head_dim_of(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)) == 32
    assert head_dim_of(LlamaConfig(hidden_size=64, num_attention_heads=4)) == 16
    assert head_dim_of(PretrainedConfig(hidden_size=96, num_attention_heads=4)) == 24  # no head_dim at all
    assert head_dim_of(SimpleNamespace(hidden_size=96, num_attention_heads=4, head_dim=None)) == 24  # type: ignore[arg-type]


def test_each_layer_has_the_window_transformers_gives_it() -> None:
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=256)) == [256, 256, 256]
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # Qwen2 windows the layers from max_window_layers on, and only with use_sliding_window.
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert layer_windows(qwen2) == [None, None, 32, 32]
    assert layer_windows(Qwen2Config(num_hidden_layers=2, sliding_window=32)) == [None, None]
    gemma3 = Gemma3TextConfig(num_hidden_layers=7, sliding_window=512)  # five sliding layers, then a global one
    assert layer_windows(gemma3) == [512] * 5 + [None] + [512]


def test_sliding_window_only_where_some_layer_uses_one() -> None:
    assert sliding_window_of(MistralConfig(sliding_window=256)) == 256
    assert sliding_window_of(MistralConfig(sliding_window=None)) is None
    assert sliding_window_of(LlamaConfig()) is None  # no such setting
    assert sliding_window_of(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                                         max_window_layers=2)) == 32
    assert sliding_window_of(Qwen2Config(num_hidden_layers=4, sliding_window=32)) is None  # not used
    full_layers = PretrainedConfig(sliding_window=32, layer_types=["full_attention", "full_attention"])
    assert sliding_window_of(full_layers) is None  # a window that no layer uses
