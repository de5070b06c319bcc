"""oneDNN's GEMM over weights reordered once into its blocked layout (torch's ``mkldnn`` ops): the
float linear layers' GEMM on x86 CPUs where cadence's own bf16 GEMM does not run.

``F.linear`` sends float32 to MKL's GEMM and bfloat16 to oneDNN's, which then reorders the whole
weight on every call. Prepacked, oneDNN's float32 GEMM ran SmolLM2's linears 1.2x (one row) to
2.5x (four rows) faster than MKL's on the 2-core AMD Zen 3 (AVX2) machine, and 1.45x at 64 rows
(docs/performance.md); vLLM's CPU backend runs its float linears through it as well. Its sums
round differently from MKL's, so float32 results are no longer F.linear's bit for bit; bfloat16
ones are (the same GEMM, only the reorder moved).
"""

from __future__ import annotations

import functools
import platform

import torch

# Rows per step oneDNN's packed layout is tuned for; any row count works (a decode batch is typical).
_PACKING_BATCH_HINT = 64


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` run faster prepacked for oneDNN."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return _x86_onednn()
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _x86_onednn() -> bool:
    # Measured on x86 only; on Arm torch's oneDNN runs through ACL, unmeasured here, so F.linear stays.
    return torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's layout (an opaque ``mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` over a weight :func:`pack` reordered."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
