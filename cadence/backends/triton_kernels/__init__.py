"""Triton kernels over the paged KV cache: the cache write, paged decode and paged prefill attention.

Triton decides at each ``@triton.jit`` whether a kernel is compiled (CUDA) or run by its
interpreter (NumPy on the CPU), from ``TRITON_INTERPRET``; so the mode is fixed when this package
is first imported, and :data:`INTERPRETED` records which one it got. The interpreter is for tests:
10³–10⁴× slower than torch, and it stores bf16 as raw 16-bit integers, so every kernel converts
what it loads to fp32 before any arithmetic there (``UPCAST``), and rounds once on the store.
"""

from __future__ import annotations

import triton

# Read before the submodules define their kernels: the same knob decides each @triton.jit.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

from cadence.backends.triton_kernels.cache import reshape_and_cache  # noqa: E402
from cadence.backends.triton_kernels.decode import num_decode_splits, paged_decode_attention  # noqa: E402
from cadence.backends.triton_kernels.prefill import paged_prefill_attention  # noqa: E402

__all__ = [
    "INTERPRETED",
    "num_decode_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
]
