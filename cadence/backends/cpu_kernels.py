"""cadence's C++ CPU kernels (``csrc/``), compiled with torch's extension builder on first use.

The build takes about 20 s once; torch caches it by source hash under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), so later processes load it in milliseconds. Where a kernel
cannot run (no AVX-512, no C++ compiler, a failed build) :func:`paged_decode_op` returns None and
the backends keep their torch-op path, after one warning that says why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
# The instruction sets the kernels use; the build targets exactly these, not the build machine.
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]


@functools.cache
def paged_decode_op() -> Callable[..., None] | None:
    """``torch.ops.cadence_cpu.paged_decode(out, q, k_cache, v_cache, block_table, seq_lens, scale)``
    (see ``csrc/paged_attention_cpu.cpp``), or None where it cannot run here."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        logger.info("CPU paged-decode kernel off: the CPU lacks AVX-512 (%s)", torch.backends.cpu.get_cpu_capability())
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline("cadence_cpu_kernels", cpp_sources=_SOURCE.read_text(), extra_cflags=_FLAGS,
                    is_python_module=False)
    except Exception as exc:  # a missing compiler or a failed build: the torch path still works
        logger.warning("CPU paged-decode kernel unavailable, using torch ops instead: %s", exc)
        return None
    return torch.ops.cadence_cpu.paged_decode
