"""Layers that hold one tensor-parallel rank's shard of a weight and load it from the full checkpoint.

- :class:`ColumnParallelLinear`: output rows split (q/k/v and gate/up, fused); no communication.
- :class:`RowParallelLinear`: input columns split; an all-reduce sums the partial products.
- :class:`VocabParallelEmbedding`: vocabulary rows split; a masked lookup and an all-reduce, and as
  the LM head an all-gather of each rank's slice of the logits.

Each layer reads only its rows or columns of a checkpoint tensor (``tensor[rows]``, ``tensor[:, cols]``
on a lazily read safetensors slice), so no rank materialises the full model. At world size 1 each
forward is the single ``F.linear`` / ``F.embedding`` call of the unsharded module (or, on the CPU,
the GEMM of the prepacked weight: see :func:`pack_weights`).

A layer handed a :class:`QuantizedCheckpointTensor` for its weight keeps it quantized: it takes its
shard's blocks (a row split, or a column split on whole blocks), and :func:`pack_weights` packs them
for ``cadence/quantization/packed.py``'s linear (docs/quantization.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.backends import dense_gemm
from cadence.backends.cpu_kernels import cpu_ops
from cadence.distributed.group import ParallelGroup
from cadence.distributed.partition import Split
from cadence.quantization.blocks import BlockCodes, quantize_int8
from cadence.quantization.packed import (
    QuantizedMatrix,
    QuantizedRowStack,
    lookup_rows,
    pack,
    pack_rows,
    quantized_linear,
)


class CheckpointTensor(Protocol):
    """A checkpoint tensor that reads only the part it is indexed with (a torch tensor qualifies)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def __getitem__(self, index: Any, /) -> torch.Tensor: ...


@runtime_checkable
class QuantizedCheckpointTensor(CheckpointTensor, Protocol):
    """A checkpoint tensor whose weight can be read as quantized blocks (a GGUF file's)."""

    def block_codes(self, rows: slice, cols: slice) -> BlockCodes: ...


class ShardedLayer(nn.Module):
    """A layer whose parameters are one rank's shard of ``num_shards`` checkpoint tensors each.

    A weight shard given quantized is kept in ``staged`` until :func:`pack_weights`.
    """

    num_shards: int = 1
    staged: dict[int, BlockCodes]
    # LoRA adapters (cadence/lora/layer_slots.py): given the input and the output, the output with the
    # step's adapters' deltas added (under tensor parallelism, this rank's share, before the all-reduce).
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def stage(self, tensor: CheckpointTensor, expected: tuple[int, ...], shard: int, rows: slice, cols: slice) -> bool:
        """Keep shard ``shard`` of a quantized weight as blocks; False where ``tensor`` is not one."""
        if not isinstance(tensor, QuantizedCheckpointTensor):
            return False
        _check_shape(tensor, expected)
        self.staged = getattr(self, "staged", {})
        self.staged[shard] = tensor.block_codes(rows, cols)
        return True

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


def _check_shape(tensor: CheckpointTensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match the model's {expected}")


def _copy(target: torch.Tensor, tensor: CheckpointTensor, expected: tuple[int, ...], index: Any,
          rows: slice = slice(None)) -> None:
    """``target[rows] = tensor[index]``, once ``tensor`` has the ``expected`` shape."""
    _check_shape(tensor, expected)
    if target.is_mkldnn:
        raise ValueError("this layer's weight is prepacked (pack_weights): load weights before packing")
    with torch.no_grad():
        target[rows].copy_(tensor[index])


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
        out = linear(x, self.weight, self.bias, self._offsets[-1])
        return out if self.lora is None else self.lora(x, out)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of :meth:`forward`'s two halves (a gate/up layer) through the C++ kernels:
        the GEMM with SiLU in its epilogue where the weight is in the bf16 GEMM's panels and no adapter
        applies (``csrc/bf16_linear.cpp``: bf16_linear_silu, the same bits as the two kernels)."""
        ops = cast(Any, cpu_ops())
        if self.lora is None and isinstance(self.weight, torch.Tensor) and self.weight.dim() == 4:
            rows = x.reshape(-1, x.shape[-1])
            return ops.bf16_linear_silu(rows, self.weight, self.bias, self._offsets[-1]).view(*x.shape[:-1], -1)
        gate_up = self.forward(x)
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        ops.silu_and_mul(out, gate_up)
        return out

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        part = self.parts[shard]
        expected = (part.total, self.in_features) if name == "weight" else (part.total,)
        if name != "weight" or not self.stage(tensor, expected, shard, part.indices, slice(None)):
            rows = slice(self._offsets[shard], self._offsets[shard + 1])
            _copy(getattr(self, name), tensor, expected, part.indices, rows)


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
        single = self.group.world_size == 1
        out = linear(x, self.weight, self.bias if single else None, self.out_features)
        if self.lora is not None:  # a LoRA delta through this rank's input columns sums like the product
            out = self.lora(x, out)
        if single:
            return out
        out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        if name == "weight":
            expected = (self.out_features, self.part.total)
            if not self.stage(tensor, expected, shard, slice(None), self.part.indices):
                _copy(self.weight, tensor, expected, (slice(None), self.part.indices))
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
        self.dtype = dtype
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
            return self._lookup(input_ids)
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        out = self._lookup(local.masked_fill(outside, 0))
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor | QuantizedMatrix = self.weight
        if isinstance(weight, QuantizedMatrix):
            return lookup_rows(weight, rows.reshape(-1), self.dtype).view(*rows.shape, self.hidden_size)
        return F.embedding(rows, weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ W.T`` over the whole vocabulary ``[B, vocab]``: each rank's slice, all-gathered."""
        weight = self.weight if self.packed_lm_head is None else self.packed_lm_head
        local = linear(hidden, weight, None, self.per_rank)
        if self.group.world_size == 1:
            return local
        return self.group.all_gather(local)[:, :self.vocab_size]

    def load(self, name: str, tensor: CheckpointTensor, shard: int) -> None:
        expected = (self.vocab_size, self.hidden_size)
        if not self.stage(tensor, expected, shard, self.rows.indices, slice(None)):
            _copy(self.weight, tensor, expected, self.rows.indices, slice(0, self.rows.size))


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix | QuantizedRowStack, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """``F.linear``, or a GEMM on a weight that :func:`pack_weights` prepacked or quantized.

    ``out_features`` is the weight's row count, which cadence's panel layout (a 4-D weight) pads.
    """
    if isinstance(weight, QuantizedMatrix | QuantizedRowStack):
        return quantized_linear(x, weight, bias)
    return dense_gemm.linear(x, weight, bias, out_features)


def pack_weights(model: nn.Module, int8: bool = False) -> None:
    """Prepack a loaded CPU model's GEMM weights once, for cadence's bf16 GEMM or else oneDNN's.

    Float weights go into the layout of the fastest GEMM here (``backends/dense_gemm.py``: cadence's
    bf16 GEMM's panels, oneDNN's blocked layout, or the AVX2 bf16 GEMM's panels). The packed tensor
    replaces the linear layers' weights (no second copy); the embedding keeps its plain table for
    lookups and packs a copy for the LM head, while an untied LM head (``lookups=False``) is packed
    in place. Does nothing where no GEMM packs the dtype or device. Loading weights after packing is
    not supported.

    Weights staged quantized (:class:`QuantizedCheckpointTensor`) are packed for the quantized
    linear instead, and with ``int8`` (``--quantization int8``) so are the float weights of the
    linear layers (not the embedding, nor the LM head), quantized per output channel.
    """
    for module in model.modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            continue
        quantized = _quantized(module, int8)
        if quantized is not None:
            # No longer a Parameter: linear() and the embedding's lookup read the packed blocks.
            device = module.weight.device
            del module.weight
            setattr(module, "weight", quantized.to(device))  # noqa: B010
            continue
        if not dense_gemm.packs(module.weight):
            continue
        if isinstance(module, VocabParallelEmbedding) and module.lookups:
            module.packed_lm_head = dense_gemm.pack(module.weight)  # the lookups need the plain table
        else:
            module.weight = nn.Parameter(dense_gemm.pack(module.weight), requires_grad=False)


def _quantized(module: ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding,
               int8: bool) -> QuantizedMatrix | QuantizedRowStack | None:
    """The module's weight packed quantized: its staged blocks, or with ``int8`` its float weight
    quantized (linear layers only); None where it stays a float weight."""
    staged = getattr(module, "staged", {})
    if staged and len(staged) < module.num_shards and isinstance(module, ColumnParallelLinear):
        # A fused weight only partly quantized in the file: the quantized parts join the float ones.
        with torch.no_grad():
            for shard, codes in staged.items():
                module.weight[module._offsets[shard]:module._offsets[shard + 1]] = codes.dequantize(module.weight.dtype)
        staged.clear()
    if staged:
        parts = [staged.pop(shard) for shard in range(module.num_shards)]
        if isinstance(module, VocabParallelEmbedding) and parts[0].shape[0] < module.per_rank:
            return pack(_zero_rows(parts[0], module.per_rank))  # one part: the vocabulary
        return pack_rows(parts)
    if int8 and isinstance(module, ColumnParallelLinear | RowParallelLinear):
        return pack(quantize_int8(module.weight.detach()), cols=module.weight.shape[1])
    return None


def _zero_rows(codes: BlockCodes, rows: int) -> BlockCodes:
    """``codes`` with zero rows appended up to ``rows`` (the last rank's vocabulary padding)."""
    extra = rows - codes.shape[0]
    return BlockCodes(F.pad(codes.codes, (0, 0, 0, extra)), F.pad(codes.scale, (0, 0, 0, extra)),
                      F.pad(codes.minimum, (0, 0, 0, extra)), codes.bits, codes.block)
