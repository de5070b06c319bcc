"""A model's decoder layers as one C++ call per step (``backends/csrc/decoder_stack.cpp``): Llama's
family and Gemma's.

The Python layer loop dispatches about a dozen small ops a layer (module calls, views, empty
tensors, ``torch.ops`` calls): 3-4 ms of a 10-15 ms decode step of one request on SmolLM2 here,
where the kernels themselves take the rest. The C++ stack runs the same kernels, in the same order,
with the same arguments, so its outputs are the loop's bit for bit; it only saves the dispatching.

A model builds it once the weights are final (its ``prepare_fast_path``; not under
``--enforce-eager``), layer by layer, and only where every layer runs on the CPU kernels exactly as
the loop would: the family's own layer, attention and MLP modules (the model checks those), fused
norms and RoPE kernels, the SDPA backend's paged-attention kernels, weights that are plain
(F.linear), in oneDNN's layout, packed for the bf16 GEMM or quantized, and one rank (checked here).
Anything else (tensor parallelism, mixtures of experts, partial rotary, other backends) keeps the
Python loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from cadence.backends.base import AttentionBackend
from cadence.backends.cpu_kernels import KERNEL_DTYPES, attention_takes_prefills, cpu_ops
from cadence.backends.sdpa_backend import SDPABackend, SDPAMetadata
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear
from cadence.models.layers import GemmaRMSNorm, RMSNorm, RotaryEmbedding
from cadence.quantization.packed import QuantizedMatrix, QuantizedRowStack, kernel_available, kernel_row_limit

# The kinds of weight the C++ Linear takes (decoder_stack.cpp: kDense, kPanels, kQuant).
_DENSE, _PANELS, _QUANT = 0, 1, 2


@dataclass(frozen=True)
class LayerParts:
    """What the stack takes of one layer: its q/k/v, o, gate/up and down projections; its norms
    (Llama: input and post-attention RMSNorm; Gemma: input, post-attention, pre- and
    post-feed-forward), and q and k's per-head norms if it has them, all of one class; its RoPE
    tables and its attention backend."""

    linears: Sequence[ColumnParallelLinear | RowParallelLinear]
    norms: Sequence[RMSNorm | GemmaRMSNorm]
    qk_norms: Sequence[RMSNorm | GemmaRMSNorm]
    rotary: RotaryEmbedding
    backend: AttentionBackend


def build_stack(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                layers: Iterable[LayerParts]) -> DecoderStack | None:
    """The stack of ``layers`` (this rank's head counts), or None where the kernels cannot run one."""
    stack = DecoderStack.start(dtype, num_heads, num_kv_heads, head_dim)
    if stack is None or not all(stack.add_layer(parts) for parts in layers):
        return None
    return stack


class DecoderStack:
    """The C++ stack of one model's layers, and the step's arguments it needs from Python."""

    def __init__(self, native: Any, dtype: torch.dtype) -> None:
        self._native = native
        self._dtype = dtype
        self._rotaries: list[RotaryEmbedding] = []  # each layer's (their tables grow while serving)
        self._natives: dict[ColumnParallelLinear | RowParallelLinear, Any] = {}  # each linear's C++ Linear
        # LoRA adapters (cadence/lora/manager.py sets both per step): off for a step whose layers run
        # from Python (a large one, segmented by adapter); the masks of a step with adapter rows,
        # one per part count (1 to 3), or none.
        self.enabled = True
        self.lora_masks: list[torch.Tensor] = []
        self.lora_slot = -1  # a step all on one adapter: its slot (no masks)

    @classmethod
    def start(cls, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> DecoderStack | None:
        """An empty stack for layers of these shapes, or None where the kernels cannot run them: no
        kernels here, a head size the attention kernel lacks."""
        if cpu_ops() is None or dtype not in KERNEL_DTYPES or head_dim % 16 or head_dim > 256:
            return None
        return cls(_classes().DecoderStack(num_heads, num_kv_heads, head_dim), dtype)

    def add_layer(self, parts: LayerParts) -> bool:
        """Append a layer; False where the kernels cannot run it as the loop does (then the stack
        is incomplete: the caller drops it)."""
        if type(parts.backend) is not SDPABackend or not parts.rotary.kernel_rotates:
            return False
        if any(isinstance(m, RowParallelLinear) and m.group.world_size > 1 for m in parts.linears):
            return False
        norms = [*parts.norms, *parts.qk_norms]
        kind, eps = type(norms[0]), norms[0].eps
        if not all(type(n) is kind and n.fused and n.eps == eps for n in norms):
            return False
        native = [_native_linear(m, self._dtype) for m in parts.linears]
        if any(linear is None for linear in native):
            return False
        gemma = kind is GemmaRMSNorm
        weights = [cast(GemmaRMSNorm, n).fp32_scale() if gemma else n.weight for n in norms]
        backend, count = parts.backend, len(parts.norms)
        self._native.add_layer(*native, weights[:count], weights[count:], eps, backend.scale,
                               backend.sliding_window or 0, backend.logits_soft_cap or 0.0, gemma)
        self._rotaries.append(parts.rotary)
        self._natives.update(zip(parts.linears, native, strict=True))
        return True

    def set_lora(self, module: ColumnParallelLinear | RowParallelLinear,
                 weights: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]],
                 num_parts: int, rank: int) -> None:
        """Give ``module``'s C++ Linear its LoRA slots' weights (``LoRASlots.packed``: every slot's A
        and B, and each slot's, plain, in oneDNN's layout or the bf16 GEMM's panels), of ``rank``
        columns a part per slot."""
        a, b, slot_a, slot_b = weights
        self._natives[module].set_lora(a, b, slot_a, slot_b, num_parts, num_parts * rank)

    def runs(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], attn_metadata: Sequence[object]) -> bool:
        """Whether the paged-attention kernels read these caches and this step's rows (as the backend
        checks per layer)."""
        if not (self.enabled and kv_caches and kv_caches[0][0].dtype == self._dtype):
            return False
        return attention_takes_prefills() or not cast(SDPAMetadata, attn_metadata[0]).prefills

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 attn_metadata: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over the step's embedded tokens ``h`` ``[T, hidden]``, as the model's layer
        loop leaves them: Llama's (the last layer's MLP output, the residual stream); Gemma's hidden
        states, twice."""
        meta = cast(Sequence[SDPAMetadata], attn_metadata)
        return cast(tuple[torch.Tensor, torch.Tensor], self._native.forward(
            h, positions, [r.cos for r in self._rotaries], [r.sin for r in self._rotaries],
            [k for k, _ in kv_caches], [v for _, v in kv_caches], [m.slot_mapping for m in meta],
            [m.block_table for m in meta], [m.token_requests for m in meta], [m.token_seq_lens for m in meta],
            self.lora_masks, self.lora_slot))


def _native_linear(module: ColumnParallelLinear | RowParallelLinear, dtype: torch.dtype) -> Any | None:
    """``module``'s weight as a C++ Linear (as :func:`~cadence.distributed.layers.linear` reads it), or
    None for a weight only the Python path runs (quantized where no kernel runs)."""
    weight: torch.Tensor | QuantizedMatrix | QuantizedRowStack = module.weight
    bias = module.bias
    out_features = sum(module.out_sizes) if isinstance(module, ColumnParallelLinear) else module.out_features
    new = _classes().Linear
    if isinstance(weight, QuantizedMatrix | QuantizedRowStack):
        if not kernel_available():
            return None
        parts = weight.parts if isinstance(weight, QuantizedRowStack) else (weight,)
        numbers = [n for p in parts for n in (p.rows, p.cols, p.padded_cols, p.bits, p.block, int(p.symmetric))]
        limit = kernel_row_limit(weight, dtype)  # beyond it, quantized_linear's dense weights
        dense = [] if limit is None else [p.dense(dtype) for p in parts]
        return new(_QUANT, [p.packed for p in parts] + dense, bias, [*numbers, -1 if limit is None else limit],
                   out_features)
    return new(_PANELS if weight.dim() > 2 else _DENSE, [weight], bias, [], out_features)  # panels: 4-D or 3-D


def _classes() -> Any:
    """The C++ classes (``torch.classes.cadence_cpu``), loaded with the kernels."""
    return torch.classes.cadence_cpu
