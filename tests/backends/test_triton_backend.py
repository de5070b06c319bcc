"""The ``triton`` backend's kernels against the ``sdpa`` reference (sliding windows and soft-capping
against their definition, ``naive_reference``), and the engine running on them.

Without CUDA the kernels run in Triton's interpreter, which must be on before they are defined,
so this module sets ``TRITON_INTERPRET=1`` at import (collection) time, before anything imports
``cadence.backends.triton_kernels``. The variable changes nothing else in the process: only
Triton reads it, when a ``@triton.jit`` function is defined, and on the CPU nothing but these
kernels defines one. With CUDA the same tests run the compiled kernels on the GPU.

The interpreter is 10³–10⁴× slower than torch, so shapes are tiny and examples few.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence import LLM, SamplingParams
from cadence.backends import triton_kernels
from cadence.backends.registry import load_backend
from cadence.backends.testing import (
    PagedBatch,
    naive_reference,
    output_and_definition,
    random_paged_batch,
    run_backend,
    sdpa_reference,
)
from cadence.backends.triton_backend import TritonBackend
from cadence.backends.triton_kernels.scores import soft_cap

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Mantissa bits: the interpreted kernels compute in fp32 and round once, as the reference does, so
# only the fp32 summation order differs and a half-precision result may be one ulp off.
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _assert_close(out: torch.Tensor, ref: torch.Tensor, batch: PagedBatch, backend: TritonBackend) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    _, exponent = torch.frexp(ref.float())  # |ref| = m * 2^e with m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exponent - 1 - _MANTISSA_BITS[out.dtype])
    # Near zero, fp32 rounding of the O(1) terms that cancelled outweighs a tiny value's ulp.
    bound = ulp.clamp(min=1e-5)
    if not triton_kernels.INTERPRETED:
        # Compiled, the kernels feed P @ V to the tensor cores in the cache's dtype: each softmax
        # weight is rounded once (relative error 2^-(mantissa + 1); an fp16 subnormal's error is
        # under 2^-25, far inside this), so an output moves by at most that much of sum_j p_j |v_j|
        # besides its own rounding: the same attention over |V|.
        absolute = dataclasses.replace(batch, v=batch.v.abs(), v_cache=batch.v_cache.abs())
        weighted = naive_reference(absolute, backend.scale, backend.sliding_window, backend.logits_soft_cap)
        bound = bound + weighted.float() * 2.0 ** -(_MANTISSA_BITS[out.dtype] + 1)
    error = (out.float() - ref.float()).abs()
    excess = error - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements off by more than the bound (max error {error.max()})"


def _backend(batch: PagedBatch, partition_tokens: int | None = None) -> TritonBackend:
    backend = TritonBackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5)
    backend.partition_tokens = partition_tokens
    return backend


def _check_against_sdpa(batch: PagedBatch, partition_tokens: int | None = None) -> None:
    backend = _backend(batch, partition_tokens)
    out, k_cache, v_cache = run_backend(backend, batch)
    ref_out, ref_k, ref_v = sdpa_reference(batch)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the write is a copy: exact
    _assert_close(out, ref_out, batch, backend)


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
    decodes = backend.build_metadata(batch.layout, DEVICE).decodes
    assert decodes is not None and backend.decode_splits(decodes, DEVICE)[0] > 1
    _check_against_sdpa(batch, partition_tokens=16)


def test_prefill_spans_several_query_and_key_tiles() -> None:
    """A long chunk over a cached prefix next to a fresh prompt and a decode between them."""
    batch = random_paged_batch([(21, 40), (0, 1), (0, 33)], 4, 1, 64, 16, torch.float32, DEVICE, seed=2)
    _check_against_sdpa(batch)


# ---- sliding windows and logit soft-capping, against their definition (fp64, one token at a time) ----

# (requests, sliding window, soft-cap, forced split-K partition), on 4 query heads over 2 KV heads, head
# dim 32, blocks of 8, so that windows start mid-block and mid-tile (the interpreter's tiles are 16).
_WINDOW_CASES = {
    "decodes, window < context, split-K": ([(150, 1), (36, 1), (0, 1), (95, 1), (7, 1)], 40, None, 16),
    "prefill chunks over prefixes, window < context": ([(37, 20), (0, 33), (12, 1)], 12, None, None),
    "window longer than every context": ([(37, 20), (150, 1), (0, 9)], 1000, None, None),
    "window of one": ([(37, 20), (150, 1), (0, 9)], 1, None, None),
    "soft-cap, scores far past it": ([(37, 20), (150, 1), (0, 9)], None, 1.5, None),
    "soft-cap in a window, split-K": ([(37, 20), (150, 1), (5, 30)], 24, 1.5, 16),
}


def _windowed(batch: PagedBatch, window: int | None = None, cap: float | None = None,
              partition_tokens: int | None = None) -> TritonBackend:
    """The interpreter's tiles of 16 keys and queries on the GPU too, where the cases were laid out for them."""
    backend = TritonBackend(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5,
                            sliding_window=window, logits_soft_cap=cap)
    backend.partition_tokens = partition_tokens
    backend.decode_block_n = backend.prefill_block_m = backend.prefill_block_n = 16
    return backend


def _check_against_definition(backend: TritonBackend, batch: PagedBatch, metadata: object = None) -> None:
    _assert_close(*output_and_definition(backend, batch, metadata), batch, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_WINDOW_CASES))
def test_sliding_window_and_soft_cap_match_their_definition(case: str, dtype: torch.dtype) -> None:
    requests, window, cap, partition_tokens = _WINDOW_CASES[case]
    batch = random_paged_batch(requests, 4, 2, 32, 8, dtype, DEVICE, seed=len(case))
    if cap is not None:  # scores of tens, where tanh saturates (and a naive exp(2x) would overflow)
        batch = dataclasses.replace(batch, q=batch.q * 30)
    _check_against_definition(_windowed(batch, window, cap, partition_tokens), batch)


def test_decode_partitions_tile_the_window_not_the_context() -> None:
    batch = random_paged_batch([(150, 1), (36, 1)], 4, 2, 32, 8, torch.float32, DEVICE)
    decodes = _windowed(batch).build_metadata(batch.layout, DEVICE).decodes
    assert decodes is not None
    assert _windowed(batch, partition_tokens=16).decode_splits(decodes, DEVICE) == (10, 16)  # 151 tokens
    assert _windowed(batch, 40, partition_tokens=16).decode_splits(decodes, DEVICE) == (3, 16)  # the last 40
    assert _windowed(batch, 1000, partition_tokens=16).decode_splits(decodes, DEVICE) == (10, 16)


def _poison_unseen(batch: PagedBatch, window: int) -> tuple[PagedBatch, int]:
    """The batch with NaN in every cached K/V row that no query of its request can see (read, even
    under a mask, a NaN value row turns the output NaN), and how many rows that is."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    block_size, starts = k_cache.shape[1], batch.layout.query_start_loc.tolist()
    slots = []
    for request, seq_len in enumerate(batch.layout.seq_lens.tolist()):
        table = batch.layout.block_table[request].tolist()
        first_seen = seq_len - (starts[request + 1] - starts[request]) - window + 1  # by the first query
        slots += [table[p // block_size] * block_size + p % block_size for p in range(max(first_seen, 0))]
    flat_k[slots] = flat_v[slots] = float("nan")
    return dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache), len(slots)


def test_keys_before_every_window_are_never_read() -> None:
    """Whole tiles and partitions before the window are skipped, and partial ones masked on load."""
    batch = random_paged_batch([(150, 1), (36, 1), (61, 20), (3, 40)], 4, 2, 32, 8, torch.float32, DEVICE, seed=6)
    poisoned, count = _poison_unseen(batch, window=16)
    assert count == 135 + 21 + 46  # positions before 151 - 16, 37 - 16 and 61 - 15
    backend = _windowed(poisoned, 16, partition_tokens=16)
    backend.prefill_block_m = 32  # taller than a key tile: some rows see no key in the walk's first tile
    _check_against_definition(backend, poisoned)


def test_layers_with_different_windows_share_one_steps_metadata() -> None:
    """Gemma's sliding and global layers: whichever built the step's metadata, each layer attends
    with its own window (split-K included)."""
    batch = random_paged_batch([(150, 1), (36, 1), (21, 20)], 4, 2, 32, 8, torch.float32, DEVICE, seed=7)
    every, sliding = _windowed(batch, partition_tokens=16), _windowed(batch, 24, partition_tokens=16)
    for builder, layer in ((every, sliding), (sliding, every)):
        _check_against_definition(layer, batch, builder.build_metadata(batch.layout, DEVICE))


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



@triton.jit
def _soft_cap_kernel(x_ptr, out_ptr, N: tl.constexpr, CAP: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, soft_cap(tl.load(x_ptr + offsets), CAP))


def test_soft_cap_is_cap_times_tanh_without_overflow() -> None:
    # Around zero, around the cap, and far past it (exp(2|x|) would overflow fp32 there).
    x = torch.tensor([0.0, 1e-6, -1e-6, 0.3, -0.3, 2.5, -2.5, 20.0, -20.0, 1e4, -1e4, 3e38, -3e38, 7.0, -7.0, 49.0],
                     device=DEVICE)
    out = torch.empty_like(x)
    _soft_cap_kernel[(1,)](x, out, N=16, CAP=5.0)
    expected = torch.tanh(x.double() / 5.0) * 5.0
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
