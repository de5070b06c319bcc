"""Checks and launch settings shared by the kernels' wrappers."""

from __future__ import annotations

import torch


def check_rows(*tensors: torch.Tensor) -> None:
    """The kernels index the head dimension with unit stride, and K and V caches with one set of strides."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton kernels need a unit stride in the head dimension, got {t.stride()}")
    caches = tensors[-2:]
    if caches[0].stride() != caches[1].stride():
        raise ValueError("the K and V caches must share one layout (strides)")


def num_stages(cache: torch.Tensor) -> int:
    """Software-pipelining depth of the attention loops: each stage holds a K and a V tile in shared
    memory (64 x 128 x 2 B = 16 KiB each in half precision), so fp32 tiles get one stage."""
    return 2 if cache.element_size() <= 2 else 1
