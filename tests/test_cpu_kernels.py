"""The C++ paged-decode kernel (``cadence/backends/csrc``) against naive fp32 attention, through the
``sdpa`` backend that calls it, and the backend's torch-op path it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.backends import sdpa_backend
from cadence.backends.cpu_kernels import paged_decode_op
from cadence.backends.sdpa_backend import SDPABackend
from cadence.backends.testing import PagedBatch, random_paged_batch, run_backend

CPU = torch.device("cpu")


def _naive(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention of every query over its request's context, read slot by slot from the
    canonical caches ``[blocks, block_size, Hkv, D]`` after the step's writes."""
    layout, scale = batch.layout, batch.head_dim ** -0.5
    block_size, group = k_cache.shape[1], batch.num_heads // batch.num_kv_heads
    outs = []
    starts = layout.query_start_loc.tolist()
    for i, seq_len in enumerate(layout.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = layout.block_table[i].long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        values = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        q = batch.q[starts[i]:starts[i + 1]].float().transpose(0, 1)
        query_pos = torch.arange(seq_len - q.shape[1], seq_len)[:, None]
        scores = (q @ keys.transpose(1, 2) * scale).masked_fill(positions[None, :] > query_pos, float("-inf"))
        outs.append((F.softmax(scores, -1) @ values).transpose(0, 1))
    return torch.cat(outs)


def _check(batch: PagedBatch, atol: float) -> torch.Tensor:
    backend = SDPABackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    out, k_cache, v_cache = run_backend(backend, batch)
    torch.testing.assert_close(out.float(), _naive(batch, k_cache, v_cache), atol=atol, rtol=0)
    return out


def test_kernel_builds_where_the_cpu_has_avx512() -> None:
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert paged_decode_op() is not None


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decodes_match_naive_attention(dtype: torch.dtype, atol: float, heads: int, kv_heads: int,
                                       head_dim: int, block_size: int) -> None:
    # contexts that end inside, at the end of, and just past a block and a 16-wide vector
    requests = [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (99, 1)]
    _check(random_paged_batch(requests, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim), atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_between_prefills_match_naive_attention(dtype: torch.dtype) -> None:
    """Decodes that are not one contiguous run of rows, next to a fresh and a prefixed prefill."""
    requests = [(40, 1), (0, 9), (7, 1), (20, 6), (3, 1)]
    _check(random_paged_batch(requests, 6, 2, 32, 16, dtype, seed=1), atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_torch_path_agrees_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot run (no AVX-512, no compiler) the backend's torch ops give the same answer."""
    batch = random_paged_batch([(50, 1), (0, 4), (17, 1)], 9, 3, 64, 16, seed=2)
    with_kernel = _check(batch, atol=1e-5)
    monkeypatch.setattr(sdpa_backend, "paged_decode_op", lambda: None)
    torch.testing.assert_close(_check(batch, atol=1e-5), with_kernel, atol=1e-5, rtol=0)
