"""Paged attention's bf16 paths on any batch: each path this CPU has (packed keys on the tile unit or
by VDPBF16PS, whose decodes read their keys and values as bf16 pairs, and the fp32 path) gives the
definition's output for random mixes of decodes and prefill chunks over cached contexts, with block
sizes that do and do not divide 16, head shapes compiled for their group and head_dim and others,
sliding windows and soft caps, long decodes read in parts (``csrc/paged_attention.cpp``, ``attention_packed.cpp``,
``decode_dot.cpp``; docs/attention_backends.md)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from cadence.backends.cpu_kernels import ATTENTION_PATHS, attention_path, cpu_ops
from cadence.backends.sdpa_backend import SDPABackend
from cadence.backends.testing import naive_reference, random_paged_batch, run_backend

# (heads, KV heads, head_dim): SmolLM2's, groups of 1 and 2 at 64 and 128 (compiled decodes), a group
# of 5, head_dim 256 and 32 (read from the shape).
SHAPES = [(9, 3, 64), (4, 4, 64), (4, 2, 128), (10, 2, 64), (4, 1, 256), (6, 2, 32)]

# (cached tokens, new tokens): decodes, and chunks of up to 40 rows (over a tile of 32 on packed keys),
# some over contexts that a decode reads in parts (past 512 keys).
REQUESTS = st.lists(st.tuples(st.one_of(st.integers(0, 200), st.integers(500, 1100)),
                              st.one_of(st.just(1), st.integers(2, 40))), min_size=1, max_size=6)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@settings(max_examples=20, deadline=None)
@given(requests=REQUESTS, shape=st.sampled_from(SHAPES), block_size=st.sampled_from([5, 16, 32]),
       window=st.sampled_from([None, 7, 40]), cap=st.sampled_from([None, 0.5]), seed=st.integers(0, 2**16))
def test_every_bf16_path_gives_the_definition(path: str, requests: list[tuple[int, int]], shape: tuple[int, int, int],
                                              block_size: int, window: int | None, cap: float | None,
                                              seed: int) -> None:
    ops = cpu_ops()
    if ops is None:
        pytest.skip("cadence's CPU kernels do not build here")
    with attention_path(ops, path) as available:
        if not available:
            pytest.skip(f"this CPU has no {path} path")
        heads, kv_heads, head_dim = shape
        batch = random_paged_batch(requests, heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=seed)
        backend = SDPABackend(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window, logits_soft_cap=cap)
        out, _, _ = run_backend(backend, batch)
        expected = naive_reference(batch, head_dim ** -0.5, window, cap)
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)
