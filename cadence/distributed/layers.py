"""Layers that hold one tensor-parallel rank's shard of a weight and load it from the full checkpoint.

- :class:`ColumnParallelLinear`: output rows split (q/k/v and gate/up, fused); no communication.
- :class:`RowParallelLinear`: input columns split; an all-reduce sums the partial products.
- :class:`VocabParallelEmbedding`: vocabulary rows split; a masked lookup and an all-reduce, and as
  the LM head an all-gather of each rank's slice of the logits.

Each layer reads only its rows or columns of a checkpoint tensor (``tensor[rows]``, ``tensor[:, cols]``
on a lazily read safetensors slice), so no rank materialises the full model. At world size 1 each
forward is the single ``F.linear`` / ``F.embedding`` call of the unsharded module (or, for bf16 on
the CPU, the GEMM of the prepacked weight: see :func:`pack_weights`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from cadence.backends.cpu_kernels import cpu_ops
from cadence.distributed.group import ParallelGroup
from cadence.distributed.partition import Split


class CheckpointTensor(Protocol):
    """A checkpoint tensor that reads only the part it is indexed with (a torch tensor qualifies)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def __getitem__(self, index: Any, /) -> torch.Tensor: ...


class ShardedLayer(nn.Module):
    """A layer whose parameters are one rank's shard of ``num_shards`` checkpoint tensors each."""

    num_shards: int = 1

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        """Copy this rank's part of checkpoint tensor ``shard`` into parameter ``name``.

        :raises ValueError: the checkpoint tensor's shape does not match the layer's.
        """
        raise NotImplementedError


def load_parameter(module: nn.Module, name: str, tensor: CheckpointTensor, shard: int) -> None:
    """Load ``module.<name>``: its shard for a sharded layer, the whole tensor (replicated) otherwise.

    :raises ValueError: the checkpoint tensor's shape does not match the parameter's.
    """
    if isinstance(module, ShardedLayer):
        module.load(name, tensor, shard)
        return
    param = getattr(module, name)
    _copy(param, tensor, tuple(param.shape), slice(None))


def _copy(target: torch.Tensor, tensor: CheckpointTensor, expected: tuple[int, ...], index: Any) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match the model's {expected}")
    with torch.no_grad():
        target.copy_(tensor[index])


def _parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: loading overwrites every parameter (and the model checks that it did).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(ShardedLayer):
    """``x @ W.T + b`` where this rank holds some output rows of each of the fused checkpoint tensors.

    ``parts[i]`` is the rows of checkpoint tensor ``i`` (q, k, v; or gate, up; or one) this rank holds;
    the local weight stacks them in order, so the output splits by :attr:`out_sizes`.
    """

    def __init__(self, in_features: int, parts: Sequence[Split], bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = list(parts)
        self.num_shards = len(self.parts)
        self.out_sizes = [part.size for part in self.parts]
        self._offsets = [0, *itertools.accumulate(self.out_sizes)]
        self.weight = _parameter(self._offsets[-1], in_features, dtype=dtype, device=device)
        self.bias = _parameter(self._offsets[-1], dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._offsets[-1])

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        part = self.parts[shard]
        target = getattr(self, name)[self._offsets[shard]:self._offsets[shard + 1]]
        expected = (part.total, self.in_features) if name == "weight" else (part.total,)
        _copy(target, tensor, expected, part.indices)


class RowParallelLinear(ShardedLayer):
    """``x @ W.T + b`` where this rank holds the input columns ``part`` and gets that slice of ``x``.

    The partial products are summed by an all-reduce; the (replicated) bias is added once, after it.
    """

    def __init__(self, part: Split, out_features: int, bias: bool, group: ParallelGroup, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.part = part
        self.out_features = out_features
        self.group = group
        self.weight = _parameter(out_features, part.size, dtype=dtype, device=device)
        self.bias = _parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return linear(x, self.weight, self.bias, self.out_features)
        out = self.group.all_reduce(linear(x, self.weight, None, self.out_features))
        return out if self.bias is None else out + self.bias

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        if name == "weight":
            _copy(self.weight, tensor, (self.out_features, self.part.total), (slice(None), self.part.indices))
        else:
            _copy(getattr(self, name), tensor, (self.out_features,), slice(None))


class VocabParallelEmbedding(ShardedLayer):
    """A ``[vocab, hidden]`` matrix whose vocabulary rows are split across ranks: the token embedding,
    and (tied or not) the LM head.

    Every rank holds ``ceil(vocab / world_size)`` rows, the last one padded with zero rows, so the
    logits slices all-gather as equal shapes. ``lookups=False`` marks an untied LM head, which never
    embeds tokens: :func:`pack_weights` then packs its weight in place instead of keeping the plain
    table beside the packed copy.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup, dtype: torch.dtype,
                 device: torch.device | str, lookups: bool = True) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.group = group
        self.lookups = lookups
        self.per_rank = -(-vocab_size // group.world_size)
        start = min(group.rank * self.per_rank, vocab_size)
        self.rows = Split(vocab_size, start, min(self.per_rank, vocab_size - start))
        self.weight = _parameter(self.per_rank, hidden_size, dtype=dtype, device=device)
        if self.rows.size < self.per_rank:
            with torch.no_grad():
                self.weight[self.rows.size:].zero_()
        # The LM head's copy of the weight, prepacked by pack_weights (the lookup needs the plain one).
        self.packed_lm_head: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[T, hidden]`` of ``input_ids``: each rank looks up its rows, zeros the rest, and
        the all-reduce adds the one non-zero contribution per token."""
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ W.T`` over the whole vocabulary ``[B, vocab]``: each rank's slice, all-gathered."""
        weight = self.weight if self.packed_lm_head is None else self.packed_lm_head
        local = linear(hidden, weight, None, self.per_rank)
        if self.group.world_size == 1:
            return local
        return self.group.all_gather(local)[:, :self.vocab_size]

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        _copy(self.weight[:self.rows.size], tensor, (self.vocab_size, self.hidden_size), self.rows.indices)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear``, or a GEMM on a weight that :func:`pack_weights` prepacked.

    ``out_features`` is the weight's row count, which cadence's panel layout (a 4-D weight) pads.
    """
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 4:
        rows = x.reshape(-1, x.shape[-1])
        return cast(Any, cpu_ops()).bf16_linear(rows, weight, bias, out_features).view(*x.shape[:-1], out_features)
    return F.linear(x, weight, bias)


# Rows per step oneDNN's packed layout is tuned for; any row count works (a decode batch is typical).
_PACKING_BATCH_HINT = 64


def pack_weights(model: nn.Module) -> None:
    """Prepack a loaded bf16 CPU model's GEMM weights once, for cadence's GEMM or else oneDNN's.

    On CPUs with AVX512-BF16 the weights go into the panel layout of ``csrc/bf16_linear.cpp``, whose
    GEMM runs a batch-64 decode step's linears here in 18-19 ms against oneDNN's 24-25 ms. Elsewhere,
    where oneDNN has bf16 support, they go into oneDNN's blocked layout: F.linear on a plain bf16
    weight has oneDNN reorder the whole weight on every call, and prepacked the results are the
    same, bit for bit. The packed tensor replaces the linear layers' weights (no second copy); the
    embedding keeps its plain table for lookups and packs a copy for the LM head, while an untied LM
    head (``lookups=False``) is packed in place. Does nothing for other dtypes (fp32 stays on
    F.linear, bit for bit the reference path) or devices. Loading weights after packing is not
    supported.
    """
    for module in model.modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            continue
        if not _packable(module.weight):
            continue
        if isinstance(module, VocabParallelEmbedding) and module.lookups:
            module.packed_lm_head = _pack(module.weight)  # the lookups need the plain table
        else:
            module.weight = nn.Parameter(_pack(module.weight), requires_grad=False)


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not weight.is_mkldnn
            and (_fits_bf16_gemm(weight) or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _fits_bf16_gemm(weight: torch.Tensor) -> bool:
    # cadence's GEMM reads input features in pairs, so it needs an even count
    return weight.shape[1] % 2 == 0 and _has_bf16_gemm()


def _has_bf16_gemm() -> bool:
    ops = cpu_ops()
    return ops is not None and bool(ops.bf16_linear_supported())


def _pack(weight: torch.Tensor) -> torch.Tensor:
    if _fits_bf16_gemm(weight):
        return cast(Any, cpu_ops()).pack_bf16_linear(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)
