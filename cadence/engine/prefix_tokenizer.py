"""Tokenizing a prompt that begins with a recent prompt's text: the shared part's token ids reused,
only the rest tokenized (docs/architecture.md, "Tokenizing shared prefixes").

Prompts that share a long system prompt or document spend most of their tokenizing on the part they
share: 1.5-2.5 ms for a 1,100-token prompt here, in the API process, on the cores the engine core's
steps run on, so a burst of such prompts slows the steps that serve it (docs/performance.md,
"Shared prefixes").

It is exact, and taken only where that holds (:func:`reuses_prefixes`): a byte-level BPE tokenizer
(GPT-2's family: SmolLM2, Llama 3, ...) without a normalizer cuts the text at its added tokens, then
into pieces by a regular expression, then merges bytes within each piece, so a text's ids are its
pieces' ids in order. The expression's matches are found left to right, and a match ending at a
point looks at most a character or two past it. So where this text and a recent one agree up to
:data:`MARGIN` characters past the end of one of that one's pieces, this text is cut there too, with
the same pieces before: its ids are that text's ids up to there, then the ids of the rest, tokenized
alone. The cut is taken where no added token lies within :data:`MARGIN` characters (or its own
length) of it, and after a character that is not whitespace, so that no added token that strips the
spaces beside it reaches across (:meth:`PrefixTokenizer._cut`). A tokenizer that adds special tokens
only before the text (a BOS) gets them before the reused ids; one that adds any after it tokenizes
every text whole.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

MIN_CHARS = 1024  # shorter texts are tokenized whole: too cheap to be worth a lookup (~0.3 ms)
MIN_SHARED = 512  # characters of a recent text a reuse takes, at least
KEY_CHARS = 256  # texts are looked up by their first characters (at most min_shared of them)
MARGIN = 16  # characters a cut keeps from where the texts differ and from any added token
MAX_CHARS = 1 << 20  # longer texts are not kept
PER_KEY = 4  # texts kept per first characters, most recently used first
MAX_KEYS = 32

# A text's token ids, with or without the tokenizer's special tokens: PrefixTokenizer.encode, or the
# tokenizer's own (plain_encode).
Encode = Callable[[str, bool], list[int]]

# Lookbehind, word boundaries and anchors see before a cut, or the text's ends: not local.
_NOT_LOCAL = re.compile(r"\(\?<[=!]|\\[bBAzZG]")


@dataclass(frozen=True, eq=False)  # compared by identity: texts and ids are long
class _Tokenized:
    text: str
    ids: list[int]  # without special tokens
    ends: list[int]  # each token's end in text, in characters (non-decreasing)
    pieces: list[int]  # each token's piece (word) index: a cut falls between two tokens whose pieces differ


def _byte_level_pieces(pre: dict[str, Any]) -> bool:
    """Whether ``pre`` (a pre-tokenizer's spec) cuts text by a local regular expression into pieces
    that are then mapped to bytes one character at a time: ByteLevel with its own expression, or a
    Split by a regular expression followed by ByteLevel without one; no prefix space added."""
    if pre.get("type") == "ByteLevel":
        return not pre.get("add_prefix_space", True) and bool(pre.get("use_regex", True))
    parts = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(parts) != 2:
        return False
    split, byte_level = parts
    pattern = (split.get("pattern") or {}).get("Regex")
    return (split.get("type") == "Split" and isinstance(pattern, str) and not _NOT_LOCAL.search(pattern)
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space", True)
            and not byte_level.get("use_regex", True))


def _pieces_in_order(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer``'s ids of a text are its pieces' ids in order, pieces cut by a local
    regular expression (see the module's docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
        return False
    if type(backend.model).__name__ != "BPE" or getattr(backend.model, "dropout", None):
        return False
    # The pre-tokenizer's spec alone: the whole tokenizer's (its vocabulary) takes 40 ms to write.
    return _byte_level_pieces(json.loads(backend.pre_tokenizer.__getstate__()))


def _specials_before(tokenizer: PreTrainedTokenizerBase) -> list[int] | None:
    """The special tokens ``tokenizer`` adds before a text; None if it adds any after it."""
    plain = list(tokenizer("cadence probe", add_special_tokens=False).input_ids)
    special = list(tokenizer("cadence probe", add_special_tokens=True).input_ids)
    cut = len(special) - len(plain)
    return special[:cut] if cut >= 0 and special[cut:] == plain else None


def _lead_ids(tokenizer: PreTrainedTokenizerBase) -> list[int] | None:
    """The special tokens ``tokenizer`` adds before a text where :class:`PrefixTokenizer` reuses ids
    with it (its pieces' ids in order, and special tokens only before a text); None where it does not."""
    return _specials_before(tokenizer) if _pieces_in_order(tokenizer) else None


def reuses_prefixes(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether :class:`PrefixTokenizer` reuses ids with ``tokenizer``."""
    return _lead_ids(tokenizer) is not None


def plain_encode(tokenizer: PreTrainedTokenizerBase) -> Encode:
    """The tokenizer's own ids of a text, with or without its special tokens."""
    return lambda text, special: list(tokenizer(text, add_special_tokens=special).input_ids)


def _common_prefix(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from their start (slices compared in C, halving the range)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTokenizer:
    """``tokenizer``'s ids of texts, reusing those of the recent text that shares the longest start.

    Thread-safe: the API tokenizes in worker threads. Holds at most :data:`MAX_KEYS` x
    :data:`PER_KEY` texts of at most :data:`MAX_CHARS` characters.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, min_chars: int = MIN_CHARS,
                 min_shared: int = MIN_SHARED) -> None:
        self.tokenizer = tokenizer
        self.min_chars, self.min_shared = min_chars, min_shared
        self._key_chars = min(KEY_CHARS, min_shared)
        self.reused_tokens = 0  # ids taken from a recent text instead of tokenized (for tests and tuning)
        self._enabled: bool | None = None  # found at the first long text: a server may never see one
        self._lead: list[int] = []
        contents = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._reach = max([MARGIN, *(len(c) for c in contents)])
        self._recent: OrderedDict[str, list[_Tokenized]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether texts reuse recent ones' ids: :func:`reuses_prefixes` of the tokenizer."""
        with self._lock:
            if self._enabled is None:
                lead = _lead_ids(self.tokenizer)
                self._enabled, self._lead = lead is not None, lead or []
            return self._enabled

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer(text, add_special_tokens=...).input_ids``, as a new list."""
        if not self.min_chars <= len(text) <= MAX_CHARS or not self.enabled:
            return plain_encode(self.tokenizer)(text, add_special_tokens)
        entry = self._reuse(text) or self._tokenize(text)
        return [*self._lead, *entry.ids] if add_special_tokens else list(entry.ids)

    def _pieces_of(self, text: str) -> tuple[list[int], list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        pieces = [-1 if w is None else w for w in enc.word_ids()]
        return list(enc.input_ids), [end for _, end in enc["offset_mapping"]], pieces

    def _tokenize(self, text: str) -> _Tokenized:
        ids, ends, pieces = self._pieces_of(text)
        entry = _Tokenized(text, ids, ends, pieces)
        self._keep(entry)
        return entry

    def _reuse(self, text: str) -> _Tokenized | None:
        """``text``'s ids from the recent text sharing most of its start, if that is at least
        ``min_shared`` characters; kept as a recent text itself where it adds as many."""
        with self._lock:
            candidates = list(self._recent.get(text[:self._key_chars], ()))
        best, shared = None, 0
        for entry in candidates:
            common = _common_prefix(entry.text, text)
            if common > shared:
                best, shared = entry, common
        if best is None:
            return None
        cut = self._cut(best, text, shared)
        if cut is None:
            return None
        tokens, at = cut
        ids, ends, pieces = self._pieces_of(text[at:])
        first_piece = best.pieces[tokens - 1] + 1
        entry = _Tokenized(text, best.ids[:tokens] + ids, best.ends[:tokens] + [at + end for end in ends],
                           best.pieces[:tokens] + [first_piece + p if p >= 0 else -1 for p in pieces])
        self._touch(best, tokens)
        if len(text) - at >= self.min_shared:  # a conversation's next turn starts with this one's text
            self._keep(entry)
        return entry

    def _cut(self, entry: _Tokenized, text: str, shared: int) -> tuple[int, int] | None:
        """The last of ``entry``'s piece ends that ``text`` is cut at too: (its tokens before, the
        position), at least ``min_shared`` characters in; None if there is none."""
        limit = shared - MARGIN
        n = bisect.bisect_right(entry.ends, limit)
        for t in range(min(n, len(entry.ids) - 1), 0, -1):
            at = entry.ends[t - 1]
            if at < self.min_shared:
                return None
            if entry.pieces[t - 1] == entry.pieces[t] or entry.pieces[t - 1] < 0 or text[at - 1].isspace():
                continue
            if self._added is not None and self._added.search(text, max(0, at - self._reach), at + self._reach):
                continue
            return t, at
        return None

    def _keep(self, entry: _Tokenized) -> None:
        key = entry.text[:self._key_chars]
        with self._lock:
            kept = [e for e in self._recent.pop(key, []) if e.text != entry.text]
            self._recent[key] = [entry, *kept][:PER_KEY]
            while len(self._recent) > MAX_KEYS:
                self._recent.popitem(last=False)

    def _touch(self, entry: _Tokenized, reused: int) -> None:
        key = entry.text[:self._key_chars]
        with self._lock:
            self.reused_tokens += reused
            kept = self._recent.get(key)
            if kept is not None and any(e is entry for e in kept):
                self._recent[key] = [entry, *(e for e in kept if e is not entry)]
                self._recent.move_to_end(key)
