"""The ``<think>`` ... ``</think>`` reasoning parsers: ``qwen3`` and ``deepseek_r1``.

Both read the reasoning as what follows an opening ``<think>`` at the very start of the output, up
to the first ``</think>``, and the content as everything after that (a later marker is plain
content). They differ in an output that does not open with ``<think>``:

- ``qwen3``: it is all content. Qwen3 writes ``<think>`` itself when thinking; with thinking off its
  chat template puts an empty think block in the prompt, and the output is the answer alone.
- ``deepseek_r1``: it is reasoning up to ``</think>``. DeepSeek-R1's chat template opens ``<think>``
  in the prompt, so the output starts inside the reasoning (a ``<think>`` it writes anyway is
  dropped). Use it, too, for any model whose template opens the think block in the prompt.

Reasoning with no ``</think>`` (cut short by ``max_tokens``) is all reasoning, content None. No
whitespace is stripped around the markers, as in vLLM: Qwen3's ``</think>\\n\\n`` leaves the two
newlines at the start of the content. An empty part is None.

Where vLLM's parsers of these names differ: their whole-text path finds ``<think>`` anywhere (and
drops what precedes it), and recent ones read a ``qwen3`` output with a bare ``</think>`` as
reasoning before it. A stream can honour neither without holding back the whole output until it
ends; here a stream holds back only a possible start of a marker, and both paths agree on every
text (docs/tools_and_reasoning.md).
"""

from __future__ import annotations

import enum

from cadence.api.markers import partial_marker
from cadence.api.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningSplit, ReasoningStream

START = "<think>"
END = "</think>"


class _Phase(enum.Enum):
    OPENING = enum.auto()  # the text so far could still be the start of "<think>"
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ThinkStream(ReasoningStream):
    """One choice's output, streamed: holds back at most a possible start of the next marker."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        # Where an output that does not open with "<think>" belongs.
        self._unmarked = _Phase.REASONING if starts_in_reasoning else _Phase.CONTENT
        self._phase = _Phase.OPENING
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._held += text
        if self._phase is _Phase.OPENING:
            self._open()
        if self._phase is _Phase.OPENING:
            return ReasoningDelta("", "")
        if self._phase is _Phase.REASONING:
            return self._reason()
        return self._release()

    def finish(self) -> ReasoningDelta:
        if self._phase is _Phase.OPENING:  # too short to be "<think>": it never was one
            self._phase = self._unmarked
        return self._release()

    def _open(self) -> None:
        if self._held.startswith(START):
            self._held = self._held[len(START):]
            self._phase = _Phase.REASONING
        elif not START.startswith(self._held):
            self._phase = self._unmarked

    def _reason(self) -> ReasoningDelta:
        reasoning, end, content = self._held.partition(END)
        if end:
            self._phase = _Phase.CONTENT
            self._held = ""
            return ReasoningDelta(reasoning, content)
        cut = len(self._held) - partial_marker(self._held, END)
        released, self._held = self._held[:cut], self._held[cut:]
        return ReasoningDelta(released, "")

    def _release(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._phase is _Phase.REASONING:
            return ReasoningDelta(held, "")
        return ReasoningDelta("", held)


class ThinkReasoningParser(ReasoningParser):
    """Reasoning fenced by ``<think>`` ... ``</think>``; subclasses say where an unmarked output belongs."""

    def split(self, text: str) -> ReasoningSplit:
        if text.startswith(START):
            body = text[len(START):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return ReasoningSplit(None, text or None)
        reasoning, _, content = body.partition(END)
        return ReasoningSplit(reasoning or None, content or None)

    def stream(self) -> ThinkStream:
        return ThinkStream(self.starts_in_reasoning)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: reasoning only where the output opens with ``<think>``; otherwise all content."""

    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: the prompt opened ``<think>``, so the output is reasoning until ``</think>``."""

    name = "deepseek_r1"
    starts_in_reasoning = True
