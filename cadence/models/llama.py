"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2; Qwen3 adds q/k norms, :mod:`cadence.models.qwen3`)
over the paged KV cache.

Numerics follow Hugging Face transformers op for op (RMSNorm in fp32 then cast back, RoPE tables
computed in fp32 then cast, SDPA scale ``head_dim ** -0.5``) so that greedy decoding matches it
token for token in fp32. Two things differ in layout only: q/k/v are one fused linear and
gate/up another, so each layer runs two GEMMs fewer. The norm and rotary layers are shared with
other families (:mod:`cadence.models.layers`).

Under tensor parallelism (a :class:`~cadence.distributed.ParallelGroup` of more than one rank) each
rank builds only its shard: its attention heads and MLP columns (column-parallel q/k/v and gate/up,
row-parallel o and down with an all-reduce) and its vocabulary rows (embedding and LM head).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from cadence.backends.base import AttentionBackend
from cadence.backends.cpu_kernels import runs_kernels
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.layers import (
    CheckpointTensor,
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayer,
    VocabParallelEmbedding,
    load_parameter,
)
from cadence.distributed.partition import even_split, head_shard
from cadence.models.decoder_stack import DecoderStack, LayerParts, build_stack
from cadence.models.layers import RMSNorm, RotaryEmbedding, StepRope, head_dim_of, layer_windows
from cadence.models.registry import CausalLM

# Checkpoint projection -> (our fused projection, shard index within it).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """This rank's attention heads (all of them at world size 1)."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, qkv_bias: bool, o_bias: bool,
                 group: ParallelGroup, rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device | str,
                 qk_norm: bool = False) -> None:
        super().__init__()
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads, group.rank, group.world_size)
        self.num_heads = heads.q.size
        self.num_kv_heads = heads.kv.size
        self.head_dim = head_dim_of(config)
        q, kv = heads.q.scaled(self.head_dim), heads.kv.scaled(self.head_dim)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], qkv_bias, dtype, device)
        self.o_proj = RowParallelLinear(q, config.hidden_size, o_bias, group, dtype, device)
        self.backend = backend
        # Shared by every layer, not a submodule of each (its tables would be counted 30 times).
        self._rotary = (rotary,)
        # Qwen3: RMSNorm over each q and k head before RoPE (one weight of head_dim, every rank all of it).
        self._qk_norm: tuple[nn.Module, nn.Module] | None = None
        if qk_norm:
            self.q_norm: nn.Module = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, rotary.fused)
            self.k_norm: nn.Module = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, rotary.fused)
            self._qk_norm = (self.q_norm, self.k_norm)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: object) -> torch.Tensor:
        q, k, v = self._rotary[0].rotate(self.qkv_proj(x), rope, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self._qk_norm)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """This rank's columns of the intermediate layer (all of them at world size 1)."""

    def __init__(self, config: PretrainedConfig, group: ParallelGroup, dtype: torch.dtype,
                 device: torch.device | str, fused: bool, hidden_act: str | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        act = hidden_act or config.hidden_act  # Gemma names it hidden_activation
        columns = even_split(config.intermediate_size, group.rank, group.world_size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [columns, columns], bias, dtype, device)
        self.down_proj = RowParallelLinear(columns, config.hidden_size, bias, group, dtype, device)
        self.act = ACT2FN[act]
        # SiLU and the multiply in C++ (ColumnParallelLinear.silu_and_mul)
        self.fused = fused and act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.out_sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """``h + attn(norm(h))``, then ``h + mlp(norm(h))``, with each residual add deferred into the
    norm after it: a layer takes the previous layer's MLP output and the residual stream (None at
    the first layer) and returns its own pair."""

    def __init__(self, config: PretrainedConfig, attention: Attention, mlp: nn.Module, dtype: torch.dtype,
                 device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: StepRope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x, residual = self.post_attention_layernorm.add_forward(
            self.self_attn(x, rope, kv_cache, attn_metadata), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: list[DecoderLayer], group: ParallelGroup,
                 dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused)


class LlamaForCausalLM(CausalLM):
    """A decoder-only Llama-family model that reads and writes K/V through an attention backend.

    Parameter names are Hugging Face's, except the fused ``qkv_proj`` and ``gate_up_proj``;
    :meth:`load_weights` takes Hugging Face names. Parameters are uninitialised until then. A layer
    with a sliding window (Mistral, Qwen2 with ``use_sliding_window``: see
    :func:`~cadence.models.layers.layer_windows`) calls a backend object built with it.
    ``group`` says which tensor-parallel shard this instance holds; head counts are this rank's.
    """

    # (bias on q/k/v, bias on o); Llama reads both from config.attention_bias.
    fixed_biases: ClassVar[tuple[bool, bool] | None] = None
    # Per-head RMSNorm of q and k between the projection and RoPE (q_norm, k_norm: Qwen3).
    qk_norm: ClassVar[bool] = False

    def __init__(self, hf_config: PretrainedConfig, backend_cls: type[AttentionBackend], dtype: torch.dtype,
                 device: torch.device | str = "cpu", group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.head_dim = head_dim_of(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads, backends = layer_backends(hf_config, backend_cls, group, self.head_dim ** -0.5)
        self.attn_backend = backends[0]
        qkv_bias, o_bias = self._biases(hf_config)
        # The per-token ops run as C++ kernels where they can (see backends/cpu_kernels.py).
        fused = runs_kernels(torch.device(device), dtype)
        self.rotary_emb = RotaryEmbedding(hf_config, dtype, device, fused)
        layers = [
            DecoderLayer(hf_config, Attention(hf_config, backends[layer], qkv_bias, o_bias, group,
                                              self.rotary_emb, dtype, device, self.qk_norm),
                         self._mlp(layer, group, dtype, device, fused), dtype, device, fused)
            for layer in range(self.num_layers)
        ]
        self.model = LlamaModel(hf_config, layers, group, dtype, device, fused)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, group, dtype, device,
                                                  lookups=False)
        # The layers as one C++ call, where they all run on the CPU kernels (set by prepare_fast_path).
        self.decoder_stack: DecoderStack | None = None

    def _mlp(self, layer: int, group: ParallelGroup, dtype: torch.dtype, device: torch.device | str,
             fused: bool) -> nn.Module:
        """Layer ``layer``'s feed-forward block, ``[T, hidden] -> [T, hidden]`` (all-reduced): the dense
        MLP here; a family may return another module for some layers (a mixture of experts)."""
        return MLP(self.config, group, dtype, device, fused)

    @classmethod
    def _biases(cls, config: PretrainedConfig) -> tuple[bool, bool]:
        if cls.fixed_biases is not None:
            return cls.fixed_biases
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head.weight

    @property
    def _lm_head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[object],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step's ``T`` tokens; return fp32 logits ``[B, vocab]`` of the rows ``logits_indices``.

        ``input_ids`` and ``positions`` are ``[T]`` int64 on the model's device; ``kv_caches``
        holds one ``(k_cache, v_cache)`` per layer and ``attn_metadata`` one metadata per layer
        (built by this model's backend's ``build_metadata`` for the layer's KV cache group).
        """
        rope = self.rotary_emb(positions)
        h, residual = self.model.embed_tokens(input_ids), None
        if self.decoder_stack is not None and self.decoder_stack.runs(kv_caches, attn_metadata):
            h, residual = self.decoder_stack(h, positions, kv_caches, attn_metadata)
        else:
            for layer, kv_cache, metadata in zip(self.model.layers, kv_caches, attn_metadata, strict=True):
                h, residual = layer(h, residual, rope, kv_cache, metadata)
        # The norm is per token and the LM head is the largest GEMM: run both on sampled rows only.
        assert residual is not None  # every model has layers
        h, _ = self.model.norm.add_forward(h[logits_indices], residual[logits_indices])
        return self._lm_head.logits(h).float()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy Hugging Face-named tensors (this rank's shard of each) into the parameters,
        converting to the model dtype.

        :raises ValueError: a name this model does not have, a shape that does not match, or a
            parameter the weights never provided.
        """
        load_checkpoint(self, weights, self.tie_word_embeddings)

    def _expected_shards(self) -> set[tuple[str, int]]:
        return expected_shards(self)

    def prepare_fast_path(self) -> None:
        self.decoder_stack = self._decoder_stack()

    def _decoder_stack(self) -> DecoderStack | None:
        """The layers as one C++ call (:mod:`cadence.models.decoder_stack`), or None where one of
        them is not Llama's own (a mixture of experts, a family's own modules) or not the kernels'."""
        layers = list(self.model.layers)
        if not all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention and type(layer.mlp) is MLP
                   and layer.mlp.fused for layer in layers):
            return None
        first = cast(Attention, layers[0].self_attn)
        return build_stack(self.dtype, first.num_heads, first.num_kv_heads, first.head_dim,
                           (self._stack_parts(layer) for layer in cast(list[DecoderLayer], layers)))

    def _stack_parts(self, layer: DecoderLayer) -> LayerParts:
        attention, mlp = layer.self_attn, cast(MLP, layer.mlp)
        return LayerParts([attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj],
                          [layer.input_layernorm, layer.post_attention_layernorm],
                          cast(tuple[RMSNorm, ...], attention._qk_norm or ()), self.rotary_emb, attention.backend)


def layer_backends(config: PretrainedConfig, backend_cls: type[AttentionBackend], group: ParallelGroup, scale: float,
                   logits_soft_cap: float | None = None) -> tuple[int, list[AttentionBackend]]:
    """This rank's KV head count, and each layer's attention backend object: one per sliding window
    (:func:`~cadence.models.layers.layer_windows`), shared by the layers that have it."""
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, group.rank, group.world_size)
    windows = layer_windows(config)
    head_dim = head_dim_of(config)
    backends = {window: backend_cls(heads.q.size, heads.kv.size, head_dim, scale, sliding_window=window,
                                    logits_soft_cap=logits_soft_cap) for window in windows}
    return heads.kv.size, [backends[window] for window in windows]


# Loads one checkpoint tensor; returns the (parameter, shard)s it filled, or None: no such tensor.
TensorLoader = Callable[[str, CheckpointTensor], list[tuple[str, int]] | None]


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], tied: bool,
                    expected: set[tuple[str, int]] | None = None, load_one: TensorLoader | None = None) -> None:
    """Load Hugging Face-named tensors into ``model``, each into this rank's shard, with ``load_one``
    (default :func:`load_named`: parameters bear the checkpoint's names but for Llama's fused
    projections); ``expected``: the (parameter, shard)s it must fill (default
    :func:`expected_shards`); ``tied``: skip a checkpoint's ``lm_head.weight`` (the embedding
    serves as the head).

    :raises ValueError: a name the model does not have, a shape that does not match, or a
        parameter the weights never provided.
    """
    expected = expected_shards(model) if expected is None else expected
    load_one = load_one or functools.partial(load_named, dict(model.named_modules()), expected)
    loaded: set[tuple[str, int]] = set()
    for hf_name, tensor in weights:
        if "rotary_emb." in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        try:
            filled = load_one(hf_name, tensor)
        except ValueError as exc:
            raise ValueError(f"{hf_name}: {exc}") from None
        if filled is None:
            raise ValueError(f"unexpected weight {hf_name!r} for {type(model).__name__}")
        loaded.update(filled)
    missing = sorted(f"{name}[{shard}]" for name, shard in expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def load_named(modules: dict[str, nn.Module], expected: set[tuple[str, int]], hf_name: str,
               tensor: CheckpointTensor) -> list[tuple[str, int]] | None:
    """Load ``tensor`` into the parameter (and shard) of its name, if ``expected`` has it."""
    name, shard = our_name(hf_name)
    if (name, shard) not in expected:
        return None
    module_name, _, param_name = name.rpartition(".")
    load_parameter(modules[module_name], param_name, tensor, shard)
    return [(name, shard)]


def expected_shards(model: nn.Module) -> set[tuple[str, int]]:
    """(parameter, shard) for every checkpoint tensor ``model`` needs: a fused layer needs several."""
    modules = dict(model.named_modules())
    expected: set[tuple[str, int]] = set()
    for name, _ in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        shards = module.num_shards if isinstance(module, ShardedLayer) else 1
        expected.update((name, shard) for shard in range(shards))
    return expected


def our_name(hf_name: str) -> tuple[str, int]:
    """Our parameter name for a Hugging Face one, and the shard it fills (0 when not fused)."""
    parts = hf_name.split(".")
    fused = _FUSED_SHARDS.get(parts[-2]) if len(parts) >= 2 else None
    if fused is None:
        return hf_name, 0
    parts[-2] = fused[0]
    return ".".join(parts), fused[1]


class MistralForCausalLM(LlamaForCausalLM):
    fixed_biases = (False, False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    fixed_biases = (True, False)
