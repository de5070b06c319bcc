"""The ``flash_attn`` backend: start-up errors everywhere; its plumbing on the CPU against a
stand-in that implements ``flash_attn_varlen_func``'s documented contract; the real kernels
against ``sdpa`` on a GPU (marked ``gpu``, skipped without CUDA and flash-attn)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence import LLM
from cadence.backends.flash_attn_backend import FlashAttnBackend
from cadence.backends.registry import load_backend
from cadence.backends.testing import (
    PagedBatch,
    output_and_definition,
    random_paged_batch,
    run_backend,
    sdpa_reference,
)

CPU = torch.device("cpu")
_REQUESTS = [(0, 7), (19, 1), (300, 5), (40, 1), (3, 12)]  # fresh, decodes, prefills over prefixes


def test_without_cuda_the_backend_refuses_to_start(make_tiny_model) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        load_backend("flash_attn", CPU)
    with pytest.raises(RuntimeError, match=r"flash_attn attention backend .* needs a CUDA device, not 'cpu'"):
        LLM(model=str(make_tiny_model("llama")), dtype="bfloat16", attention_backend="flash_attn")


def test_check_model_explains_what_flash_attention_cannot_serve() -> None:
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        FlashAttnBackend.check_model(torch.float32, 64, 16)
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        FlashAttnBackend.check_model(torch.bfloat16, 320, 16)
    FlashAttnBackend.check_model(torch.bfloat16, 128, 16)


def test_automatic_choice_skips_a_backend_that_cannot_serve_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA flash_attn comes first; under float32 (or here, on the CPU) it steps aside for the next."""
    from cadence.backends import registry
    from cadence.backends.sdpa_backend import SDPABackend

    monkeypatch.setattr(registry, "_auto_candidates", lambda device, installed: ["flash_attn"])
    assert load_backend(None, CPU, torch.float32, 64, 16) is SDPABackend


def _varlen_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn_varlen_func`` as its docstring (2.7/2.8) specifies it, in fp32 torch, with the
    preconditions its C++ checks: half-precision inputs, int32 offsets, paged blocks of 256n.
    ``window_size=(left, right)``: query i sees keys i + k_len - q_len - left to ... + right (-1: no
    bound); ``softcap`` > 0: scores ``softcap * tanh(scores * softmax_scale / softcap)``."""
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and causal and dropout_p == 0.0
    left, right = window_size
    assert left >= -1 and right in (-1, 0) and softcap >= 0.0  # causal: nothing to the right
    if block_table is not None:
        assert block_table.dtype == torch.int32 and k.shape[1] % 256 == 0
    group = q.shape[1] // k.shape[-2]
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        if block_table is None:
            keys, values = k[k0:k1], v[k0:k1]
        else:
            pos = torch.arange(k1 - k0)
            blocks = block_table[b, pos // k.shape[1]].long()
            keys, values = k[blocks, pos % k.shape[1]], v[blocks, pos % k.shape[1]]
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys.float().repeat_interleave(group, 1))
        # causal, aligned to the bottom right: query i sees keys up to (k1 - k0) - (q1 - q0) + i
        aligned = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        visible = torch.arange(k1 - k0)[None, :] <= aligned
        if left >= 0:
            visible &= torch.arange(k1 - k0)[None, :] >= aligned - left
        scores = scores * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values.float().repeat_interleave(group, 1)).to(q.dtype)
    return out


@pytest.mark.parametrize("block_size", [16, 256], ids=["gathered", "paged"])
def test_plumbing_against_the_varlen_contract(monkeypatch: pytest.MonkeyPatch, block_size: int) -> None:
    """Metadata, cache write and the gathered or paged call, on the CPU through a stand-in."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_contract))
    batch = random_paged_batch(_REQUESTS, 6, 2, 64, block_size, torch.bfloat16, CPU, seed=3)
    _check_against_sdpa(batch)


def _check_against_sdpa(batch: PagedBatch) -> None:
    backend = FlashAttnBackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    out, k_cache, v_cache = run_backend(backend, batch)
    ref_out, ref_k, ref_v = sdpa_reference(batch)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    # FlashAttention rounds the probabilities to bf16 before P @ V: a few ulps, not one.
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def _install_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The stand-in as ``flash_attn``; returns the calls it gets: keyword arguments, ``keys`` (the
    number of key rows handed to it: the gathered contexts, or the paged cache) and ``max_seqlen_k``."""
    calls: list[dict[str, Any]] = []

    def varlen(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append({"keys": args[1].shape[0], "max_seqlen_k": args[6], **kwargs})
        return _varlen_contract(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    return calls


def _check_against_definition(backend: FlashAttnBackend, batch: PagedBatch, metadata: object = None) -> None:
    torch.testing.assert_close(*output_and_definition(backend, batch, metadata), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 256], ids=["gathered", "paged"])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (24, None), (1, None), (4000, None), (None, 1.5),
                                             (24, 1.5)])
def test_window_and_soft_cap_reach_flash_attention(monkeypatch: pytest.MonkeyPatch, block_size: int,
                                                   window: int | None, cap: float | None) -> None:
    """The contract's window ``p - window + 1 .. p`` is FlashAttention's ``(window - 1, 0)``."""
    calls = _install_stand_in(monkeypatch)
    batch = random_paged_batch(_REQUESTS, 6, 2, 64, block_size, torch.bfloat16, CPU, seed=5)
    if cap is not None:  # scores of tens, far past the cap
        batch = dataclasses.replace(batch, q=batch.q * 30)
    _check_against_definition(FlashAttnBackend(6, 2, 64, 0.125, sliding_window=window, logits_soft_cap=cap), batch)
    (call,) = calls
    assert call["window_size"] == ((-1, -1) if window is None else (window - 1, 0))
    assert call["softcap"] == (cap or 0.0) and call["softmax_scale"] == 0.125


def test_a_windowed_layer_gathers_only_what_its_queries_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding and global layers share the step's metadata, whichever built it; each gathers its own
    contexts (the sliding one only their tails)."""
    calls = _install_stand_in(monkeypatch)
    batch = random_paged_batch(_REQUESTS, 6, 2, 64, 16, torch.bfloat16, CPU, seed=6)
    every, sliding = FlashAttnBackend(6, 2, 64, 0.125), FlashAttnBackend(6, 2, 64, 0.125, sliding_window=24)
    for builder in (every, sliding):
        metadata = builder.build_metadata(batch.layout, CPU)
        for layer in (sliding, every, sliding):
            _check_against_definition(layer, batch, metadata)
    # (cached, new) -> min(context, new + 23) keys for the sliding layers, the whole context otherwise
    tails, contexts = 7 + 20 + 28 + 24 + 15, 7 + 20 + 305 + 41 + 15
    assert [c["keys"] for c in calls] == [tails, contexts, tails] * 2
    assert [c["max_seqlen_k"] for c in calls] == [28, 305, 28] * 2


_NO_FLASH = not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None


@pytest.mark.gpu
@pytest.mark.skipif(_NO_FLASH, reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("block_size", [16, 256], ids=["gathered", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_matches_sdpa_on_the_gpu(block_size: int, dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    FlashAttnBackend.check_device(cuda)
    batch = random_paged_batch(_REQUESTS * 3, 32, 8, 128, block_size, dtype, cuda, seed=4)
    _check_against_sdpa(batch)


@pytest.mark.gpu
@pytest.mark.skipif(_NO_FLASH, reason="needs CUDA and flash-attn")
def test_engine_on_flash_attention_matches_sdpa(make_tiny_model) -> None:
    folder: Path = make_tiny_model("llama", head_dim=64)
    prompts = [[5, 17, 33, 9, 41, 7, 88, 12, 60, 3], [5, 17, 33, 9, 41, 7, 90], [250, 11, 4]]
    from cadence import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "flash_attn"):
        llm = LLM(model=str(folder), dtype="bfloat16", attention_backend=backend, device="cuda")
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["flash_attn"] == outputs["sdpa"]
