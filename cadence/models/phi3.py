"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama layers (:mod:`cadence.models.llama`) with
Phi's checkpoint layout.

What differs from Llama, and where it is handled:

- The checkpoint holds q/k/v as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``.
  cadence fuses them the same way, but loads (and shards) each part on its own: :func:`split_fused`
  cuts a fused tensor into the q, k, v (gate, up) rows that Llama checkpoints store apart, each a
  lazy view, so a tensor-parallel rank reads only its slice of q, of k and of v, never the whole.
- LongRoPE (``rope_type`` ``longrope``, called ``su`` in older configs) with short and long factors
  and ``original_max_position_embeddings``: :func:`cadence.models.layers.longrope_inv_freq`, which
  says which factor set runs and for which sequences that equals transformers.
- Partial rotary (``partial_rotary_factor``; Phi-4-mini rotates 96 of 128 dims per head):
  :func:`cadence.models.layers.rotary_dim_of` and the torch rotation path.
- No bias anywhere. Dropout (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) is training-only.
  Phi's MLP computes ``up * act(gate)``, Llama's ``act(gate) * up``: the same product.
- ``sliding_window`` (Phi-3-mini-4k: 2047) on every layer, as transformers applies it:
  :func:`cadence.models.layers.layer_windows`, served by the backends as Mistral's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import PretrainedConfig

from cadence.distributed.layers import CheckpointTensor, QuantizedCheckpointTensor
from cadence.models.layers import head_dim_of
from cadence.models.llama import LlamaForCausalLM
from cadence.quantization.blocks import BlockCodes


class RowRange:
    """Rows ``[start, start + size)`` of a checkpoint tensor, as a checkpoint tensor of its own:
    indexing its rows reads only those rows of the underlying (lazily read) tensor."""

    def __init__(self, tensor: CheckpointTensor, start: int, size: int) -> None:
        self.tensor = tensor
        self.start = start
        self.size = size

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.size, *self.tensor.shape[1:])

    def __getitem__(self, index: Any, /) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        shifted = self._shifted(rows)
        return self.tensor[(shifted, *rest)] if rest else self.tensor[shifted]

    def _shifted(self, rows: Any) -> slice:
        """``rows`` of this range as rows of the underlying tensor."""
        if not isinstance(rows, slice):
            raise TypeError(f"a row range is indexed by a slice of rows, not {rows!r}")
        start, stop, step = rows.indices(self.size)
        if step != 1:
            raise TypeError("a row range is indexed by contiguous rows")
        return slice(self.start + start, self.start + stop)


class QuantizedRowRange(RowRange):
    """A row range of a quantized checkpoint tensor (a GGUF file's ``attn_qkv``): its blocks too."""

    tensor: QuantizedCheckpointTensor

    def block_codes(self, rows: slice, cols: slice) -> BlockCodes:
        return self.tensor.block_codes(self._shifted(rows), cols)


def fused_parts(config: PretrainedConfig) -> dict[str, list[tuple[str, int]]]:
    """Each fused checkpoint projection's parts, in order, with their row counts (whole model)."""
    head_dim = head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    columns = config.intermediate_size
    return {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "gate_up_proj": [("gate_proj", columns), ("up_proj", columns)],
    }


def split_fused(weights: Iterable[tuple[str, CheckpointTensor]],
                parts: dict[str, list[tuple[str, int]]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint with each fused projection (``...qkv_proj.weight``) replaced by its parts
    (``...q_proj.weight`` ...), each a :class:`RowRange` view (that of a quantized tensor keeping its
    blocks); every other tensor as it is.

    :raises ValueError: a fused tensor whose rows are not the sum of its parts'.
    """
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        prefix, _, projection = module.rpartition(".")
        split = parts.get(projection)
        if split is None:
            yield name, tensor
            continue
        total = sum(rows for _, rows in split)
        if tensor.shape[0] != total:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} has {tensor.shape[0]} rows, but "
                             f"{' + '.join(f'{part} {rows}' for part, rows in split)} = {total}")
        start = 0
        view = QuantizedRowRange if isinstance(tensor, QuantizedCheckpointTensor) else RowRange
        for part, rows in split:
            yield f"{prefix}.{part}.{param}", view(tensor, start, rows)
            start += rows


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini: see the module's docstring for what differs from Llama."""

    fixed_biases = (False, False)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Llama's loading, after cutting ``qkv_proj`` and ``gate_up_proj`` into their parts.

        :raises ValueError: as :meth:`LlamaForCausalLM.load_weights`, or a fused tensor of the
            wrong size.
        """
        super().load_weights(split_fused(weights, fused_parts(self.config)))
