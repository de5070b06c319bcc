"""cadence's C++ CPU kernels (``csrc/``), compiled with torch's extension builder on first use.

``paged_attention.cpp`` reads decode attention straight from the paged KV cache; ``layer_ops.cpp``
fuses a decoder layer's per-token ops (RMSNorm with its residual add, RoPE, SiLU-and-multiply);
``bf16_linear.cpp`` is the bf16 GEMM of the linear layers on CPUs with AVX512-BF16; ``greedy.cpp``
is the sampler's argmax.
The build takes about 10 s once here; torch caches it by source hash under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), so later processes load it in milliseconds. Where the
kernels cannot run (no AVX-512, no C++ compiler, a failed build) :func:`cpu_ops` returns None and
callers keep their torch-op path, after one warning that says why.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "bf16_linear.cpp", "greedy.cpp")
# The instruction sets the kernels use (the build targets exactly these, not the build machine); no
# contraction of a multiply and an add into one FMA where torch rounds the product first.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def cpu_ops() -> Any | None:
    """``torch.ops.cadence_cpu`` (``store_kv``, ``paged_attention``, ``rms_norm``, ``add_rms_norm``,
    ``silu_and_mul``, ``rotary_embedding``, ``bf16_linear_supported``, ``pack_bf16_linear``,
    ``bf16_linear``, ``argmax_rows``; signatures in ``csrc/``), or None where the kernels cannot run here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.info("cadence CPU kernels off: the CPU lacks AVX-512 (%s); using torch ops", capability)
        return None
    try:
        from torch.utils.cpp_extension import load

        load("cadence_cpu_kernels", sources=[str(_CSRC / name) for name in _SOURCES], extra_cflags=_FLAGS,
             extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)], is_python_module=False)
    except Exception as exc:  # a missing compiler or a failed build: the torch path still works
        logger.warning("cadence CPU kernels unavailable, using torch ops instead: %s", exc)
        return None
    return torch.ops.cadence_cpu


def runs_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` on ``device`` go through the kernels (building them if needed)."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and cpu_ops() is not None
