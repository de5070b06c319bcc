"""IncrementalDetokenizer on SmolLM2's real tokenizer: equality with ``decode``, held-back bytes, stops."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from cadence.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from cadence.sampling_params import SamplingParams

VOCAB_SIZE = 49152
IM_START, IM_END = 1, 2
PROMPT = "<|im_start|>user\nTell me about the world.<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    "The capital of France is Paris.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽.",
    "naïve café — résumé, Ωμέγα, добрый день, مرحبا",
    "def f(x):\n\treturn x ** 2  # squares\n\n\n    indented\r\nwindows line",
    "   leading spaces, trailing spaces   ",
    "mixed😀text中文and🎉more",
    "Zalgo: Z̴̧a̷l̸g̵o combining marks",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return smollm2_tokenizer


class PythonBackendLike:
    """Hides the Rust backend, so the detokenizer takes its slow-tokenizer path.

    ``decode`` is composed the way transformers 5's ``PythonBackend._decode`` composes it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return self._tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


@pytest.fixture(scope="module", params=["decode_stream", "offsets"])
def any_tokenizer(request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase):
    return tokenizer if request.param == "decode_stream" else PythonBackendLike(tokenizer)


def make_detokenizer(tokenizer, prompt: str = PROMPT, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))


def feed(
    detokenizer: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
) -> list[DetokenizerUpdate]:
    """Feed ``ids`` in chunks of the given sizes (cycled), one at a time by default."""
    sizes = chunks or [1]
    updates, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)]
        updates.append(detokenizer.update(ids[i:i + size]))
        i, k = i + size, k + 1
    return updates


def streamed(detokenizer: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> str:
    text = "".join(u.new_text for u in feed(detokenizer, ids, chunks)) + detokenizer.flush()
    assert text == detokenizer.output_text
    return text


def expected_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the match that ends first (ties: starts first) cuts the full decode."""
    matches = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if not matches:
        return full, None
    end, start, stop = min(matches)
    return full[: end if include else start], stop


# --- equality with tokenizer.decode -------------------------------------------------------------

def test_fast_tokenizer_uses_decode_stream(tokenizer):
    assert type(make_detokenizer(tokenizer)._stream).__name__ == "_FastStream"
    assert type(make_detokenizer(PythonBackendLike(tokenizer))._stream).__name__ == "_OffsetStream"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tokenizer, any_tokenizer, text, skip):
    ids = [*tokenizer.encode(text), IM_END]
    detokenizer = make_detokenizer(any_tokenizer, skip_special_tokens=skip)
    updates = feed(detokenizer, ids)
    # Valid text never shows a replacement character, not even transiently.
    assert all("\ufffd" not in u.new_text for u in updates)
    assert "".join(u.new_text for u in updates) + detokenizer.flush() == tokenizer.decode(
        ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(6))
def test_chunks_match_decode(tokenizer, any_tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(rng.sample(TEXTS, 4)))
    chunks = [rng.randint(1, 5) for _ in range(7)]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed(make_detokenizer(any_tokenizer), ids, chunks) == expected


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4), skip=st.booleans())
def test_random_ids_match_decode(any_tokenizer, ids, chunks, skip):
    # Random ids include stray UTF-8 continuation bytes and special tokens in the middle.
    expected = any_tokenizer.decode(ids, skip_special_tokens=skip)
    assert streamed(make_detokenizer(any_tokenizer, skip_special_tokens=skip), ids, chunks) == expected


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=30),
       prompt_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=30))
def test_any_prompt_context_leaves_output_unchanged(tokenizer, ids, prompt_ids):
    # Byte-level BPE decodes context-free, so the prompt (even one ending mid-character) must not leak in.
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    assert streamed(detokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_sentencepiece_output_continues_the_prompt():
    # Metaspace decoders drop the first token's leading space in ``decode(output_ids)``; decoded after
    # the prompt, the output keeps it, so prompt + output reads as the model wrote it.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁Say": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert metaspace.decode([1, 2]) == "Hello world"
    for tokenizer in (metaspace, PythonBackendLike(metaspace)):
        assert streamed(IncrementalDetokenizer(tokenizer, [], SamplingParams()), [1, 2]) == "Hello world"
        assert streamed(IncrementalDetokenizer(tokenizer, [3], SamplingParams()), [1, 2]) == " Hello world"


# --- multi-byte characters ----------------------------------------------------------------------

def test_partial_character_is_held_back(tokenizer, any_tokenizer):
    ids = tokenizer.encode(" 😀!")
    assert len(ids) == 3  # ' ' + first bytes of 😀, its last byte, '!'
    detokenizer = make_detokenizer(any_tokenizer)
    assert [u.new_text for u in feed(detokenizer, ids)] == ["", " 😀", "!"]


def test_cjk_character_split_over_three_tokens(tokenizer, any_tokenizer):
    ids = tokenizer.encode("界")
    assert len(ids) == 3
    detokenizer = make_detokenizer(any_tokenizer)
    assert [u.new_text for u in feed(detokenizer, ids)] == ["", "", "界"]


def test_flush_releases_incomplete_character_as_decode_does(tokenizer, any_tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # the sequence ends mid-character (max_tokens)
    detokenizer = make_detokenizer(any_tokenizer)
    assert "".join(u.new_text for u in feed(detokenizer, ids)) == "ok"
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    assert detokenizer.output_text == tokenizer.decode(ids)


def test_bytes_that_never_form_a_character_are_released_as_replacement_characters(tokenizer, any_tokenizer):
    """A model looping on a stray UTF-8 continuation byte (seed 11 of the prefix-repetition bench did,
    128 times): after 4 held tokens every U+FFFD but the last 3 is released, instead of the stream
    staying silent to its end; the text is still decode's."""
    stray = 24211
    assert tokenizer.decode([stray]) == "\ufffd" and tokenizer.decode([stray] * 2) == "\ufffd" * 2
    ids = [stray] * 12 + tokenizer.encode(" ok")
    detokenizer = make_detokenizer(any_tokenizer)
    texts = [u.new_text for u in feed(detokenizer, ids)]
    assert texts[:12] == [""] * 3 + ["\ufffd"] * 9
    assert "".join(texts) + detokenizer.flush() == tokenizer.decode(ids) == "\ufffd" * 12 + " ok"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(111, 251), st.integers(0, VOCAB_SIZE - 1)), min_size=1, max_size=40),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_runs_of_byte_tokens_match_decode(any_tokenizer, ids, chunks):
    # SmolLM2's single-byte tokens (lead and continuation bytes among them) in runs long enough to
    # release broken bytes early: what was released as U+FFFD must be what decode shows.
    expected = any_tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed(make_detokenizer(any_tokenizer), ids, chunks) == expected


def test_an_unfinished_character_after_stray_bytes_is_still_held_until_complete(tokenizer, any_tokenizer):
    ids = [24211] * 5 + tokenizer.encode("界")  # 3 tokens: its bytes one by one
    detokenizer = make_detokenizer(any_tokenizer)
    texts = [u.new_text for u in feed(detokenizer, ids)]
    assert "".join(texts) == tokenizer.decode(ids) == "\ufffd" * 5 + "界"
    assert "界" in texts[-1] and not any("界" in t for t in texts[:-1])


# --- special tokens -----------------------------------------------------------------------------

@pytest.mark.parametrize(("skip", "expected"), [
    (True, "Hi there"), (False, "Hi<|im_end|> there<|im_end|>")])
def test_skip_special_tokens(tokenizer, any_tokenizer, skip, expected):
    ids = [*tokenizer.encode("Hi"), IM_END, *tokenizer.encode(" there"), IM_END]
    assert streamed(make_detokenizer(any_tokenizer, skip_special_tokens=skip), ids) == expected


def test_skipped_special_token_alone_releases_nothing(tokenizer, any_tokenizer):
    detokenizer = make_detokenizer(any_tokenizer)
    assert detokenizer.update([IM_END]) == DetokenizerUpdate("", None)
    assert detokenizer.flush() == ""


# --- stop strings -------------------------------------------------------------------------------

ANSWER = "The capital of France is Paris."


def stopped(tokenizer, text: str, chunks: list[int] | None = None, **params):
    detokenizer = make_detokenizer(tokenizer, **params)
    updates = feed(detokenizer, tokenizer.encode(text), chunks)
    last = next((u for u in updates if u.stop_string is not None), None)
    return detokenizer, updates, last


def test_stop_string_at_start(any_tokenizer):
    detokenizer, updates, _ = stopped(any_tokenizer, ANSWER, stop=["The"])
    assert updates[0] == DetokenizerUpdate("", "The")
    assert detokenizer.output_text == "" and detokenizer.finished
    assert all(u == DetokenizerUpdate("", None) for u in updates[1:])  # later tokens are dropped


def test_stop_string_in_middle(any_tokenizer):
    detokenizer, _, last = stopped(any_tokenizer, ANSWER, stop=["France"])
    assert last is not None and last.stop_string == "France"
    assert detokenizer.output_text == "The capital of "
    assert detokenizer.stop_string == "France"


def test_stop_string_across_steps_is_never_half_released(tokenizer, any_tokenizer):
    ids = tokenizer.encode(ANSWER)
    detokenizer = make_detokenizer(any_tokenizer, stop=["of Fr"])  # spans the tokens " of" and " France"
    released = ""
    for update in feed(detokenizer, ids):
        released += update.new_text
        assert "The capital ".startswith(released)
    assert released == detokenizer.output_text == "The capital "
    assert detokenizer.flush() == ""


def test_hold_back_is_longest_stop_minus_one(tokenizer, any_tokenizer):
    ids = tokenizer.encode(ANSWER)
    detokenizer = make_detokenizer(any_tokenizer, stop=["xyz", "never"])  # longest: 5 -> hold 4
    for n in range(1, len(ids) + 1):
        assert detokenizer.update(ids[n - 1:n]).stop_string is None
        assert detokenizer.output_text == tokenizer.decode(ids[:n])[:-4]
    assert detokenizer.flush() == "ris."
    assert detokenizer.output_text == ANSWER


def test_overlapping_stops_first_to_end_wins(any_tokenizer):
    # All three match; "of France" ends first, though "is Paris" comes first in the list.
    detokenizer, _, last = stopped(any_tokenizer, ANSWER, stop=["is Paris", "France is", "of France"])
    assert last is not None and last.stop_string == "of France"
    assert detokenizer.output_text == "The capital "


def test_overlapping_stops_ending_together_longer_wins(any_tokenizer):
    detokenizer, _, last = stopped(any_tokenizer, ANSWER, stop=["France", "of France"])
    assert last is not None and last.stop_string == "of France"
    assert detokenizer.output_text == "The capital "


def test_overlapping_stops_in_one_chunk(any_tokenizer):
    _, updates, last = stopped(any_tokenizer, ANSWER, chunks=[100], stop=["Paris", "is Pa", "France"])
    # The whole answer in one chunk: its fourth token (" France") ends the sequence.
    assert len(updates) == 1 and last == DetokenizerUpdate("The capital of ", "France", 4)


def test_include_stop_str_in_output(any_tokenizer):
    detokenizer, _, last = stopped(any_tokenizer, ANSWER, stop=["France"], include_stop_str_in_output=True)
    assert last is not None and last.stop_string == "France"
    assert detokenizer.output_text == "The capital of France"


def test_stop_string_matching_special_token_text(tokenizer, any_tokenizer):
    ids = [*tokenizer.encode("Done"), IM_END, *tokenizer.encode(" more")]
    detokenizer = make_detokenizer(any_tokenizer, skip_special_tokens=False, stop=["<|im_end|>"])
    updates = feed(detokenizer, ids)
    assert updates[1].stop_string == "<|im_end|>"
    assert detokenizer.output_text == "Done"


def test_stop_completed_by_flush_still_cuts(tokenizer, any_tokenizer):
    # The last token is ' ' plus the first bytes of 😀: the stream holds it back until flush reveals it.
    ids = tokenizer.encode("A 😀")[:-1]
    assert len(ids) == 2
    detokenizer = make_detokenizer(any_tokenizer, stop=["A "])
    assert feed(detokenizer, ids) == [DetokenizerUpdate("", None)] * 2
    assert detokenizer.flush() == ""
    assert detokenizer.output_text == "" and detokenizer.stop_string == "A "


@settings(max_examples=120, deadline=None)
@given(data=st.data(), text=st.sampled_from([*TEXTS, ANSWER]),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4), include=st.booleans())
def test_stops_match_reference(tokenizer, any_tokenizer, data, text, chunks, include):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    substring = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 6)).map(lambda p: full[p[0]:sum(p)])
    other = st.text("ab .é😀", min_size=1, max_size=4)
    stops = data.draw(st.lists(substring | other, min_size=1, max_size=4))
    expected, expected_stop_string = expected_stop(full, stops, include)

    detokenizer = IncrementalDetokenizer(any_tokenizer, [], SamplingParams(stop=stops,
                                                                          include_stop_str_in_output=include))
    released = ""
    for update in feed(detokenizer, ids, chunks):
        released += update.new_text
        assert expected.startswith(released)  # nothing past the cut is ever released, even for a moment
    released += detokenizer.flush()
    assert released == expected == detokenizer.output_text
    assert detokenizer.stop_string == expected_stop_string


# --- flush and finishing ------------------------------------------------------------------------

def test_flush_without_stops_or_pending_is_empty(tokenizer, any_tokenizer):
    detokenizer = make_detokenizer(any_tokenizer)
    assert "".join(u.new_text for u in feed(detokenizer, tokenizer.encode(ANSWER))) == ANSWER
    assert detokenizer.flush() == ""
    assert detokenizer.finished and detokenizer.stop_string is None


def test_flush_is_idempotent_and_ends_the_sequence(tokenizer, any_tokenizer):
    detokenizer = make_detokenizer(any_tokenizer, stop=["never"])
    feed(detokenizer, tokenizer.encode(ANSWER))
    assert detokenizer.flush() == "ris."
    assert detokenizer.flush() == ""
    assert detokenizer.update(tokenizer.encode(" More")) == DetokenizerUpdate("", None)
    assert detokenizer.output_text == ANSWER


def test_empty_update_releases_nothing(any_tokenizer):
    detokenizer = make_detokenizer(any_tokenizer)
    assert detokenizer.update([]) == DetokenizerUpdate("", None)
    assert detokenizer.output_text == ""
