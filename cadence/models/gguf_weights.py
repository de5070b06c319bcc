"""A GGUF file's quantized tensors handed to the model as they are, beside the converted folder.

The folder that :func:`cadence.models.loader.resolve_model` converts (once, through transformers)
still gives the config, the tokenizer and every tensor read as floats: norms, biases, and anything
a layer does not keep quantized. Each folder tensor whose GGUF twin is of a quantized type with a
decoder (:data:`cadence.quantization.ggml.DECODERS`) comes wrapped as a :class:`QuantizedTensor`:
indexed like any checkpoint tensor it reads the folder's floats; the linear and embedding layers of
``cadence/distributed/layers.py`` ask it for :class:`BlockCodes` instead, read from the memory-mapped
file. Names map as transformers maps them (``gguf``'s ``TensorNameMap``), and llama files' q and k
rows are un-permuted as transformers does (llama.cpp's converter interleaves each head's rotary
halves); whole rows move, so the blocks move with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
from transformers import PretrainedConfig

from cadence.distributed.layers import CheckpointTensor
from cadence.models.gguf_file import GGUFIndex, GGUFTensorInfo, gguf_index
from cadence.quantization.blocks import BlockCodes
from cadence.quantization.ggml import DECODERS, FLOAT_TYPES, decode

logger = logging.getLogger(__name__)

_ARCHITECTURES = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
# transformers reworks some architectures' 2-D weights while converting (fused heads split, GPT-2's
# transposed): their quantized bytes would not match the folder's tensors, so they load as floats.
_PERMUTED = "llama"
_REWORKED = frozenset({"bloom", "gpt2", "nemotron", "lfm2", "t5", "t5encoder", "mamba", "qwen2moe", "qwen3moe",
                       "gpt-oss", "gpt_oss", "minimax-m2"})


class QuantizedTensor:
    """A checkpoint tensor with quantized GGUF bytes: ``fallback`` (the folder's floats) where
    indexed, :meth:`block_codes` for layers that keep it quantized."""

    def __init__(self, info: GGUFTensorInfo, file: np.memmap, fallback: CheckpointTensor,
                 row_order: torch.Tensor | None) -> None:
        self.info = info
        self._file = file
        self._fallback = fallback
        self._row_order = row_order

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._fallback.shape)

    def __getitem__(self, index: Any, /) -> torch.Tensor:
        return self._fallback[index]

    def block_codes(self, rows: slice, cols: slice) -> BlockCodes:
        """Rows ``rows`` and columns ``cols`` (whole blocks) of the weight, decoded from the file."""
        count, width = self.info.shape
        row_bytes = self.info.nbytes // count
        order = torch.arange(count)[rows]
        if self._row_order is not None:
            order = self._row_order[order]
        table = self._file[self.info.offset:self.info.offset + self.info.nbytes].reshape(count, row_bytes)
        raw = torch.from_numpy(np.ascontiguousarray(table[order.numpy()]))
        return decode(raw, self.info.ggml_type, width).take(slice(None), cols)


def with_quantized_tensors(weights: Iterable[tuple[str, CheckpointTensor]], gguf: Path,
                           hf_config: PretrainedConfig) -> Iterator[tuple[str, CheckpointTensor]]:
    """``weights`` (the converted folder's), each one whose GGUF twin is quantized as a
    :class:`QuantizedTensor`; the others as they are. Says once which quantized types it cannot keep."""
    index = gguf_index(gguf)
    arch = _ARCHITECTURES.get(index.architecture)
    if arch is None or index.big_endian or index.architecture in _REWORKED:
        why = "a big-endian file" if index.big_endian else f"architecture {index.architecture!r}"
        logger.warning("%s: quantized weights are not kept for %s; running it dequantized", gguf.name, why)
        yield from weights
        return
    names = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    file = np.memmap(gguf, dtype=np.uint8, mode="r")
    dequantized: Counter[str] = Counter()
    for name, tensor in weights:
        info = _twin(index, names, name)
        if info is None or info.ggml_type in FLOAT_TYPES or info.shape != tuple(tensor.shape) or len(info.shape) != 2:
            yield name, tensor
        elif info.ggml_type not in DECODERS:
            dequantized[info.ggml_type.name] += 1
            yield name, tensor
        else:
            yield name, QuantizedTensor(info, file, tensor, _row_order(index, name, hf_config, info.shape[0]))
    if dequantized:
        logger.warning("%s: %s have no kernel here; those tensors run dequantized (docs/quantization.md)", gguf.name,
                       ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items())))


def _twin(index: GGUFIndex, names: Any, hf_name: str) -> GGUFTensorInfo | None:
    base, dot, suffix = hf_name.rpartition(".")
    gguf_name = names.get_name(base) if dot else None
    return None if gguf_name is None else index.tensors.get(f"{gguf_name}.{suffix}")


def _row_order(index: GGUFIndex, hf_name: str, hf_config: PretrainedConfig, rows: int) -> torch.Tensor | None:
    """Which GGUF row each folder row of a llama q or k projection is: transformers' reverse permute."""
    if index.architecture != _PERMUTED or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    heads = hf_config.num_attention_heads if "q_proj" in hf_name else hf_config.num_key_value_heads
    half = rows // heads // 2
    # folder row (head, i, j) of [heads, 2, half] is GGUF row (head, j, i) of [heads, half, 2]
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
