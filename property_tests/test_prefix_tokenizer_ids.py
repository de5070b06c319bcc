"""PrefixTokenizer gives exactly the tokenizer's own ids, whatever texts came before.

Texts are drawn from fragments chosen to sit on the pieces' edges: runs of spaces and newlines
(the expressions look past them), contractions, digit runs (Llama 3 cuts them in threes), letters
of several scripts, emoji (several bytes, tokens within a character), and the tokenizer's added
tokens. Each example encodes a few texts in turn, sharing starts of random lengths, so that cuts
fall anywhere, on tokenizers of the forms the reuse takes (byte-level with its own expression, a
Split expression before byte-level, a BOS template, added tokens that strip spaces) and on forms it
must refuse (a normalizer, a prefix space, an EOS template), where it tokenizes every text whole.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cadence.engine.prefix_tokenizer import PrefixTokenizer, reuses_prefixes

FRAGMENTS = ["hello", " world", " the", "The", "  ", "   ", "\n", "\n\n", " \n", "\t", "'s", "'ll", " don't",
             "1", "23", "4567", " 89", "3.14", ".", ",", "!?", " -", "über", " naïve", "日本語", " 😀", "😀😀",
             "é", "A", " x", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", " <mask> "]

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def trained() -> Tokenizer:
    """A byte-level BPE of 600 tokens trained on the fragments, so that its merges span them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["".join(FRAGMENTS[(i * 7 + j * 3) % len(FRAGMENTS)] for j in range(60)) for i in range(200)]
    backend.train_from_iterator(corpus, trainer)
    return backend


def variant(name: str) -> Any:
    """The trained tokenizer, changed as ``name`` says."""
    spec = json.loads(trained().to_str())
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    template = {"type": "TemplateProcessing", "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    if "split" in name:  # Llama 3's form
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level]}
    elif name == "bos":
        spec["post_processor"] = {**template, "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                          {"Sequence": {"id": "A", "type_id": 0}}]}
    elif name == "eos":
        spec["post_processor"] = {**template, "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                          {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}]}
    elif name == "nfc":
        spec["normalizer"] = {"type": "NFC"}
    elif name == "prefix_space":
        spec["pre_tokenizer"]["add_prefix_space"] = True
    backend = Tokenizer.from_str(json.dumps(spec))
    if "strip" in name:  # an added token that takes the spaces around it
        backend.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@cache
def tokenizer(name: str) -> Any:
    return variant(name)


REUSING = ["plain", "split", "bos", "strip", "split+strip"]
REFUSING = ["eos", "nfc", "prefix_space"]

texts = st.lists(st.sampled_from(FRAGMENTS), min_size=40, max_size=120).map("".join)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(REUSING + REFUSING), first=texts, rest=st.lists(
    st.tuples(st.floats(0.0, 1.0), texts, st.booleans()), min_size=1, max_size=4))
def test_ids_are_the_tokenizers_whatever_came_before(name: str, first: str,
                                                    rest: list[tuple[float, str, bool]]) -> None:
    hf = tokenizer(name)
    prefixed = PrefixTokenizer(hf, min_chars=16, min_shared=8)
    assert prefixed.enabled == (name in REUSING) == reuses_prefixes(hf)
    seen = [first]
    assert prefixed.encode(first) == hf(first).input_ids
    for share, tail, special in rest:
        before = seen[-1]
        text = before[:int(share * len(before))] + tail  # a start shared with the last text, of any length
        assert prefixed.encode(text, special) == hf(text, add_special_tokens=special).input_ids, text
        seen.append(text)
    if name in REFUSING:
        assert prefixed.reused_tokens == 0


def test_no_cut_follows_whitespace_that_an_added_token_strips() -> None:
    """Llama 3's expression ends a piece inside a run of spaces (after its newlines), and an added
    token stripping the spaces on its left takes the whole run, however far it reaches back: the
    cut must not be there, though it lies well before where the texts differ."""
    hf = tokenizer("split+strip")
    prefixed = PrefixTokenizer(hf, min_chars=16, min_shared=8)
    start = "hello world " * 10 + "\n\n" + " " * 40
    for text in (start + "end", start + "<mask> tail"):
        assert prefixed.encode(text) == hf(text).input_ids
    assert prefixed.reused_tokens > 0  # cut before the run instead
