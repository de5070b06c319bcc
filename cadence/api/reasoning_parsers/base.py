"""The reasoning-parser contract: split a chat model's output into its reasoning and its answer.

A reasoning model writes its chain of thought before the answer, fenced by markers (``<think>``
... ``</think>``). The chat endpoint gives the first as ``reasoning_content`` and the second as
``content``: whole with :meth:`ReasoningParser.split`, or delta by delta with a
:class:`ReasoningStream`, and both ways must agree on every text. A third-party parser is a
subclass registered in the ``cadence.reasoning_parsers`` entry-point group
(docs/tools_and_reasoning.md).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    """A whole output, split; a part the text does not have (or has empty) is None."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of a streamed output adds to each part ("" for nothing)."""

    reasoning: str
    content: str


class ReasoningStream(abc.ABC):
    """One choice's streamed output, fed piece by piece.

    The deltas of :meth:`feed` and then :meth:`finish`, joined, equal the parser's ``split`` of the
    joined pieces, however the text was cut. A stream may hold back text that could still turn out
    to be part of a marker; :meth:`finish` releases it.
    """

    @abc.abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of the output; return what is now known to be reasoning or content."""

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta:
        """The output has ended: return whatever was held back."""


class ReasoningParser(abc.ABC):
    """Splits a model's output into reasoning and content. Stateless: one instance serves every request."""

    name: ClassVar[str]
    # The output begins inside the reasoning (the chat template opened it: DeepSeek-R1). An output
    # held to a grammar from its first token never reasoned, so the chat endpoint splits nothing then.
    starts_in_reasoning: ClassVar[bool] = False

    @abc.abstractmethod
    def split(self, text: str) -> ReasoningSplit:
        """Split a whole output."""

    @abc.abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh stream for one choice's output."""
