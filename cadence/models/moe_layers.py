"""Sparse mixture-of-experts feed-forward blocks: a router, stacked SiLU-gated experts and an optional
shared expert, computed batched by expert (the families that use them: :mod:`cadence.models.moe`).

Numerics follow Hugging Face transformers (``modeling_mixtral.py``, ``modeling_qwen2_moe.py``):

- **Routing**: router logits ``x @ W_r.T`` in the model dtype, softmax in fp32, top-k, the k weights
  renormalised to sum to one where the family does (Mixtral always, the Qwen MoEs when
  ``norm_topk_prob``); Mixtral keeps them in fp32, the Qwen MoEs cast them back to the model dtype.
- **Experts, batched by expert**: the ``T * k`` (token, expert) pairs are sorted by expert (stably, so
  each token's contributions keep transformers' ascending expert order); each active expert runs one
  gate/up GEMM and one down GEMM over all of its rows; the outputs are scaled by their routing weights
  and scatter-added into the tokens' rows with one ``index_add_``. Never token by token.
- **Shared expert** (Qwen2-MoE): a dense SiLU-gated MLP on every token, scaled by ``sigmoid(x @ w_g)``
  and added to the routed experts' sum.

Weights are stacked ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and ``[E, H, I]``,
and load from either checkpoint layout: one tensor per expert and projection (``experts.3.w1.weight``,
``experts.3.gate_proj.weight`` ...), or transformers 5's stacked ``experts.gate_up_proj`` /
``experts.down_proj``. In bf16, where one of cadence's bf16 GEMMs runs (``backends/dense_gemm.py``: AVX512-BF16,
or AVX2 where oneDNN lacks bf16), each expert's matrices are then prepacked into its panels and
stacked (:meth:`StackedExperts.pack`); elsewhere they stay plain and run through ``F.linear``.

Under tensor parallelism each rank holds its contiguous share of every expert's intermediate
dimension (and of the shared expert's): column-parallel gate/up, row-parallel down. The router and
the shared expert's gate are replicated, so every rank routes every token alike, and the block's
partial sum (routed experts plus shared expert) takes one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from cadence.backends import dense_gemm
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, linear
from cadence.distributed.partition import even_split
from cadence.models.layers import kernels


@dataclass(frozen=True)
class MoeSpec:
    """What a family's MoE blocks are: ``num_experts`` experts of ``intermediate_size`` columns each,
    ``top_k`` of them per token; ``renormalize``: the k weights are rescaled to sum to one;
    ``fp32_weights``: they multiply the expert outputs in fp32 (Mixtral), not the model dtype;
    ``shared_intermediate_size``: the shared expert's columns (0: none)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    fp32_weights: bool = False
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"a token routed to {self.top_k} experts of {self.num_experts}: the config's "
                             "num_experts_per_tok must be between 1 and its number of experts")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, both ``[T, top_k]``: each token's ``top_k`` most probable experts (by the
    fp32 softmax of ``logits [T, E]``) and their probabilities (fp32), renormalised if asked."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: loading overwrites every parameter (and the model checks that it did).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy(target: torch.Tensor, tensor: CheckpointTensor, expected: tuple[int, ...], index: Any) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match the model's {expected}")
    with torch.no_grad():
        target.copy_(tensor[index])


class ReplicatedLinear(nn.Module):
    """``x @ W.T`` with the whole (small) weight on every rank: the router, the shared expert's gate."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StackedExperts(nn.Module):
    """``num_experts`` SiLU-gated MLPs, this rank's columns of each: ``gate_up_proj [E, 2 * c, H]``
    (gate rows, then up rows) and ``down_proj [E, H, c]``.

    Checkpoint tensors fill shards: ``gate_up_proj`` has ``2 * E`` (expert ``e``'s gate is shard ``e``,
    its up ``E + e``), ``down_proj`` has ``E``; a stacked checkpoint tensor fills all of its own.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 group: ParallelGroup, dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.columns = even_split(intermediate_size, group.rank, group.world_size)
        cols = self.columns.size
        self.gate_up_proj = _weight(num_experts, 2 * cols, hidden_size, dtype=dtype, device=device)
        self.down_proj = _weight(num_experts, hidden_size, cols, dtype=dtype, device=device)
        self.act = ACT2FN[hidden_act]
        # SiLU and the multiply as one C++ kernel (backends/csrc/layer_ops.cpp), as the dense MLP does
        self.fused = fused and hidden_act == "silu"

    def shard_counts(self) -> dict[str, int]:
        """How many checkpoint shards fill each parameter."""
        return {"gate_up_proj": 2 * self.num_experts, "down_proj": self.num_experts}

    def load_expert(self, expert: int, projection: str, tensor: CheckpointTensor) -> tuple[str, int]:
        """Load expert ``expert``'s ``projection`` (``gate``, ``up`` or ``down``), a checkpoint tensor
        ``[I, H]`` (gate, up) or ``[H, I]`` (down); returns the (parameter, shard) it filled.

        :raises ValueError: the expert does not exist or the shape does not match.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.num_experts}")
        cols, hidden, inter = self.columns, self.hidden_size, self.intermediate_size
        if projection == "down":
            _copy(self.down_proj[expert], tensor, (hidden, inter), (slice(None), cols.indices))
            return "down_proj", expert
        part = 0 if projection == "gate" else 1
        _copy(self.gate_up_proj[expert, part * cols.size:(part + 1) * cols.size], tensor, (inter, hidden), cols.indices)
        return "gate_up_proj", part * self.num_experts + expert

    def load_stacked(self, name: str, tensor: CheckpointTensor) -> list[tuple[str, int]]:
        """Load transformers 5's stacked ``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``; returns
        every (parameter, shard) it filled.

        :raises ValueError: the shape does not match.
        """
        experts, cols, hidden, inter = self.num_experts, self.columns, self.hidden_size, self.intermediate_size
        if name == "down_proj":
            _copy(self.down_proj, tensor, (experts, hidden, inter), (slice(None), slice(None), cols.indices))
            return [("down_proj", e) for e in range(experts)]
        expected = (experts, 2 * inter, hidden)
        _copy(self.gate_up_proj[:, :cols.size], tensor, expected, (slice(None), cols.indices))
        up_rows = slice(inter + cols.start, inter + cols.stop)
        _copy(self.gate_up_proj[:, cols.size:], tensor, expected, (slice(None), up_rows))
        return [("gate_up_proj", s) for s in range(2 * experts)]

    def pack(self) -> None:
        """Prepack each expert's matrices into a bf16 GEMM's panels (as
        :func:`~cadence.distributed.layers.pack_weights` does the dense layers'), where
        ``dense_gemm.packs_into_panels`` says one takes them; a no-op otherwise. Loading after packing
        is not supported."""
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            if weight.dim() == 3 and dense_gemm.packs_into_panels(weight[0]):
                packed = torch.stack([dense_gemm.pack(w) for w in weight.detach()])
                setattr(self, name, nn.Parameter(packed, requires_grad=False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for each token:
        ``x [T, H]``, ``weights`` and ``experts [T, k]`` -> ``[T, H]`` in ``x``'s dtype."""
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # pairs grouped by expert, each token's in ascending expert order
        token = order // top_k
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count:
                out[start:start + count] = self._expert(expert, rows[start:start + count])
                start += count
        # In the weights' dtype (fp32 for Mixtral, as transformers), then back to x's.
        out = (out * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        cols = self.columns.size
        gate_up = linear(rows, self.gate_up_proj[expert], None, 2 * cols)
        if self.fused:
            act = gate_up.new_empty(gate_up.shape[0], cols)
            kernels().silu_and_mul(act, gate_up)
        else:
            gate, up = gate_up.split(cols, dim=-1)
            act = self.act(gate) * up
        return linear(act, self.down_proj[expert], None, self.hidden_size)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: this rank's columns of a SiLU-gated MLP, its down projection's
    partial sum left for the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, group: ParallelGroup,
                 dtype: torch.dtype, device: torch.device | str, fused: bool) -> None:
        super().__init__()
        columns = even_split(intermediate_size, group.rank, group.world_size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [columns, columns], False, dtype, device)
        # A row-parallel layer that never all-reduces on its own: SparseMoeBlock sums once for all.
        self.down_proj = RowParallelLinear(columns, hidden_size, False, SINGLE_RANK, dtype, device)
        self.act = ACT2FN[hidden_act]
        self.fused = fused and hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            kernels().silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = gate_up.split(self.gate_up_proj.out_sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoeBlock(nn.Module):
    """One layer's feed-forward block, ``[T, H] -> [T, H]``: the routed experts' weighted sum, plus the
    gated shared expert where the family has one; all-reduced once under tensor parallelism.

    Parameter names are transformers': ``gate`` (the router), ``experts.gate_up_proj`` /
    ``experts.down_proj`` (stacked), ``shared_expert.*`` and ``shared_expert_gate``.
    """

    def __init__(self, config: PretrainedConfig, spec: MoeSpec, group: ParallelGroup, dtype: torch.dtype,
                 device: torch.device | str, fused: bool) -> None:
        super().__init__()
        hidden, act = config.hidden_size, config.hidden_act
        self.spec = spec
        self.group = group
        self.gate = ReplicatedLinear(hidden, spec.num_experts, dtype, device)
        self.experts = StackedExperts(spec.num_experts, hidden, spec.intermediate_size, act, group, dtype, device,
                                      fused)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden, spec.shared_intermediate_size, act, group, dtype, device, fused)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, experts = route(logits, self.spec.top_k, self.spec.renormalize)
        if not self.spec.fp32_weights:
            weights = weights.to(logits.dtype)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce(out)

