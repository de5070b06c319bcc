"""A Llama-family model's decoder layers as one C++ call per step (``backends/csrc/decoder_stack.cpp``).

The Python layer loop dispatches about a dozen small ops a layer (module calls, views, empty
tensors, ``torch.ops`` calls): 3-4 ms of a 10-15 ms decode step of one request on SmolLM2 here,
where the kernels themselves take the rest. The C++ stack runs the same kernels, in the same order,
with the same arguments, so its outputs are the loop's bit for bit; it only saves the dispatching.

It is built once the weights are final (:meth:`LlamaForCausalLM.weights_ready
<cadence.models.llama.LlamaForCausalLM.weights_ready>`), and only where every layer runs on the CPU
kernels exactly as the loop would: Llama's own layer, attention and dense MLP modules, the fused
norms, SiLU and RoPE kernels, the SDPA backend's paged-attention kernels, weights that are plain
(F.linear), packed for the bf16 GEMM or quantized, and one rank. Anything else (tensor
parallelism, mixtures of experts, partial rotary, oneDNN-packed weights, other backends) keeps the
Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from cadence.backends.cpu_kernels import KERNEL_DTYPES, cpu_ops
from cadence.backends.sdpa_backend import SDPABackend, SDPAMetadata
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear
from cadence.models.layers import RMSNorm, RotaryEmbedding
from cadence.quantization.packed import QuantizedMatrix, QuantizedRowStack, kernel_available

if TYPE_CHECKING:
    from cadence.models.llama import LlamaForCausalLM

# The kinds of weight the C++ Linear takes (decoder_stack.cpp: kDense, kPanels, kQuant).
_DENSE, _PANELS, _QUANT = 0, 1, 2


class DecoderStack:
    """The C++ stack of one model's layers, and the step's arguments it needs from Python."""

    def __init__(self, native: Any, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        self._native = native
        self._rotary = rotary
        self._dtype = dtype

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


def build_decoder_stack(model: LlamaForCausalLM) -> DecoderStack | None:
    """The C++ stack of ``model``'s layers, or None where the Python loop must run them (see the
    module's docstring)."""
    from cadence.models.llama import MLP, Attention, DecoderLayer  # llama imports this module

    ops = cpu_ops()
    rotary = model.rotary_emb
    if ops is None or not rotary.kernel_rotates or model.dtype not in KERNEL_DTYPES:
        return None
    if model.head_dim % 16 or model.head_dim > 256:  # the paged-attention kernel's head sizes
        return None
    layers = list(model.model.layers)
    if not all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention and type(layer.mlp) is MLP
               for layer in layers):
        return None
    first = cast(Attention, layers[0].self_attn)
    native = _classes().DecoderStack(first.num_heads, first.num_kv_heads, first.head_dim)
    for layer in cast(list[DecoderLayer], layers):
        attention, mlp = layer.self_attn, cast(MLP, layer.mlp)
        if not (mlp.fused and type(attention.backend) is SDPABackend and attention.o_proj.group.world_size == 1):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(attention._qk_norm or ())]
        if not all(type(norm) is RMSNorm and norm.fused and norm.eps == norms[0].eps for norm in norms):
            return None
        linears = [_native_linear(m) for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(linear is None for linear in linears):
            return None
        q_norm, k_norm = (norm.weight for norm in attention._qk_norm) if attention._qk_norm else (None, None)
        backend = attention.backend
        native.add_layer(*linears, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm,
                         k_norm, norms[0].eps, backend.scale, backend.sliding_window or 0,
                         backend.logits_soft_cap or 0.0)
    return DecoderStack(native, rotary, model.dtype)


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
