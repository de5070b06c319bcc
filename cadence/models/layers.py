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


def kernels() -> Any:
    """The C++ CPU kernels, which a ``fused`` module was built to use (so they are loaded)."""
    return cpu_ops()


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head size: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window of the layers that use one (None: every layer sees the whole context).

    A query at position ``p`` then sees keys at ``p - window < position <= p`` (Hugging Face's
    convention); the backends take it per layer (:func:`layer_windows`).
    """
    return next((window for window in layer_windows(config) if window is not None), None)


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window, None for a layer that sees the whole context: as transformers
    decides, by ``layer_types`` where the config has them (Gemma 2/3, Qwen2 with
    ``use_sliding_window``), else ``sliding_window`` for every layer (Mistral, Mixtral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * config.num_hidden_layers
    if layer_types is None:
        return [int(window)] * config.num_hidden_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def rope_parameters_of(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of ``layer_type``'s layers (Gemma 3 keeps one set per type, keyed by
    ``sliding_attention`` / ``full_attention``), or the model's one set."""
    params: dict[str, Any] = config.rope_parameters
    return params[layer_type] if layer_type is not None else params


def rotary_dim_of(config: PretrainedConfig) -> int:
    """How many leading dims of each q/k head RoPE rotates (Phi-4-mini: 96 of 128); the rest pass
    through. ``partial_rotary_factor`` (in ``rope_parameters``) times the head size, as transformers."""
    return int(head_dim_of(config) * config.rope_parameters.get("partial_rotary_factor", 1.0))


def longrope_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-4-mini): one factor set for the whole model, and the cos/sin scale.

    transformers chooses per forward pass: the long factors when the sequence (its last position
    + 1) is longer than ``original_max_position_embeddings``, else the short ones; ``generate``
    prefills a prompt in one pass and, the step a sequence grows past that length, drops the KV
    cache and recomputes it all with the long factors. Here K/V are cached rotated, shared through
    the prefix cache and prefilled in chunks, so a block cannot follow its request's future length:
    the set is chosen once, as vLLM does: the long factors when the model's context is longer than
    the original one. Greedy decoding then equals transformers' for every sequence longer than the
    original context, whatever the batching, chunking, prefix hits or preemptions; shorter
    sequences run with the long factors too (transformers would use the short). A model whose
    context is not longer uses the short factors: exact for every sequence it can run. The scale
    (``attention_factor``, from ``max_position_embeddings / original``) is the same for both sets.
    """
    original = config.rope_parameters["original_max_position_embeddings"]
    long = config.max_position_embeddings > original
    # seq_len past the original context is how transformers asks for the long set.
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1 if long else None)
    return inv_freq, float(scale)


def rope_inv_freq(config: PretrainedConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[rotary_dim // 2]`` (fp32, see :func:`rotary_dim_of`) and the
    cos/sin scale, as in transformers; ``layer_type``: see :func:`rope_parameters_of`.

    :raises ValueError: the RoPE type is unknown.
    """
    params = rope_parameters_of(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        # transformers keeps the default rule on each model class; this is the same expression.
        dim = rotary_dim_of(config)
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "longrope":
        return longrope_inv_freq(config)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        supported = sorted({"default", *ROPE_INIT_FUNCTIONS})
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(supported)}")
    # ("dynamic" only rescales past max_position_embeddings, which we never reach: its table is exact.)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, exactly as ``Gemma3RMSNorm`` (and Gemma 2's): normalised and scaled by
    ``1 + weight`` in fp32, cast back last (Llama casts before its weight). Checkpoints hold the
    weight as an offset from one (zeros initialised). ``fused``: one C++ kernel
    (``backends/csrc/layer_ops.cpp``) with the fp32 scale worked out once per version of the weight
    (the torch path's six ops, times six norms a layer, took 3 ms of Gemma 3 270M's 20 ms decode step)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
        self.eps = eps
        self.fused = fused
        self._scale: tuple[int, torch.Tensor] | None = None  # (the weight's version, 1 + weight in fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            out = torch.empty_like(x)
            kernels().scaled_rms_norm(out, x, self.fp32_scale(), self.eps)
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def fp32_scale(self) -> torch.Tensor:
        """``1 + weight`` in fp32, the fused kernel's scale: worked out once per version of the weight."""
        version = self.weight._version  # bumped by every in-place write, loading included
        if self._scale is None or self._scale[0] != version:
            self._scale = (version, 1.0 + self.weight.detach().float())
        return self._scale[1]


@dataclass(frozen=True)
class StepRope:
    """One step's RoPE input, shared by every layer: the positions, and their cos/sin rows
    (``[T, 1, head_dim]``) unless the fused kernel reads the tables itself."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[positions, rotary_dim]`` in the model dtype; ``fused`` rotates q and k in
    place with one C++ kernel (``backends/csrc/layer_ops.cpp``), which turns whole heads: with
    partial rotary (``rotary_dim < head_dim``) the torch path turns the leading dims instead.

    On the CPU the tables start at 4,096 positions and double when a step needs more, up to
    ``max_position_embeddings``: the four tables of Gemma 3 270M's 32,768 positions would be 67 MB
    beside its 250 MB of quantized weights (docs/quantization.md), and a step's largest position
    costs one reduction. Elsewhere they cover every position from the start."""

    cos: torch.Tensor
    sin: torch.Tensor
    _FIRST_ROWS = 4096

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str, fused: bool,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.fused = fused
        self.dtype = dtype
        self.max_positions = int(config.max_position_embeddings)
        self.inv_freq, self.scale = rope_inv_freq(config, layer_type)
        lazy = torch.device(device).type == "cpu"
        self._tables(min(self.max_positions, self._FIRST_ROWS) if lazy else self.max_positions, device)
        self.kernel_rotates = fused and self.cos.shape[1] == head_dim_of(config)

    def _tables(self, rows: int, device: torch.device | str) -> None:
        freqs = torch.arange(rows, dtype=torch.float)[:, None] * self.inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (table.cos() * self.scale).to(device=device, dtype=self.dtype), persistent=False)
        self.register_buffer("sin", (table.sin() * self.scale).to(device=device, dtype=self.dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> StepRope:
        rows = self.cos.shape[0]
        if rows < self.max_positions and positions.numel() and (needed := int(positions.max()) + 1) > rows:
            self._tables(min(self.max_positions, max(needed, 2 * rows)), self.cos.device)
        if self.kernel_rotates:
            return StepRope(positions, None, None)
        return StepRope(positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def rotate(self, qkv: torch.Tensor, rope: StepRope, num_heads: int, num_kv_heads: int, head_dim: int,
               qk_norm: tuple[nn.Module, nn.Module] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split fused ``[T, (H + 2 Hkv) * D]`` projections into q, k, v ``[T, heads, D]`` with q and
        k rotated (views into ``qkv`` when fused).

        ``qk_norm`` (Qwen3's ``q_norm``, ``k_norm``: one RMSNorm of size ``D`` each, shared by every
        head) normalises each head of q and k first, in place in ``qkv``, between the split and the
        rotation, as transformers' ``Qwen3Attention`` does; without it nothing extra runs.
        """
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
        if qk_norm is not None:
            norm_heads_(q, qk_norm[0])
            norm_heads_(k, qk_norm[1])
        if rope.cos is None or rope.sin is None:  # rotates q and k in place, through the views
            kernels().rotary_embedding(qkv, rope.positions, self.cos, self.sin, num_heads + num_kv_heads, head_dim)
            return q, k, v
        return _apply_rope(q, rope.cos, rope.sin), _apply_rope(k, rope.cos, rope.sin), v


def norm_heads_(heads: torch.Tensor, norm: nn.Module) -> None:
    """``norm`` over the last dimension of ``heads`` (``[T, heads, D]``, a view into the fused
    projections), written back in place: the kernel wants dense rows, so the heads go through a
    ``[T * heads, D]`` copy (a view when ``T`` is 1)."""
    rows = heads.reshape(-1, heads.shape[-1])
    heads.copy_(norm(rows).view(heads.shape))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary: the rest of each head passes through
        x_rot = x[..., :rotary_dim]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x[..., rotary_dim:]), dim=-1)
    return x * cos + _rotate_half(x) * sin
