"""PrefixTokenizer on the tiny byte-level tokenizer: when it reuses a recent text's ids, and that
its ids are the tokenizer's own (property_tests/test_prefix_tokenizer_ids.py draws the texts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support.tiny_models import build_tiny_tokenizer

from cadence.engine.prefix_tokenizer import MARGIN, MAX_KEYS, MIN_CHARS, PER_KEY, PrefixTokenizer

SYSTEM = "You are a helpful assistant. Answer in one sentence, and cite your sources. " * 30  # 2,310 chars


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special).input_ids)


def test_prompts_sharing_a_long_start_reuse_its_ids(tokenizer: Any) -> None:
    prefixed = PrefixTokenizer(tokenizer)
    assert prefixed.enabled
    first, second = SYSTEM + "Where is Paris?", SYSTEM + "How tall is the Eiffel tower?"
    assert prefixed.encode(first) == ids(tokenizer, first)
    assert prefixed.reused_tokens == 0
    assert prefixed.encode(second) == ids(tokenizer, second)
    # The shared start's ids but for its last MARGIN characters or so, where the texts may cut apart.
    shared = len(ids(tokenizer, SYSTEM))
    assert len(ids(tokenizer, SYSTEM[:-2 * MARGIN])) <= prefixed.reused_tokens <= shared
    assert prefixed.encode(second, False) == ids(tokenizer, second, False)


def test_each_turn_of_a_conversation_reuses_the_turn_before(tokenizer: Any) -> None:
    prefixed = PrefixTokenizer(tokenizer)
    text, previous = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", 0
    question = "why is the sky blue? " * 30
    for turn in range(4):
        text += f"<|im_start|>user\nQuestion {turn}: {question}<|im_end|>\n<|im_start|>assistant\n"
        before = prefixed.reused_tokens
        assert prefixed.encode(text, False) == ids(tokenizer, text, False)
        # the turn before, but for its end (cuts keep MARGIN characters from added tokens)
        assert prefixed.reused_tokens - before >= previous - 3 * MARGIN
        previous = len(ids(tokenizer, text, False))
        text += "Because of Rayleigh scattering. " * 20 + "<|im_end|>\n"


def test_short_and_unrelated_texts_are_tokenized_whole(tokenizer: Any) -> None:
    prefixed = PrefixTokenizer(tokenizer)
    short = SYSTEM[:MIN_CHARS - 1]  # not kept: tokenized whole, it costs little
    for text in (short, SYSTEM, "Something else entirely. " * 60, SYSTEM[:400] + "A new ending. " * 60):
        assert prefixed.encode(text) == ids(tokenizer, text)
    assert prefixed.reused_tokens == 0  # the others share too little with what came before


def test_the_least_recently_used_texts_are_forgotten(tokenizer: Any) -> None:
    prefixed = PrefixTokenizer(tokenizer)
    prefixed.encode(SYSTEM + "first")
    for i in range(MAX_KEYS * PER_KEY):  # each its own start: MAX_KEYS starts are kept
        prefixed.encode(f"{i:04d} " + SYSTEM)
    prefixed.encode(SYSTEM + "second")
    assert prefixed.reused_tokens == 0
    prefixed.encode(SYSTEM + "third")  # the second is kept now
    assert prefixed.reused_tokens > 0


def test_concurrent_prompts_get_exact_ids(tokenizer: Any) -> None:
    """The API tokenizes in worker threads, all through one PrefixTokenizer."""
    prefixed = PrefixTokenizer(tokenizer)
    texts = [SYSTEM[:1500 + 37 * i] + f" question {i}: " + "and more words " * (i % 7) for i in range(48)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(prefixed.encode, texts))
    assert got == [ids(tokenizer, text) for text in texts]
    assert prefixed.reused_tokens > 0
