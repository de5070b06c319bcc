"""The ``triton`` backend's kernels against the ``sdpa`` reference, and the engine running on them.

Without CUDA the kernels run in Triton's interpreter, which must be on before they are defined,
so this module sets ``TRITON_INTERPRET=1`` at import (collection) time, before anything imports
``cadence.backends.triton_kernels``. The variable changes nothing else in the process: only
Triton reads it, when a ``@triton.jit`` function is defined, and on the CPU nothing but these
kernels defines one. With CUDA the same tests run the compiled kernels on the GPU.

The interpreter is 10³–10⁴× slower than torch, so shapes are tiny and examples few.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence import LLM, SamplingParams
from cadence.backends import triton_kernels
from cadence.backends.registry import load_backend
from cadence.backends.testing import PagedBatch, random_paged_batch, run_backend, sdpa_reference
from cadence.backends.triton_backend import TritonBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Mantissa bits: the kernels compute in fp32 and round once, as the reference does, so only the
# fp32 summation order differs and a half-precision result may be one ulp off.
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    _, exponent = torch.frexp(ref.float())  # |ref| = m * 2^e with m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exponent - 1 - _MANTISSA_BITS[out.dtype])
    # Near zero, fp32 rounding of the O(1) terms that cancelled outweighs a tiny value's ulp.
    error = (out.float() - ref.float()).abs()
    excess = error - ulp.clamp(min=1e-5)
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements more than one ulp off (max error {error.max()})"


def _backend(batch: PagedBatch, partition_tokens: int | None = None) -> TritonBackend:
    backend = TritonBackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    backend.partition_tokens = partition_tokens
    return backend


def _check_against_sdpa(batch: PagedBatch, partition_tokens: int | None = None) -> None:
    out, k_cache, v_cache = run_backend(_backend(batch, partition_tokens), batch)
    ref_out, ref_k, ref_v = sdpa_reference(batch)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the write is a copy: exact
    _assert_close(out, ref_out)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[PagedBatch, int | None]:
    """Mixed batches: decodes (1 new token) and prefills, fresh or over a cached prefix."""
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4]))  # GQA ratio; 3 pads the head group
    requests = draw(st.lists(
        st.tuples(st.integers(0, 40), st.one_of(st.just(1), st.integers(2, 20))), min_size=1, max_size=4))
    batch = random_paged_batch(
        requests, num_kv_heads * group, num_kv_heads,
        head_dim=draw(st.sampled_from([64, 128])),
        block_size=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        device=DEVICE,
        seed=draw(st.integers(0, 2**16)),
    )
    return batch, draw(st.sampled_from([None, 16, 32]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_triton_matches_sdpa_on_mixed_paged_batches(case: tuple[PagedBatch, int | None]) -> None:
    _check_against_sdpa(*case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_over_long_ragged_contexts(dtype: torch.dtype) -> None:
    """Decodes only, split into many partitions, some of them empty for the shorter contexts."""
    batch = random_paged_batch([(150, 1), (36, 1), (0, 1), (95, 1)], 8, 2, 64, 16, dtype, DEVICE, seed=1)
    backend = _backend(batch, partition_tokens=16)
    assert backend.build_metadata(batch.layout, DEVICE).decodes.num_splits > 1  # type: ignore[union-attr]
    _check_against_sdpa(batch, partition_tokens=16)


def test_prefill_spans_several_query_and_key_tiles() -> None:
    """A long chunk over a cached prefix next to a fresh prompt and a decode between them."""
    batch = random_paged_batch([(21, 40), (0, 1), (0, 33)], 4, 1, 64, 16, torch.float32, DEVICE, seed=2)
    _check_against_sdpa(batch)


def test_reshape_and_cache_skips_padding_slots() -> None:
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([17, -1, 63], device=DEVICE)
    triton_kernels.reshape_and_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[17], k[0]) and torch.equal(flat_v[63], v[2])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2  # nothing written for the -1 slot


def test_num_decode_splits_fills_the_gpu_within_bounds() -> None:
    split = triton_kernels.num_decode_splits
    assert split(1000, num_programs=8, target_programs=4) == (1, 1024)  # already enough programs
    assert split(4096, num_programs=8, target_programs=528) == (32, 128)  # capped at MAX_SPLITS
    assert split(100, num_programs=1, target_programs=528) == (2, 64)  # never below one tile
    assert split(100, num_programs=1, target_programs=1, partition_tokens=20, block_n=16) == (4, 32)


def test_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        load_backend("triton", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not on 'meta'"):
        load_backend("triton", torch.device("meta"))


def test_check_model_rejects_heads_too_small_for_tl_dot() -> None:
    with pytest.raises(ValueError, match="head_dim >= 16"):
        TritonBackend.check_model(torch.float32, 8, 16)


def test_engine_greedy_tokens_equal_sdpa(make_tiny_model) -> None:
    """The whole engine on the interpreted kernels: prefix hits, chunked prefill, batched decodes."""
    folder = str(make_tiny_model("llama"))
    prompts = [[5, 17, 33, 9, 41, 7, 88, 12, 60, 3, 19, 25, 71, 40, 2, 99, 6, 14], [5, 17, 33, 9, 41, 7, 90],
               [250, 11, 4]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(model=folder, dtype="float32", attention_backend=backend, block_size=4,
                  max_num_batched_tokens=16, device=DEVICE.type)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["triton"] == outputs["sdpa"]
