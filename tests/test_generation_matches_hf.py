"""Greedy generation is token-for-token identical to Hugging Face transformers (fp32), whatever
the engine does around it: prefix caching, chunked prefill, batching, preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.reference import greedy, hf_greedy, hf_log_softmax, random_prompts

from cadence import LLM, SamplingParams

NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path]) -> tuple[Path, list, list]:
    folder = make_tiny_model(request.param)
    prompts = random_prompts(0, 12, 320, (5, 90))
    return folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS)


ENGINE_VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "xxhash-prefix-keys": {"prefix_caching_hash_algo": "xxhash"},
    "chunked-small-budget": {"max_num_batched_tokens": 24, "block_size": 4},
    "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    # 12 requests of up to ~146 tokens cannot all fit in 40 blocks of 16: some are preempted.
    "tiny-kv-pool": {"num_kv_blocks": 40},
    "one-seat": {"max_num_seqs": 1},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(tiny: tuple[Path, list, list], variant: str) -> None:
    folder, prompts, expected = tiny
    llm = LLM(model=str(folder), dtype="float32", **ENGINE_VARIANTS[variant])
    assert greedy(llm, prompts, NEW_TOKENS) == expected
    if variant == "tiny-kv-pool":
        assert llm.engine_core.scheduler.num_preemptions > 0
    if variant in ("default", "xxhash-prefix-keys"):
        assert llm.engine_core.allocator.prefix_cache_hits > 0


def test_alone_equals_in_a_batch_of_32(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(1, 32, 320, (3, 120))
    llm = LLM(model=str(folder), dtype="float32")
    batched = greedy(llm, prompts, NEW_TOKENS)
    alone = [greedy(llm, [p], NEW_TOKENS)[0] for p in prompts[:6]]
    assert alone == batched[:6]
    assert all(len(t) == NEW_TOKENS for t in batched)


def test_logprobs_match_transformers_log_softmax(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("qwen2")
    prompt = random_prompts(2, 3, 320, (10, 30))[0]
    llm = LLM(model=str(folder), dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    reference = hf_log_softmax(folder, prompt, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == 8
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(reference[step, token].item(), abs=1e-4)
        top = torch.topk(reference[step], 3)
        assert entry.token_ids[1:] == top.indices.tolist()
        assert entry.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.sampled_rank == 1  # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(e.logprobs[0] for e in out.logprobs), abs=1e-5)


def test_engine_config_rejects_unknown_policy_with_the_installed_list(make_tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'nope'; installed policies: .*fcfs"):
        LLM(model=str(make_tiny_model("llama")), policy="nope")


def test_engine_is_a_plain_object_between_runs(make_tiny_model: Callable[..., Path]) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32")
    greedy(llm, random_prompts(3, 4, 320, (5, 20)), NEW_TOKENS)
    engine = llm.engine_core
    assert not engine.scheduler.requests
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_integrity()
