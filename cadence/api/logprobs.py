"""Logprobs in both endpoints' formats, from the engine's :class:`TokenLogprobs` (sampled token
first, then the top-k in rank order).

A token's text is its own bytes decoded as UTF-8. A byte-level BPE token that holds part of a
character (an emoji split over tokens) has no such text: it is shown as ``bytes:\\xe2\\x80``, as
OpenAI does, and its exact bytes are in the chat format's ``bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from cadence.api.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from cadence.messages import TokenLogprobs

# OpenAI's stand-in for "very unlikely"; JSON has no -inf.
_FLOOR = -9999.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


class TokenTexts:
    """Each token id's text and UTF-8 bytes, computed once per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw: bytes | None = None
        if token_id in self._added:
            raw = self._added[token_id].encode()
        elif self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in _UNICODE_TO_BYTE for c in piece):
                raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if raw is None:
            raw = str(self._tokenizer.decode([token_id])).encode()
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def completion_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts, start_offset: int
                        ) -> CompletionLogprobs:
    """The completions format; ``text_offset`` counts from ``start_offset`` (the echoed prompt)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = start_offset
    for entry in entries:
        token = texts.text(entry.token_ids[0])
        result.tokens.append(token)
        result.token_logprobs.append(_finite(entry.logprobs[0]))
        top = {texts.text(t): _finite(lp) for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)}
        # The sampled token is always there, as OpenAI does: up to k + 1 entries.
        top.setdefault(token, _finite(entry.logprobs[0]))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def prompt_completion_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                               texts: TokenTexts) -> CompletionLogprobs:
    """An echoed prompt's logprobs in the completions format, its text offsets from 0: the first
    token's logprob and top are null (nothing comes before it)."""
    first = CompletionLogprobs(tokens=[texts.text(prompt_ids[0])], token_logprobs=[None], top_logprobs=[None],
                               text_offset=[0])
    rest = completion_logprobs([e for e in entries[1:] if e is not None], texts, len(first.tokens[0]))
    return merge_completion_logprobs([first, rest])


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[t for p in parts for t in p.tokens],
        token_logprobs=[t for p in parts for t in p.token_logprobs],
        top_logprobs=[t for p in parts for t in p.top_logprobs],
        text_offset=[t for p in parts for t in p.text_offset],
    )


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts, top_k: int) -> list[ChatTokenLogprob]:
    """The chat format: each sampled token with the ``top_k`` most likely at its position."""
    return [
        ChatTokenLogprob(
            token=texts.text(entry.token_ids[0]),
            logprob=_finite(entry.logprobs[0]),
            bytes=texts.bytes(entry.token_ids[0]),
            top_logprobs=[TopLogprob(token=texts.text(t), logprob=_finite(lp), bytes=texts.bytes(t))
                          for t, lp in zip(entry.token_ids[1:top_k + 1], entry.logprobs[1:top_k + 1], strict=True)],
        )
        for entry in entries
    ]
