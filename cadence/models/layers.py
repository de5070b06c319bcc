"""Layers that any decoder family can reuse: RMSNorm, rotary embeddings, and the config facts
they read (head size, sliding window, RoPE frequencies).

Numerics follow Hugging Face transformers op for op (RMSNorm in fp32 then cast back, RoPE tables
computed in fp32 then cast), so a model built from them can match it token for token in fp32.
Built with ``fused``, a layer runs its per-token op as one C++ kernel
(``backends/csrc/layer_ops.cpp``) instead of torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cadence.backends.cpu_kernels import cpu_ops

# RoPE types whose frequencies change with the sequence length inside a forward pass; a table
# precomputed once cannot follow them. ("dynamic" only rescales past max_position_embeddings,
# which we never reach, so its table is exact.)
_LENGTH_DEPENDENT_ROPE = {"longrope"}


def kernels() -> Any:
    """The C++ CPU kernels, which a ``fused`` module was built to use (so they are loaded)."""
    return cpu_ops()


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head size: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window of the layers that use one (None: every layer sees the whole context).

    A query at position ``p`` then sees keys at ``p - window < position <= p`` (Hugging Face's
    convention), so full causal attention is exact for sequences of at most ``window`` tokens.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def rope_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin scale, as in transformers.

    :raises ValueError: the RoPE type is unknown or depends on the sequence length.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        # transformers keeps the default rule on each model class; this is the same expression.
        dim = head_dim_of(config)
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in _LENGTH_DEPENDENT_ROPE or rope_type not in ROPE_INIT_FUNCTIONS:
        supported = sorted({"default", *ROPE_INIT_FUNCTIONS} - _LENGTH_DEPENDENT_ROPE)
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(supported)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq, float(scale)


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, exactly as ``LlamaRMSNorm``.

    Given the residual stream too, it first adds ``x`` into it (``residual = x + residual``, in
    place) and normalises the sum: the add that closes one sub-layer fused with the norm that opens
    the next. ``fused`` runs both as one C++ kernel (``backends/csrc/layer_ops.cpp``).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            out = torch.empty_like(x)
            kernels().rms_norm(out, x, self.weight, self.eps)
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the sum is written into ``residual``."""
        if not self.fused:
            residual = residual.add_(x)
            return self(residual), residual
        out = torch.empty_like(x)
        kernels().add_rms_norm(out, residual, x, self.weight, self.eps)
        return out, residual


@dataclass(frozen=True)
class StepRope:
    """One step's RoPE input, shared by every layer: the positions, and their cos/sin rows
    (``[T, 1, head_dim]``) unless the fused kernel reads the tables itself."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_position_embeddings``, in the model dtype;
    ``fused`` rotates q and k in place with one C++ kernel (``backends/csrc/layer_ops.cpp``)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        inv_freq, scale = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (table.cos() * scale).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (table.sin() * scale).to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> StepRope:
        if self.fused:
            return StepRope(positions, None, None)
        return StepRope(positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def rotate(self, qkv: torch.Tensor, rope: StepRope, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split fused ``[T, (H + 2 Hkv) * D]`` projections into q, k, v ``[T, heads, D]`` with q and
        k rotated (views into ``qkv`` when fused)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
        if rope.cos is None or rope.sin is None:  # rotates q and k in place, through the views
            kernels().rotary_embedding(qkv, rope.positions, self.cos, self.sin, num_heads + num_kv_heads, head_dim)
            return q, k, v
        return _apply_rope(q, rope.cos, rope.sin), _apply_rope(k, rope.cos, rope.sin), v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
