"""Incremental detokenization of one sequence: text deltas, held-back partial characters, stop strings.

Pure logic, one object per sequence; the detokenizer actor owns one per running request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from transformers import PreTrainedTokenizerBase

    from cadence.sampling_params import SamplingParams

# What a lossy UTF-8 decode yields for bytes that do not (yet) form a character.
_REPLACEMENT = "\ufffd"
# A character is at most 4 bytes and a token at least one, so tokens held this long hold bytes that
# can never form one (a model looping on a stray byte): they are released as U+FFFD, as decode
# shows them, but for the last 3, which the next tokens could still complete (byte-fallback
# decoders give each byte of an unfinished character its own U+FFFD).
_BROKEN_AFTER_TOKENS = 4
_UNFINISHED_REPLACEMENTS = 3
# Prompt tokens decoded ahead of the output so its first tokens decode in context (a SentencePiece
# leading space, a WordPiece "##" join); vLLM's numbers. A few tokens settle any such rule; the upper
# bound caps the search when no suffix decodes cleanly (the prompt ends mid-character).
_MIN_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24


@dataclass(frozen=True)
class DetokenizerUpdate:
    """Text released by one ``update``.

    ``stop_string`` is set when a stop string matched: the sequence must end, and ``new_text`` is
    the last text it will ever produce (cut before the stop string, or after it when
    ``include_stop_str_in_output``). ``num_tokens`` is then how many of the tokens fed it took, when
    one before the last completed the stop string (None: all of them).
    """

    new_text: str
    stop_string: str | None = None
    num_tokens: int | None = None


_NOTHING = DetokenizerUpdate("")


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, a delta per step.

    Contract: the texts of every ``update`` plus the final ``flush`` concatenate to
    ``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)`` (for byte-level
    BPE tokenizers such as SmolLM2's; a SentencePiece tokenizer keeps the first token's leading space,
    because the output is decoded as a continuation of the prompt), cut at the first stop string.

    - A character whose UTF-8 bytes span several tokens is released once complete, never as U+FFFD.
      Bytes that can never form one are released as U+FFFD once 4 tokens are held, so a stream of
      them is not silent until its end.
    - With stop strings, the last ``max(len(s) for s in params.stop) - 1`` characters are held back,
      so a stop string that arrives over several steps is never partly released.
    - When several stop strings match, the one that ends first wins (ties: the longer one), which is
      what a character-by-character stream would see, so the result does not depend on chunking.
    - Once a stop string matched or ``flush`` was called, the detokenizer is finished: later
      ``update`` calls release nothing (tokens still in flight after an abort are simply dropped).

    ``tokenizer.clean_up_tokenization_spaces`` is not applied (it is off for BPE tokenizers).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._stops = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._stream = _make_stream(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._held = ""  # decoded, not yet released: at most ``_hold`` characters
        self._released: list[str] = []  # joined lazily by ``output_text``
        self._stop_string: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far (the held-back tail excluded)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return self._stop_string

    @property
    def finished(self) -> bool:
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feed the tokens sampled this step; returns the text they release.

        Several tokens at once (accepted drafts) are fed one by one while stop strings are set
        (which releases the same text), so that a stop string completed by one of them ends the
        sequence there, as one token a step would.
        """
        if self._finished or not new_token_ids:
            return _NOTHING
        if self._stops and len(new_token_ids) > 1:
            texts = []
            for i, token_id in enumerate(new_token_ids):
                update = self.update([token_id])
                texts.append(update.new_text)
                if update.stop_string is not None:
                    used = i + 1 if i + 1 < len(new_token_ids) else None
                    return DetokenizerUpdate("".join(texts), update.stop_string, used)
            return DetokenizerUpdate("".join(texts))
        text = self._stream.step(new_token_ids)
        if not text:
            return _NOTHING
        return self._release(self._held + text, final=False)

    def flush(self) -> str:
        """End the sequence (it finished for another reason): release the held-back text.

        Tokens still waiting to complete a character decode as U+FFFD, as ``tokenizer.decode`` would.
        A stop string completed by that text still cuts it (``stop_string`` then tells which).
        Returns ``""`` once finished.
        """
        if self._finished:
            return ""
        return self._release(self._held + self._stream.flush(), final=True).new_text

    def _release(self, pending: str, final: bool) -> DetokenizerUpdate:
        """Release ``pending`` (held-back tail + new text) up to the hold-back line or a stop string.

        Every unreleased match would end inside ``pending``: the tail holds the only characters a
        stop string straddling the previous step could start in, so nothing older needs searching.
        """
        if self._stops and (match := _first_stop(pending, self._stops)) is not None:
            start, stop = match
            self._stop_string = stop
            final = True
            pending = pending[: start + len(stop) if self._include_stop else start]
        cut = len(pending) if final else max(0, len(pending) - self._hold)
        self._held = pending[cut:]
        self._finished = final
        if cut:
            self._released.append(pending[:cut])
        return DetokenizerUpdate(pending[:cut], self._stop_string)


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The match in ``text`` that ends first (ties: starts first), as (start, stop string)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


class _TextStream(Protocol):
    """Decoded text of a growing token list, released only up to the last complete character."""

    def step(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str:
        """Everything not yet released, incomplete characters decoded as U+FFFD."""
        ...


def _make_stream(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> _TextStream:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        context = _prompt_context(lambda ids: backend.decode(ids, skip_special_tokens), prompt_token_ids)
        return _FastStream(backend, context, skip_special_tokens)

    def decode(ids: list[int]) -> str:
        # One list of ids decodes to one str; the stubs also allow a batch.
        return cast("str", tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    context = _prompt_context(decode, prompt_token_ids)
    return _OffsetStream(tokenizer, context, skip_special_tokens)


def _prompt_context(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest prompt suffix (of at least a few tokens) that decodes without U+FFFD.

    A suffix that starts or ends inside a character would make the stream take prompt bytes for
    output; if none is clean the output is decoded on its own, exactly as ``decode(output_ids)``.
    """
    n_prompt = len(prompt_token_ids)
    for n in range(min(_MIN_CONTEXT_TOKENS, n_prompt), min(_MAX_CONTEXT_TOKENS, n_prompt) + 1):
        context = list(prompt_token_ids[n_prompt - n:])
        if context and _REPLACEMENT not in decode(context):
            return context
    return []


class _FastStream:
    """tokenizers' ``DecodeStream``: a Rust prefix/read-offset window, a few µs a step."""

    def __init__(self, backend: Tokenizer, context: list[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        # Kept for ``flush`` and broken bytes: DecodeStream does not expose the tokens it is holding.
        self._context = context
        self._output_ids: list[int] = []
        self._released_chars = 0
        self._held = 0  # tokens fed since the stream last released text
        self._forced = 0  # characters of its held text released as broken bytes since then

    def step(self, token_ids: Sequence[int]) -> str:
        self._output_ids.extend(token_ids)
        ids: int | list[int] = token_ids[0] if len(token_ids) == 1 else list(token_ids)
        text = self._stream.step(self._backend, ids)
        if text is None:
            self._held += len(token_ids)
            if self._held < _BROKEN_AFTER_TOKENS:
                return ""
            pending = self._unreleased()  # rare: a full decode is fine
            text = pending[:len(pending) - _unfinished(pending)]
            self._forced += len(text)
        else:
            text = text[self._forced:]  # the stream's text starts where it began to hold
            self._held = self._forced = 0
        self._released_chars += len(text)
        return text

    def flush(self) -> str:
        if not self._held:
            return ""
        # Rare (the sequence ended mid-character or on a skipped special token), so one full decode is fine.
        text = self._unreleased()
        self._held = self._forced = 0
        self._released_chars += len(text)
        return text

    def _unreleased(self) -> str:
        """The output's decoded text after what was released, incomplete characters as U+FFFD."""
        context_chars = len(self._backend.decode(self._context, self._skip))
        full = self._backend.decode(self._context + self._output_ids, self._skip)
        return full[context_chars + self._released_chars:]


class _OffsetStream:
    """vLLM's prefix/read-offset algorithm for tokenizers without a Rust backend.

    Decodes the window ``tokens[prefix:]`` against ``tokens[prefix:read]`` so that context-dependent
    decoders (a leading space stripped from the first token) see the same start in both, and releases
    the difference once it no longer ends in U+FFFD.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[str] = list(tokenizer.convert_ids_to_tokens(context, skip_special_tokens))
        self._prefix = 0
        self._read = len(self._tokens)
        self._forced = 0  # characters after ``read`` released as broken bytes

    def step(self, token_ids: Sequence[int]) -> str:
        self._tokens.extend(self._tokenizer.convert_ids_to_tokens(list(token_ids), self._skip))
        return self._window_text(final=False)

    def flush(self) -> str:
        return self._window_text(final=True)

    def _window_text(self, final: bool) -> str:
        to_string = self._tokenizer.convert_tokens_to_string
        prefix_text = to_string(self._tokens[self._prefix:self._read])
        text = to_string(self._tokens[self._prefix:])
        start = len(prefix_text) + self._forced
        if len(text) <= start:
            return ""
        if text.endswith(_REPLACEMENT) and not final:
            if len(self._tokens) - self._read < _BROKEN_AFTER_TOKENS:
                return ""
            broken = text[start:len(text) - _unfinished(text)]
            self._forced += len(broken)
            return broken
        self._prefix, self._read, self._forced = self._read, len(self._tokens), 0
        return text[start:]


def _unfinished(text: str) -> int:
    """How many of ``text``'s trailing U+FFFD the next tokens could still turn into a character."""
    return min(_UNFINISHED_REPLACEMENTS, len(text) - len(text.rstrip(_REPLACEMENT)))
