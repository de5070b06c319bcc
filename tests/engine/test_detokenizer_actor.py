"""The detokenizer actor on the tiny byte-level tokenizer: tracked sequences' tokens become text
deltas, a stop string finishes a sequence here (and aborts it in the engine core), the engine's
stats are kept, and outputs for a sequence already finished are ignored."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from support.tiny_models import build_tiny_tokenizer

from cadence.engine.detokenizer_actor import DetokenizerActor
from cadence.messages import (
    AbortRequests,
    DetokenizedOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    SequenceDelta,
    TokenLogprobs,
    TrackRequest,
)
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

TEXT = "Hello world! How are you today?"
# The tiny tokenizer's pieces of TEXT: He|llo| |wor|ld|!| |Ho|w| |ar|e| |you| |today|?
TOKENS = [276, 295, 223, 306, 294, 3, 223, 277, 89, 223, 261, 71, 223, 308, 223, 303, 33]
E_ACUTE = [130, 105]  # "é": two byte tokens
PROMPT = [276, 295]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def send(self, message: Any) -> None:
        self.messages.append(message)

    def close(self) -> None:
        pass


async def run(tokenizer: Any, *messages: TrackRequest | EngineCoreOutputs
              ) -> tuple[DetokenizerActor, list[list[SequenceDelta]], list[AbortRequests]]:
    """Feed ``messages`` to a fresh actor and run it until its inbox is drained."""
    actor = DetokenizerActor(tokenizer)
    engine_core, manager = Recorder(), Recorder()
    actor.connect(engine_core, manager)
    for message in messages:
        await actor.send(message)
    actor.close()
    with anyio.fail_after(30):
        await actor.run()
    assert all(isinstance(m, DetokenizedOutputs) for m in manager.messages)
    assert all(isinstance(m, AbortRequests) for m in engine_core.messages)
    return actor, [m.outputs for m in manager.messages], engine_core.messages


def track(request_id: str, **params: Any) -> TrackRequest:
    return TrackRequest(request_id, PROMPT, SamplingParams(**params))


def step(*outputs: EngineCoreOutput, stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs), timestamp=0.0, stats=stats)


def out(request_id: str, tokens: list[int], finish: str | None = None, **kwargs: Any) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens, finish_reason=finish, **kwargs)


def token_steps(request_id: str, tokens: list[int], finish: str | None = "length") -> list[EngineCoreOutputs]:
    return [step(out(request_id, [t], finish if i == len(tokens) - 1 else None)) for i, t in enumerate(tokens)]


def stats(running: int) -> SchedulerStats:
    return SchedulerStats(running, 0, 0.5, 10, 20, 4, 2, 0)


async def test_tokens_become_incremental_text(tokenizer: Any) -> None:
    assert tokenizer(TEXT).input_ids == TOKENS
    _, batches, aborts = await run(tokenizer, track("r"), *token_steps("r", TOKENS))
    deltas = [d for batch in batches for d in batch]
    assert [d.new_text for d in deltas] == ["He", "llo", " ", "wor", "ld", "!", " ", "Ho", "w", " ", "ar", "e", " ",
                                            "you", " ", "today", "?"]
    assert [d.new_token_ids for d in deltas] == [[t] for t in TOKENS]
    assert [d.finish_reason for d in deltas] == [None] * 16 + ["length"]
    assert all(d.request_id == "r" and d.stop_reason is None and d.error is None for d in deltas)
    assert aborts == []


async def test_a_character_is_released_once_its_bytes_are_complete(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r"), *token_steps("r", [262, 72, *E_ACUTE, 3]))
    assert [d.new_text for batch in batches for d in batch] == ["ca", "f", "", "é", "!"]


async def test_a_sequence_ending_mid_character_flushes_a_replacement_character(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r"), step(out("r", [262, E_ACUTE[0]], "length")))
    [[last]] = batches
    assert last.new_text == "ca\ufffd" and last.finish_reason == "length"


async def test_several_tokens_in_one_step(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r"), step(out("r", TOKENS[:5])), step(out("r", TOKENS[5:], "length")))
    assert [[(d.new_text, d.finish_reason) for d in batch] for batch in batches] == [
        [("Hello world", None)], [("! How are you today?", "length")]]


async def test_a_stop_string_finishes_the_sequence_and_aborts_it_in_the_engine(tokenizer: Any) -> None:
    _, batches, aborts = await run(tokenizer, track("r", stop=["you"]), *token_steps("r", TOKENS, None))
    deltas = [d for batch in batches for d in batch]
    assert "".join(d.new_text for d in deltas) == "Hello world! How are "
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "you")
    assert deltas[-1].new_token_ids == [308]  # the token that completed the stop string
    assert len(deltas) == 14  # nothing after the stop: the engine's later tokens are dropped
    assert aborts == [AbortRequests(["r"])]


async def test_tokens_past_a_stop_string_in_one_step_are_dropped_with_their_logprobs(tokenizer: Any) -> None:
    """Accepted drafts arrive several at a time: the sequence ends with the token that completed the
    stop string ("you", the 14th), as one token a step would have it."""
    logprobs = [TokenLogprobs([t], [-1.0], 1) for t in TOKENS]
    _, batches, aborts = await run(tokenizer, track("r", stop=["you"]), step(out("r", TOKENS[:10])),
                                   step(out("r", TOKENS[10:], new_logprobs=logprobs[10:])))
    first, last = (d for batch in batches for d in batch)
    assert (last.new_text, last.finish_reason, last.stop_reason) == ("w are ", "stop", "you")  # "w " held back
    assert first.new_token_ids + last.new_token_ids == TOKENS[:14]
    assert last.new_logprobs == logprobs[10:14]
    assert aborts == [AbortRequests(["r"])]


async def test_a_stop_string_held_back_across_steps(tokenizer: Any) -> None:
    _, batches, aborts = await run(tokenizer, track("r", stop=["are you"], include_stop_str_in_output=True),
                                   *token_steps("r", TOKENS, None))
    deltas = [d for batch in batches for d in batch]
    assert "".join(d.new_text for d in deltas) == "Hello world! How are you"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "are you")
    assert aborts == [AbortRequests(["r"])]


async def test_the_engines_abort_echo_for_a_stopped_sequence_is_ignored(tokenizer: Any) -> None:
    _, batches, aborts = await run(
        tokenizer, track("a", stop=["!"]), track("b"),
        step(out("a", TOKENS[:6]), out("b", TOKENS[:1])),
        step(out("a", [], "abort"), out("b", TOKENS[1:2], "length")))  # the echo comes a step later
    assert [[(d.request_id, d.new_text, d.finish_reason) for d in batch] for batch in batches] == [
        [("a", "Hello world", "stop"), ("b", "He", None)],
        [("b", "llo", "length")]]
    assert aborts == [AbortRequests(["a"])]


async def test_sequences_stopped_in_one_step_share_one_abort(tokenizer: Any) -> None:
    _, _, aborts = await run(tokenizer, track("a", stop=["ld"]), track("b", stop=["wor"]), track("c"),
                             step(out("a", TOKENS[:5]), out("b", TOKENS[:5]), out("c", TOKENS[:5])))
    assert aborts == [AbortRequests(["a", "b"])]


async def test_a_stop_token_is_reported_as_the_stop_reason(tokenizer: Any) -> None:
    _, batches, aborts = await run(tokenizer, track("t", stop_token_ids=[3]), track("e"),
                                   step(out("t", TOKENS[:6], "stop"), out("e", [*TOKENS[:2], 0], "stop")))
    [[stopped, eos]] = batches
    # The token the engine stopped on is not text of the answer (as vLLM), but its id is there.
    assert (stopped.new_text, stopped.finish_reason, stopped.stop_reason) == ("Hello world", "stop", 3)
    assert stopped.new_token_ids == TOKENS[:6]
    assert (eos.new_text, eos.finish_reason, eos.stop_reason) == ("Hello", "stop", None)
    assert aborts == []  # the engine finished them itself


async def test_special_tokens_are_kept_when_asked_but_not_the_stop_token(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r", skip_special_tokens=False), track("s", skip_special_tokens=False),
                              step(out("r", [*TOKENS[:2], 0], "length"), out("s", [*TOKENS[:2], 0], "stop")))
    assert [d.new_text for d in batches[0]] == ["Hello<|endoftext|>", "Hello"]


async def test_the_stop_token_is_text_with_include_stop_str_in_output(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r", stop_token_ids=[3], include_stop_str_in_output=True),
                              step(out("r", TOKENS[:6], "stop")))
    assert batches[0][0].new_text == "Hello world!"


async def test_what_the_engine_reports_passes_through(tokenizer: Any) -> None:
    lp = TokenLogprobs([276, 5], [-0.5, -1.5], 1)
    _, batches, _ = await run(tokenizer, track("r"), track("g"),
                              step(out("r", TOKENS[:1], new_logprobs=[lp], num_cached_tokens=16, queue_time_s=0.25),
                                   out("g", [], "error", error="the grammar did not compile")))
    [[first, failed]] = batches
    assert (first.new_logprobs, first.num_cached_tokens, first.queue_time_s) == ([lp], 16, 0.25)
    assert (failed.request_id, failed.finish_reason, failed.error, failed.new_text) == (
        "g", "error", "the grammar did not compile", "")


async def test_a_stop_string_before_an_error_is_a_complete_answer(tokenizer: Any) -> None:
    _, batches, _ = await run(tokenizer, track("r", stop=["!"]), step(out("r", TOKENS[:6], "error", error="boom")))
    [[only]] = batches
    assert (only.new_text, only.finish_reason, only.stop_reason, only.error) == ("Hello world", "stop", "!", None)


async def test_outputs_for_untracked_sequences_are_ignored(tokenizer: Any) -> None:
    actor, batches, aborts = await run(tokenizer, step(out("ghost", TOKENS[:3], "length")))
    assert batches == [] and aborts == [] and actor.sequences == {}


async def test_the_latest_stats_are_kept(tokenizer: Any) -> None:
    actor = DetokenizerActor(tokenizer)
    assert actor.latest_stats is None
    actor, batches, _ = await run(tokenizer, step(stats=stats(1)), step(), track("r"),
                                  step(out("r", TOKENS[:1]), stats=stats(2)), step(out("r", TOKENS[1:2])))
    assert actor.latest_stats == stats(2)  # a batch without stats keeps the previous ones
    assert len(batches) == 2  # a batch with only stats sends nothing on


async def test_finished_sequences_are_forgotten(tokenizer: Any) -> None:
    actor, _, _ = await run(tokenizer, track("a"), track("b", stop=["!"]), track("c"),
                            step(out("a", TOKENS[:2], "length"), out("b", TOKENS[:6]), out("c", TOKENS[:1])))
    assert list(actor.sequences) == ["c"]
