"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

What differs from Llama (:mod:`cadence.models.llama`, whose attention, MLP and checkpoint loading
this reuses), op for op as transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``:

- Embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the model dtype first.
- RMSNorm scaled by ``1 + weight`` in fp32 (:class:`~cadence.models.layers.GemmaRMSNorm`), four per
  layer: before and after attention, before and after the MLP, each sub-layer's output normalised
  before its residual add.
- GeGLU: ``gelu_pytorch_tanh(gate) * up`` (``hidden_activation``).
- Attention scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``; Gemma 2 soft-caps
  its scores (``attn_logit_softcapping``) and its logits (``final_logit_softcapping``).
- Layers of two kinds (``layer_types``): sliding-window layers see the last ``sliding_window`` keys,
  global ones everything (:func:`~cadence.models.layers.layer_windows`); one backend object per kind.
- Gemma 3 normalises each q and k head (``q_norm``, ``k_norm``, Gemma's RMSNorm) before RoPE, and
  keeps one set of RoPE parameters per layer kind (a local base of 10k for sliding layers, 1M with
  optional linear scaling for global ones): one table per kind, each layer rotating with its own.

Tensor parallelism shards heads, MLP columns and the vocabulary as Llama's layers do; the norms are
whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from cadence.backends.base import AttentionBackend
from cadence.backends.cpu_kernels import runs_kernels
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.layers import CheckpointTensor, VocabParallelEmbedding
from cadence.models.decoder_stack import DecoderStack, LayerParts, build_stack
from cadence.models.layers import GemmaRMSNorm, RotaryEmbedding, StepRope, head_dim_of
from cadence.models.llama import MLP, Attention, layer_backends, load_checkpoint
from cadence.models.registry import CausalLM

# The rope table of a model whose layers share one set of RoPE parameters (Gemma 2).
_ONE_ROPE = "all"


class GemmaAttention(Attention):
    """Llama's attention, with Gemma 3's per-head q/k norms (``1 + weight``) where asked."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, group: ParallelGroup,
                 rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device | str, qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, backend, bias, bias, group, rotary, dtype, device)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, rotary.fused)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, rotary.fused)
            self._qk_norm = (self.q_norm, self.k_norm)


class GemmaDecoderLayer(nn.Module):
    """``h + post_norm(attn(norm(h)))``, then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, config: PretrainedConfig, attention: GemmaAttention, group: ParallelGroup,
                 dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(config, group, dtype, device, fused, hidden_act=config.hidden_activation)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype, device, fused)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype, device, fused)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device, fused)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device, fused)

    def forward(self, h: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: object) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, kv_cache, attn_metadata))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: list[GemmaDecoderLayer], group: ParallelGroup,
                 dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2; :class:`Gemma3ForCausalLM` adds q/k norms and RoPE per layer kind. Parameter names
    are Hugging Face's, except Llama's fused ``qkv_proj`` and ``gate_up_proj``."""

    qk_norm: ClassVar[bool] = False
    embed_scale: torch.Tensor

    def __init__(self, hf_config: PretrainedConfig, backend_cls: type[AttentionBackend], dtype: torch.dtype,
                 device: torch.device | str = "cpu", group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.head_dim = head_dim_of(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads, backends = layer_backends(hf_config, backend_cls, group,
                                                     hf_config.query_pre_attn_scalar ** -0.5,
                                                     getattr(hf_config, "attn_logit_softcapping", None))
        self.attn_backend = backends[0]  # any of them builds the step's metadata
        fused = runs_kernels(torch.device(device), dtype)
        self.rope_kinds = self._rope_kinds(hf_config)
        rotaries = {kind: RotaryEmbedding(hf_config, dtype, device, fused, None if kind == _ONE_ROPE else kind)
                    for kind in set(self.rope_kinds)}
        self.rotary_emb = nn.ModuleDict(rotaries)
        layers = [
            GemmaDecoderLayer(hf_config, GemmaAttention(hf_config, backends[i], group,
                                                        rotaries[self.rope_kinds[i]], dtype, device, self.qk_norm),
                              group, dtype, device, fused)
            for i in range(self.num_layers)
        ]
        self.model = GemmaModel(hf_config, layers, group, dtype, device, fused)
        # transformers rounds the factor to the model dtype before multiplying.
        self.register_buffer("embed_scale", torch.tensor(hf_config.hidden_size ** 0.5, dtype=dtype, device=device),
                             persistent=False)
        self.final_soft_cap: float | None = getattr(hf_config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, group, dtype, device,
                                                  lookups=False)
        # The layers as one C++ call, where they all run on the CPU kernels (set by prepare_fast_path).
        self.decoder_stack: DecoderStack | None = None

    @staticmethod
    def _rope_kinds(config: PretrainedConfig) -> list[str]:
        """Each layer's RoPE table: its layer type where the config keeps RoPE parameters per type."""
        kinds = config.layer_types
        per_kind = all(kind in config.rope_parameters for kind in kinds)
        return list(kinds) if per_kind else [_ONE_ROPE] * config.num_hidden_layers

    @property
    def _lm_head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: Sequence[object],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """As :meth:`cadence.models.llama.LlamaForCausalLM.forward`."""
        ropes = {kind: rotary(positions) for kind, rotary in self.rotary_emb.items()}
        h = self.model.embed_tokens(input_ids) * self.embed_scale
        if self.decoder_stack is not None and self.decoder_stack.runs(kv_caches, attn_metadata):
            h, _ = self.decoder_stack(h, positions, kv_caches, attn_metadata)
        else:
            for layer, kind, kv_cache, metadata in zip(self.model.layers, self.rope_kinds, kv_caches, attn_metadata,
                                                       strict=True):
                h = layer(h, ropes[kind], kv_cache, metadata)
        logits = self._lm_head.logits(self.model.norm(h[logits_indices])).float()
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """As :meth:`cadence.models.llama.LlamaForCausalLM.load_weights`."""
        load_checkpoint(self, weights, self.tie_word_embeddings)

    def prepare_fast_path(self) -> None:
        self.decoder_stack = self._decoder_stack()

    def _decoder_stack(self) -> DecoderStack | None:
        """The layers as one C++ call (:mod:`cadence.models.decoder_stack`), or None where one of
        them is not Gemma's own, its activation not GeLU-tanh, or it does not run on the kernels."""
        layers = list(self.model.layers)
        if self.config.hidden_activation != "gelu_pytorch_tanh" or not all(
                type(layer) is GemmaDecoderLayer and type(layer.self_attn) is GemmaAttention and type(layer.mlp) is MLP
                for layer in layers):
            return None
        first = cast(GemmaAttention, layers[0].self_attn)
        parts = (self._stack_parts(layer, kind)
                 for layer, kind in zip(cast(list[GemmaDecoderLayer], layers), self.rope_kinds, strict=True))
        return build_stack(self.dtype, first.num_heads, first.num_kv_heads, first.head_dim, parts)

    def _stack_parts(self, layer: GemmaDecoderLayer, rope_kind: str) -> LayerParts:
        attention, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm]
        return LayerParts([attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj], norms,
                          cast(tuple[GemmaRMSNorm, ...], attention._qk_norm or ()),
                          cast(RotaryEmbedding, self.rotary_emb[rope_kind]), attention.backend)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (270M, 1B; the text stack of the larger ones)."""

    qk_norm = True
