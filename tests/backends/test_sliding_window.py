"""Sliding windows and soft-capped scores in the ``sdpa`` backend, through its C++ kernel (decodes,
prefill tiles over cached prefixes, chunks that begin mid-block) and through its torch ops, against
the definition (``naive_reference``: fp64, one token at a time)."""

from __future__ import annotations

import pytest
import torch

from cadence.backends import sdpa_backend
from cadence.backends.cpu_kernels import cpu_ops
from cadence.backends.sdpa_backend import SDPABackend
from cadence.backends.testing import large_paged_batch, naive_reference, random_paged_batch, run_backend

# Decodes with contexts shorter and longer than the windows, fresh prefills longer than a 16-row
# tile, and prefill chunks over cached prefixes (the window then starts inside the cache).
REQUESTS = [(40, 1), (0, 9), (7, 1), (20, 6), (3, 1), (16, 16), (0, 37), (5, 17), (90, 1), (61, 12)]
# A step of decodes only (the backend's metadata takes a shorter road there), contexts inside, at and
# past block ends and the windows.
DECODES = [(40, 1), (0, 1), (15, 1), (4, 1), (90, 1), (31, 1)]
PATHS = ["kernel", "torch"]


@pytest.fixture(autouse=True)
def _kernel_on_prefills(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel path on prefill rows too, wherever it is built (over SIMDe the backend sends steps
    with prefills to torch's SDPA, but the kernel's tiles must stay right there)."""
    monkeypatch.setattr(sdpa_backend, "attention_takes_prefills", lambda: True)


def _attend(path: str, window: int | None, cap: float | None, dtype: torch.dtype, head_dim: int, block_size: int,
            monkeypatch: pytest.MonkeyPatch, requests: list[tuple[int, int]] = REQUESTS,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if path == "kernel" and cpu_ops() is None:
        pytest.skip("cadence's CPU kernels need AVX-512 or AVX2")
    if path == "torch":
        monkeypatch.setattr(sdpa_backend, "cpu_ops", lambda: None)
    batch = random_paged_batch(requests, 6, 2, head_dim, block_size, dtype, seed=block_size)
    scale = head_dim ** -0.5
    backend = SDPABackend(6, 2, head_dim, scale, sliding_window=window, logits_soft_cap=cap)
    out, _, _ = run_backend(backend, batch)
    return out.double(), naive_reference(batch, scale, window, cap)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_window_matches_the_definition(path: str, window: int, block_size: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out, expected = _attend(path, window, None, torch.float32, 32, block_size, monkeypatch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [None, 12])
def test_soft_capped_scores_match_the_definition(path: str, window: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A cap of 0.5 against scores of order 1 changes every output: a cap that was ignored would show.
    out, expected = _attend(path, window, 0.5, torch.float32, 64, 16, monkeypatch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    uncapped, _ = _attend(path, window, None, torch.float32, 64, 16, monkeypatch)
    assert (uncapped - expected).abs().max() > 1e-2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("window", "cap"), [(None, None), (5, None), (16, 0.5), (33, None)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_steps_of_decodes_only_match_the_definition(path: str, window: int | None, cap: float | None,
                                                    block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    out, expected = _attend(path, window, cap, torch.float32, 32, block_size, monkeypatch, DECODES)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_windows_stay_within_rounding(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out, expected = _attend(path, 20, 30.0, torch.bfloat16, 128, 16, monkeypatch)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=0)


def test_a_window_or_cap_that_means_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        SDPABackend(4, 2, 16, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        SDPABackend(4, 2, 16, 0.25, logits_soft_cap=-1.0)


def test_a_large_batch_built_in_tensor_ops_is_a_valid_paged_batch() -> None:
    # large_paged_batch (benchmarks/gpu_check.py's timing batches) lays out what the backends read
    # exactly as the model runner does: the backend's output equals the definition's.
    batch = large_paged_batch([(40, 1), (0, 9), (23, 5)], 4, 2, 32, 16, torch.float32, "cpu")
    table, slots = batch.layout.block_table, batch.layout.slot_mapping
    assert len(set(table[table > 0].tolist())) == int((table > 0).sum())  # no block twice
    assert len(set(slots.tolist())) == slots.numel() == 15
    out, _, _ = run_backend(SDPABackend(4, 2, 32, 32 ** -0.5, sliding_window=8), batch)
    torch.testing.assert_close(out.double(), naive_reference(batch, 32 ** -0.5, 8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention_path", ["amx", "bf16_dot"], indirect=True)
@pytest.mark.parametrize(("window", "cap"), [(5, None), (33, None), (None, 0.5), (12, 0.5)])
def test_bf16_prefill_tiles_on_packed_keys_match_the_definition(attention_path: str, window: int | None,
                                                                cap: float | None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths over packed keys (attention_packed.cpp: the tile unit, VDPBF16PS) window and cap their rows'
    scores as the fp32 one does."""
    out, expected = _attend("kernel", window, cap, torch.bfloat16, 64, 5, monkeypatch)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=0)
