"""A Llama-family model's decoder layers as one C++ call per step (``backends/csrc/decoder_stack.cpp``).

The Python layer loop dispatches about a dozen small ops a layer (module calls, views, empty
tensors, ``torch.ops`` calls): 3-4 ms of a 10-15 ms decode step of one request on SmolLM2 here,
where the kernels themselves take the rest. The C++ stack runs the same kernels, in the same order,
with the same arguments, so its outputs are the loop's bit for bit; it only saves the dispatching.

The Llama family builds it once the weights are final (``LlamaForCausalLM.weights_ready``), layer
by layer, and only where every layer runs on the CPU kernels exactly as the loop would: Llama's own
layer, attention and dense MLP modules (the model checks those), the fused norms, SiLU and RoPE
kernels, the SDPA backend's paged-attention kernels, weights that are plain (F.linear), packed for
the bf16 GEMM or quantized, and one rank (checked here). Anything else (tensor parallelism,
mixtures of experts, partial rotary, oneDNN-packed weights, other backends) keeps the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from cadence.backends.base import AttentionBackend
from cadence.backends.cpu_kernels import KERNEL_DTYPES, cpu_ops
from cadence.backends.sdpa_backend import SDPABackend, SDPAMetadata
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear
from cadence.models.layers import RMSNorm, RotaryEmbedding
from cadence.quantization.packed import QuantizedMatrix, QuantizedRowStack, kernel_available

# The kinds of weight the C++ Linear takes (decoder_stack.cpp: kDense, kPanels, kQuant).
_DENSE, _PANELS, _QUANT = 0, 1, 2


class DecoderStack:
    """The C++ stack of one model's layers, and the step's arguments it needs from Python."""

    def __init__(self, native: Any, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        self._native = native
        self._rotary = rotary
        self._dtype = dtype

    @classmethod
    def start(cls, rotary: RotaryEmbedding, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
              head_dim: int) -> DecoderStack | None:
        """An empty stack for layers of these shapes, or None where the kernels cannot run them:
        no kernels here, RoPE over part of each head, a head size the attention kernel lacks."""
        if (cpu_ops() is None or not rotary.kernel_rotates or dtype not in KERNEL_DTYPES
                or head_dim % 16 or head_dim > 256):
            return None
        return cls(_classes().DecoderStack(num_heads, num_kv_heads, head_dim), rotary, dtype)

    def add_layer(self, linears: Sequence[ColumnParallelLinear | RowParallelLinear], norms: Sequence[RMSNorm],
                  backend: AttentionBackend) -> bool:
        """Append a layer: its q/k/v, o, gate/up and down projections, its input and post-attention
        norms (then q and k's per-head norms, Qwen3), its attention backend. False, and nothing
        appended, where the kernels cannot run it as the loop does."""
        if type(backend) is not SDPABackend or any(m.group.world_size > 1 for m in linears
                                                   if isinstance(m, RowParallelLinear)):
            return False
        if not all(type(norm) is RMSNorm and norm.fused and norm.eps == norms[0].eps for norm in norms):
            return False
        native = [_native_linear(m) for m in linears]
        if any(linear is None for linear in native):
            return False
        q_norm, k_norm = (norms[2].weight, norms[3].weight) if len(norms) == 4 else (None, None)
        self._native.add_layer(*native, norms[0].weight, norms[1].weight, q_norm, k_norm, norms[0].eps, backend.scale,
                               backend.sliding_window or 0, backend.logits_soft_cap or 0.0)
        return True

    def runs(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the paged-attention kernels read these caches (as the backend checks per layer)."""
        return bool(kv_caches) and kv_caches[0][0].dtype == self._dtype

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 attn_metadata: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over the step's embedded tokens ``h`` ``[T, hidden]``: (the last layer's MLP
        output, the residual stream), as the layer loop leaves them."""
        meta = cast(Sequence[SDPAMetadata], attn_metadata)
        return cast(tuple[torch.Tensor, torch.Tensor], self._native.forward(
            h, positions, self._rotary.cos, self._rotary.sin, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            [m.slot_mapping for m in meta], [m.block_table for m in meta], [m.token_requests for m in meta],
            [m.token_seq_lens for m in meta]))


def _native_linear(module: ColumnParallelLinear | RowParallelLinear) -> Any | None:
    """``module``'s weight as a C++ Linear (as :func:`~cadence.distributed.layers.linear` reads it), or
    None for a weight only the Python path runs (oneDNN's packed layout, quantized without the kernel)."""
    weight: torch.Tensor | QuantizedMatrix | QuantizedRowStack = module.weight
    bias = module.bias
    out_features = module._offsets[-1] if isinstance(module, ColumnParallelLinear) else module.out_features
    new = _classes().Linear
    if isinstance(weight, QuantizedMatrix | QuantizedRowStack):
        if not kernel_available():
            return None
        parts = weight.parts if isinstance(weight, QuantizedRowStack) else (weight,)
        numbers = [n for p in parts for n in (p.rows, p.cols, p.padded_cols, p.bits, p.block, int(p.symmetric))]
        return new(_QUANT, [p.packed for p in parts], bias, numbers, out_features)
    if weight.is_mkldnn:
        return None
    return new(_PANELS if weight.dim() == 4 else _DENSE, [weight], bias, [], out_features)


def _classes() -> Any:
    """The C++ classes (``torch.classes.cadence_cpu``), loaded with the kernels."""
    return torch.classes.cadence_cpu
