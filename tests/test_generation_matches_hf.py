"""Greedy generation is token-for-token identical to Hugging Face transformers (fp32), whatever
the engine does around it: prefix caching, chunked prefill, batching, preemption."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cadence import LLM, SamplingParams

NEW_TOKENS = 16


def hf_greedy(folder: Path | str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine side runs with ignore_eos
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def random_prompts(seed: int, count: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
    # Shared prefixes make the prefix cache hit.
    prompts[1] = prompts[0][:40] + prompts[1]
    prompts[2] = prompts[0][:33] + prompts[2]
    return prompts


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path]) -> tuple[Path, list, list]:
    folder = make_tiny_model(request.param)
    prompts = random_prompts(0, 12, 320, (5, 90))
    return folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS)


ENGINE_VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
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
    assert greedy(llm, prompts) == expected
    if variant == "tiny-kv-pool":
        assert llm.engine_core.scheduler.num_preemptions > 0
    if variant == "default":
        assert llm.engine_core.allocator.prefix_cache_hits > 0


def test_alone_equals_in_a_batch_of_32(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(1, 32, 320, (3, 120))
    llm = LLM(model=str(folder), dtype="float32")
    batched = greedy(llm, prompts)
    alone = [greedy(llm, [p])[0] for p in prompts[:6]]
    assert alone == batched[:6]
    assert all(len(t) == NEW_TOKENS for t in batched)


def test_logprobs_match_transformers_log_softmax(make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("qwen2")
    prompt = random_prompts(2, 3, 320, (10, 30))[0]
    llm = LLM(model=str(folder), dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
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
    greedy(llm, random_prompts(3, 4, 320, (5, 20)))
    engine = llm.engine_core
    assert not engine.scheduler.requests
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_integrity()
