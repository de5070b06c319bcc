"""One request's outputs on their way from the request manager to its reader, kept bounded.

The request manager must never wait for a reader (it serves every request of its engine core), and
a reader may be slow: a streaming client that reads its socket slowly holds its handler, which then
reads no outputs. So outputs are not queued step by step: what the reader has not taken yet is one
delta per sequence, and a later step's delta is merged into it (text and tokens appended, the
latest finish kept), as vLLM's per-request output collector does. A slow reader costs what its
request's output is, never a queue of steps.
"""

from __future__ import annotations

from cadence.messages import SequenceDelta
from cadence.runtime.wakeup import Wakeup

# What a reader takes after one or more steps: (sequence index, what it gained) pairs.
DeltaBatch = list[tuple[int, SequenceDelta]]


class OutputCollector:
    """Written by the request manager (never blocks), read by one reader."""

    def __init__(self) -> None:
        self._pending: dict[int, SequenceDelta] = {}
        self._ready = Wakeup()
        self._closed = False
        #: Why the outputs stopped before the request finished (the engine died), once they have.
        self.error: str | None = None

    @property
    def num_pending(self) -> int:
        """Sequences with a delta the reader has not taken."""
        return len(self._pending)

    def put(self, batch: DeltaBatch) -> None:
        """Add a step's deltas, merging each into the one its sequence has pending."""
        for index, delta in batch:
            earlier = self._pending.get(index)
            self._pending[index] = delta if earlier is None else merge(earlier, delta)
        self._ready.wake()

    def close(self, error: str | None = None) -> None:
        """No more outputs (``error``: the engine died): the reader gets what is pending, then None."""
        self._closed = True
        self.error = error
        self._ready.wake()

    async def get(self) -> DeltaBatch | None:
        """Everything pending (waiting for some), in the order the sequences first changed; None once
        closed and drained."""
        while not self._pending:
            if self._closed:
                return None
            await self._ready.wait()
        batch, self._pending = list(self._pending.items()), {}
        return batch


def merge(earlier: SequenceDelta, later: SequenceDelta) -> SequenceDelta:
    """One delta with what both gained, ending as the later one ends."""
    logprobs = None
    if earlier.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (earlier.new_logprobs or []) + (later.new_logprobs or [])
    return SequenceDelta(
        request_id=later.request_id,
        new_text=earlier.new_text + later.new_text,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=logprobs,
        finish_reason=later.finish_reason or earlier.finish_reason,
        stop_reason=later.stop_reason if later.finish_reason is not None else earlier.stop_reason,
        num_cached_tokens=max(earlier.num_cached_tokens, later.num_cached_tokens),
        queue_time_s=earlier.queue_time_s if earlier.queue_time_s is not None else later.queue_time_s,
        error=later.error or earlier.error,
        prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
    )
