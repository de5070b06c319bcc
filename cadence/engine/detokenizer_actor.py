"""The detokenizer actor: token ids -> incremental text per sequence, stop strings, finish reasons.

When a stop string matches, the sequence is finished here and the engine core is told to abort it.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from cadence.engine.dashboard_feed import DashboardFeed, EngineSample
from cadence.engine.detokenizer import IncrementalDetokenizer
from cadence.messages import (
    AbortRequests,
    DetokenizedOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    SequenceDelta,
    TrackRequest,
)
from cadence.runtime.actor import UNBOUNDED, Actor, Mailbox
from cadence.sampling_params import SamplingParams

DetokenizerInbox = TrackRequest | EngineCoreOutputs


class _Sequence:
    __slots__ = ("detokenizer", "params")

    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams) -> None:
        self.detokenizer = detokenizer
        self.params = params


class DetokenizerActor(Actor[DetokenizerInbox]):
    inbox_size = UNBOUNDED

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.sequences: dict[str, _Sequence] = {}
        # The engine core's state as of its latest step (metrics, health, tests).
        self.latest_stats: SchedulerStats | None = None
        # When the engine core last reported (time.monotonic()); the watchdog reads it.
        self.last_heard = time.monotonic()
        self.engine_core: Mailbox[Any]
        self.outputs_to: Mailbox[Any]
        # --dashboard: the feed told of each sequence's arrival, tokens and end, and of engine core
        # ``rank``'s state and preemptions (times as the front end sees them).
        self.feed: DashboardFeed | None = None
        self.rank = 0

    def connect(self, engine_core: Mailbox[Any], outputs_to: Mailbox[Any]) -> None:
        self.engine_core = engine_core
        self.outputs_to = outputs_to

    def watch(self, feed: DashboardFeed, rank: int) -> None:
        self.feed, self.rank = feed, rank

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                if isinstance(message, TrackRequest):
                    self.sequences[message.request_id] = _Sequence(
                        IncrementalDetokenizer(self.tokenizer, message.prompt_token_ids, message.sampling_params),
                        message.sampling_params)
                    if self.feed is not None:
                        self.feed.arrived(message.request_id, message.arrival_time)
                else:
                    await self._process(message)

    async def _process(self, batch: EngineCoreOutputs) -> None:
        self.last_heard = time.monotonic()
        if batch.stats is not None:
            self.latest_stats = batch.stats
        deltas = []
        stopped = []
        for output in batch.outputs:
            sequence = self.sequences.get(output.request_id)
            if sequence is None:
                continue  # finished here already (stop string); the engine's abort echo
            delta = self._delta(sequence, output)
            if delta.finish_reason is not None:
                del self.sequences[output.request_id]
                if output.finish_reason is None:
                    stopped.append(output.request_id)
            deltas.append(delta)
        if stopped:
            await self.engine_core.send(AbortRequests(stopped))
        if self.feed is not None:
            self._tell_feed(self.feed, batch, deltas)
        if deltas:
            await self.outputs_to.send(DetokenizedOutputs(deltas))

    def _tell_feed(self, feed: DashboardFeed, batch: EngineCoreOutputs, deltas: list[SequenceDelta]) -> None:
        now = time.time()
        for request_id in batch.preempted:
            feed.preempted(request_id, now)
        for delta in deltas:
            if delta.queue_time_s is not None:
                feed.started(delta.request_id, delta.queue_time_s)
            feed.tokens(delta.request_id, now, len(delta.new_token_ids))
            if delta.finish_reason is not None:
                feed.finished(delta.request_id, now, delta.finish_reason)
        if batch.stats is not None:
            feed.engine(self.rank, now, EngineSample.of(batch.stats))

    def _delta(self, sequence: _Sequence, output: EngineCoreOutput) -> SequenceDelta:
        detokenizer = sequence.detokenizer
        ids = output.new_token_ids
        if output.finish_reason == "stop" and ids and not sequence.params.include_stop_str_in_output:
            # The engine stopped on this token (EOS or a stop token id): not text of the answer, as
            # in vLLM (with skip_special_tokens off, an EOS's "</s>" would otherwise end every answer).
            ids = ids[:-1]
        update = detokenizer.update(ids)
        text, kept = update.new_text, update.num_tokens
        new_token_ids, new_logprobs = output.new_token_ids, output.new_logprobs
        if kept is not None:  # the sequence ends with the token that completed a stop string
            new_token_ids = new_token_ids[:kept]
            new_logprobs = None if new_logprobs is None else new_logprobs[:kept]
        finish_reason, error = output.finish_reason, output.error
        stop_reason: str | int | None = None
        if finish_reason is not None and detokenizer.stop_string is None:
            text += detokenizer.flush()  # may itself complete a stop string
        if detokenizer.stop_string is not None:
            # The text up to the stop string is a complete answer, whatever failed after it.
            finish_reason, stop_reason, error = "stop", detokenizer.stop_string, None
        elif finish_reason == "stop" and output.new_token_ids:
            last = output.new_token_ids[-1]
            if last in sequence.params.stop_token_ids:
                stop_reason = last
        return SequenceDelta(
            request_id=output.request_id,
            new_text=text,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=output.num_cached_tokens,
            queue_time_s=output.queue_time_s,
            error=error,
            prompt_logprobs=output.prompt_logprobs,
        )

