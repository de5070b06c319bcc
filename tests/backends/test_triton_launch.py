"""The Triton kernels' shared launch checks (``cadence/backends/triton_kernels/launch.py``): the layout
every kernel wrapper checks before it launches, and the pipelining depth chosen by the cache's
precision. Nothing here launches a kernel; ``tests/backends/test_triton_backend.py`` runs them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # As tests/backends/test_triton_backend.py: the interpreter's mode is fixed when the kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cadence.backends.triton_kernels.launch import check_rows, num_stages

# Tokens x heads x head size, and blocks x block size x KV heads x head size.
Q = torch.zeros(5, 4, 8)
CACHE = torch.zeros(3, 16, 2, 8)


def test_contiguous_rows_and_one_cache_layout_pass() -> None:
    check_rows(Q, torch.zeros_like(Q), CACHE, torch.zeros_like(CACHE))
    # Only the last two (the caches) must share strides; rows may come from wider tensors.
    wide = torch.zeros(5, 4, 24)
    check_rows(wide[..., :8], wide[..., 8:16], CACHE, torch.zeros_like(CACHE))
    check_rows(CACHE[:, :, :1], CACHE[:, :, 1:])  # two halves of one tensor share its strides


def test_a_head_dimension_without_unit_stride_is_refused() -> None:
    transposed = torch.zeros(5, 8, 4).transpose(1, 2)  # [5, 4, 8] with head-dimension stride 4
    with pytest.raises(ValueError, match=r"^the Triton kernels need a unit stride in the head dimension, "
                                         r"got \(32, 1, 4\)$"):
        check_rows(Q, transposed, CACHE, torch.zeros_like(CACHE))
    # The stride check comes first, for the caches too.
    with pytest.raises(ValueError, match=r"unit stride in the head dimension, got \(256, 1, 128, 16\)"):
        check_rows(Q, Q, CACHE, torch.zeros(3, 2, 8, 16).permute(0, 3, 1, 2))


def test_k_and_v_caches_with_different_layouts_are_refused() -> None:
    padded = torch.zeros(3, 16, 2, 16)[..., :8]  # the same shape, other strides
    with pytest.raises(ValueError, match=r"^the K and V caches must share one layout \(strides\)$"):
        check_rows(Q, Q, CACHE, padded)
    with pytest.raises(ValueError, match="share one layout"):
        check_rows(Q, Q, padded, CACHE)


@pytest.mark.parametrize(("dtype", "stages"), [(torch.float16, 2), (torch.bfloat16, 2), (torch.uint8, 2),
                                               (torch.float32, 1), (torch.float64, 1)])
def test_half_precision_caches_get_two_pipeline_stages_and_wider_ones_one(dtype: torch.dtype, stages: int) -> None:
    assert num_stages(torch.zeros(1, 16, 2, 8, dtype=dtype)) == stages
