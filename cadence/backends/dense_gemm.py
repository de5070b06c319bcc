"""Which GEMM runs a float (unquantized) weight on this CPU, the weight packed once for it, and the
call: the one place that tells the layouts apart.

In order of preference, for a weight ``[out, in]`` on the CPU:

- **cadence's bf16 GEMM** (``csrc/bf16_linear.cpp``, AVX512-BF16 or AMX): bf16 weights with an even
  input width, packed into 4-D panels.
- **oneDNN's GEMM** (``backends/onednn.py``): float32 weights on x86, bf16 ones where oneDNN has bf16
  support (AVX-512); an opaque ``mkldnn`` tensor.
- **the AVX2 bf16 GEMM** (``csrc/bf16_linear_avx2.cpp``): bf16 weights on CPUs with AVX2 and FMA but
  neither of the above (AMD Zen 3, Intel before Cooper Lake), packed into 3-D panels. There bf16
  ``F.linear`` ran 4-9x slower than float32 from 8 rows up; this one runs bf16 weights faster than
  oneDNN's float32 GEMM runs float32 ones (docs/performance.md, "bf16 on CPUs without bf16
  instructions").
- ``F.linear`` over the plain weight otherwise.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from cadence.backends import onednn
from cadence.backends.cpu_kernels import avx2_ops, cpu_ops


def packs(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` gives ``weight`` a layout that runs faster than the plain one here."""
    if weight.device.type != "cpu" or weight.is_mkldnn or weight.dim() != 2:
        return False
    return _fits_panels(weight) or onednn.packs(weight.dtype, weight.device) or _fits_avx2_panels(weight)


def packs_into_panels(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` gives ``weight`` one of the panel layouts (plain tensors, which stack)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return _fits_panels(weight) or (not onednn.packs(weight.dtype, weight.device) and _fits_avx2_panels(weight))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the layout :func:`linear` runs fastest here (see :func:`packs`)."""
    if _fits_panels(weight):
        return cast(Any, cpu_ops()).pack_bf16_linear(weight.detach())
    if onednn.packs(weight.dtype, weight.device):
        return onednn.pack(weight)
    return cast(Any, avx2_ops_with_bf16()).pack_bf16_linear(weight.detach())


def prepacked(weight: torch.Tensor) -> torch.Tensor:
    """:func:`pack` of ``weight`` where it :func:`packs`, else ``weight`` itself."""
    return pack(weight) if packs(weight) else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` over a plain weight or one :func:`pack` packed; ``out_features`` is the
    weight's row count, which the panel layouts pad."""
    if weight.is_mkldnn:
        return onednn.linear(x, weight, bias)
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    ops = cpu_ops() if weight.dim() == 4 else avx2_ops_with_bf16()
    rows = x.reshape(-1, x.shape[-1])
    return cast(Any, ops).bf16_linear(rows, weight, bias, out_features).view(*x.shape[:-1], out_features)


def has_bf16_panels() -> bool:
    """Whether cadence's AVX512-BF16 GEMM runs here (its 4-D panels)."""
    ops = cpu_ops()
    return ops is not None and bool(ops.bf16_linear_supported())


def avx2_ops_with_bf16() -> Any | None:
    """``torch.ops.cadence_avx2`` where its bf16 GEMM runs (AVX2 and FMA), else None."""
    ops = avx2_ops()
    return ops if ops is not None and ops.bf16_linear_supported() else None


def _fits_panels(weight: torch.Tensor) -> bool:
    # cadence's GEMM takes bf16 alone, and reads input features in pairs, so it needs an even count
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and has_bf16_panels()


def _fits_avx2_panels(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.shape[1] > 0 and avx2_ops_with_bf16() is not None
