"""``SamplingParams.prompt_logprobs``: the logprobs of a prompt's tokens (the first one None), equal to
transformers' log-softmax in fp32, whole however the prompt was cut into chunks, once however often
a preemption made it recompute, and computed anew over a warm prefix cache (which such a request
does not read, as in vLLM)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.reference import hf_log_softmax, random_prompts
from support.tiny_models import TINY_VOCAB

from cadence import LLM, SamplingParams


def test_prompt_logprobs_match_transformers_through_chunks_preemptions_and_a_warm_cache(
        make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model("llama")
    prompts = random_prompts(1, 6, TINY_VOCAB, (20, 60))
    # 32-token steps cut every prompt; 30 blocks of 4 hold the longest request but not all six.
    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=32, block_size=4, num_kv_blocks=30)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    references = [hf_log_softmax(folder, prompt[:1], prompt[1:]) for prompt in prompts]
    for _ in range(2):  # the second run over a warm prefix cache
        for prompt, reference, output in zip(prompts, references, llm.generate(prompts, params, use_tqdm=False),
                                             strict=True):
            entries = output.prompt_logprobs
            assert entries is not None and len(entries) == len(prompt) and entries[0] is None
            for i, entry in enumerate(entries[1:]):
                assert entry is not None
                token, row = prompt[i + 1], reference[i]
                assert entry.token_ids[0] == token
                assert entry.logprobs[0] == pytest.approx(row[token].item(), abs=1e-4)
                # The top two and the rank, as far as fp32 rounding (1e-4) can order near ties.
                assert entry.logprobs[1:] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
                assert [row[t].item() for t in entry.token_ids[1:]] == pytest.approx(entry.logprobs[1:], abs=1e-4)
                lp = row[token].item()
                assert int((row > lp + 1e-4).sum()) < entry.sampled_rank <= int((row > lp - 1e-4).sum()) + 1
    assert llm.engine_core.scheduler.num_preemptions > 0


def test_without_prompt_logprobs_there_are_none_and_zero_gives_the_tokens_own(
        make_tiny_model: Callable[..., Path]) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32")
    prompt = [5, 6, 7, 8, 9]
    plain, own = llm.generate([prompt, prompt], [SamplingParams(max_tokens=1), SamplingParams(
        max_tokens=1, prompt_logprobs=0)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert own.prompt_logprobs is not None
    assert [e.token_ids if e else None for e in own.prompt_logprobs] == [None, [6], [7], [8], [9]]
