"""Mixture-of-experts families on the Llama layout: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention, norms, embeddings and the LM head are :mod:`cadence.models.llama`'s; the feed-forward
block of each sparse layer is a :class:`~cadence.models.moe_layers.SparseMoeBlock` (router, experts
batched by expert, Qwen2-MoE's gated shared expert; tensor parallelism by expert columns), and the
other layers keep the dense MLP. Which layers are sparse, and how each family routes:

- **Mixtral**: every layer; ``num_local_experts`` experts of ``intermediate_size``, top
  ``num_experts_per_tok``, weights always renormalised (kept in fp32). Its checkpoints name the block
  ``block_sparse_moe`` and the experts' matrices ``w1`` (gate), ``w3`` (up), ``w2`` (down).
- **Qwen2-MoE**: layer ``i`` when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
  decoder_sparse_step == 0``; ``num_experts`` of ``moe_intermediate_size``, top ``num_experts_per_tok``,
  renormalised when ``norm_topk_prob``, plus a shared expert of ``shared_expert_intermediate_size``
  behind a sigmoid gate; biases on q/k/v (``qkv_bias``), none on o.
- **Qwen3-MoE**: Qwen2-MoE's layers and routing, no shared expert, Qwen3's per-head q/k RMSNorm
  (Llama's ``qk_norm``), biases on q/k/v and o from ``attention_bias``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from cadence.distributed.group import ParallelGroup
from cadence.distributed.layers import CheckpointTensor
from cadence.models.llama import LlamaForCausalLM, load_checkpoint, load_named
from cadence.models.moe_layers import MoeSpec, SparseMoeBlock, StackedExperts

# One expert's matrix (experts.<e>.<projection>.weight), and transformers 5's stacked tensors.
_PER_EXPERT = re.compile(r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight")
_STACKED = re.compile(r"(?P<module>.+\.experts)\.(?P<param>gate_up_proj|down_proj)")
_PROJECTIONS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-layout decoder whose sparse layers (:meth:`is_sparse`) run a mixture of experts
    (:meth:`moe_spec`). Loads checkpoints with one tensor per expert and projection, or stacked."""

    # Checkpoint module names -> ours (Mixtral calls the block block_sparse_moe).
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        raise NotImplementedError

    @classmethod
    def is_sparse(cls, config: PretrainedConfig, layer: int) -> bool:
        """Whether layer ``layer`` runs the experts (every layer unless a family says otherwise)."""
        return True

    def _mlp(self, layer: int, group: ParallelGroup, dtype: torch.dtype, device: torch.device | str,
             fused: bool) -> nn.Module:
        if not self.is_sparse(self.config, layer):
            return super()._mlp(layer, group, dtype, device, fused)
        return SparseMoeBlock(self.config, self.moe_spec(self.config), group, dtype, device, fused)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy Hugging Face-named tensors (this rank's shard of each) into the parameters, then
        prepack the experts for the bf16 GEMM where it runs (:meth:`StackedExperts.pack`).

        :raises ValueError: a name this model does not have, a shape that does not match, or a
            parameter the weights never provided.
        """
        modules = dict(self.named_modules())
        expected = self._expected_shards()

        def load_one(hf_name: str, tensor: CheckpointTensor) -> list[tuple[str, int]] | None:
            name = hf_name
            for theirs, ours in self.renames:
                name = name.replace(theirs, ours)
            if ".experts." in name:
                return _load_experts(modules, name, tensor)
            return load_named(modules, expected, name, tensor)

        load_checkpoint(self, weights, self.tie_word_embeddings, expected, load_one)
        for module in modules.values():
            if isinstance(module, StackedExperts):
                module.pack()

    def _expected_shards(self) -> set[tuple[str, int]]:
        expected = super()._expected_shards()
        for prefix, module in self.named_modules():
            if isinstance(module, StackedExperts):
                for param, count in module.shard_counts().items():
                    expected.update((f"{prefix}.{param}", shard) for shard in range(count))
        return expected


class MixtralForCausalLM(MoeForCausalLM):
    fixed_biases = (False, False)
    renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=True, fp32_weights=True)


class QwenMoeRouting(MoeForCausalLM):
    """The Qwen MoEs' experts and choice of sparse layers (a shared expert where the config sizes one)."""

    @classmethod
    def moe_spec(cls, config: PretrainedConfig) -> MoeSpec:
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       renormalize=bool(config.norm_topk_prob),
                       shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)

    @classmethod
    def is_sparse(cls, config: PretrainedConfig, layer: int) -> bool:
        """transformers' rule: not in ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer."""
        only_mlp = getattr(config, "mlp_only_layers", None) or []
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return layer not in only_mlp and config.num_experts > 0 and (layer + 1) % step == 0


class Qwen2MoeForCausalLM(QwenMoeRouting):
    @classmethod
    def _biases(cls, config: PretrainedConfig) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen3MoeForCausalLM(QwenMoeRouting):
    """Qwen2-MoE's routing without the shared expert, Qwen3's per-head q/k RMSNorm before RoPE
    (:mod:`cadence.models.qwen3`), and biases on q/k/v and o from ``attention_bias``."""

    qk_norm = True


def _load_experts(modules: dict[str, nn.Module], name: str, tensor: CheckpointTensor) -> list[tuple[str, int]] | None:
    """Load one expert tensor (named as ours: per expert, or stacked); the (parameter, shard)s it
    filled, or None when the model has no such tensor."""
    for pattern in (_PER_EXPERT, _STACKED):
        match = pattern.fullmatch(name)
        experts = modules.get(match["module"]) if match else None
        if match is None or not isinstance(experts, StackedExperts):
            continue
        if pattern is _STACKED:
            filled = experts.load_stacked(match["param"], tensor)
        elif match["projection"] in _PROJECTIONS:
            filled = [experts.load_expert(int(match["expert"]), _PROJECTIONS[match["projection"]], tensor)]
        else:
            return None
        return [(f"{match['module']}.{param}", shard) for param, shard in filled]
    return None
