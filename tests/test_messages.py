"""Every cross-boundary message survives a msgpack round trip through one union decoder."""

from __future__ import annotations

import msgspec
import pytest

from cadence import messages as m
from cadence.lora_request import LoRARequest
from cadence.sampling_params import SamplingParams

PARAMS = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop=["\n"], logit_bias={4: 1.5}, logprobs=2)
LOGPROBS = m.TokenLogprobs([5, 5, 9], [-0.1, -0.1, -2.5], sampled_rank=1)
SQL = LoRARequest("sql", 3, "/adapters/sql")

EXAMPLES: list[msgspec.Struct] = [
    m.EngineCoreRequest("r1", [1, 2, 3], PARAMS, eos_token_id=2, arrival_time=1.5, priority=-1, user="ann",
                        lora_request=SQL),
    m.AbortRequests(["r1", "r2"]),
    m.SchedulerOutput(
        step_id=7,
        new_requests=[m.NewRequestData("r1", [1, 2, 3, 4], 3, PARAMS, 2, [[5, 6]], 0, lora_request=SQL)],
        cached_requests=[m.CachedRequestData("r2", [[9]], 17)],
        num_scheduled_tokens={"r1": 4, "r2": 1},
        finished_request_ids=["r0"],
        preempted_request_ids=["r3"],
        spec_token_ids={"r2": [5, 6]},
    ),
    m.ModelRunnerOutput(7, ["r1", "r2"], [11, 12], [LOGPROBS, LOGPROBS, LOGPROBS], forward_time_s=0.01,
                        prompt_logprobs=[m.PromptLogprobs("r2", 1, [LOGPROBS, LOGPROBS])],
                        num_accepted_drafts=[0, 1], draft_token_ids=[[], [7, 8]]),
    m.ExecutorFailed(7, "boom"),
    m.WorkerReady(rank=1, num_blocks=40, kernel_row_limit=16),
    m.WorkerFailed(rank=1, error="RuntimeError: boom"),
    m.EngineCoreOutputs([m.EngineCoreOutput("r1", [11], [LOGPROBS], "stop", 16, queue_time_s=0.5)], timestamp=3.0,
                        stats=m.SchedulerStats(2, 1, 0.25, 30, 40, 512, 128, 3,
                                               spec_decode=m.SpecDecodeStats(4, 10, 6, 10, [3, 2, 1, 0]),
                                               lora=m.LoRAStats(2, ["sql"], ["chat", "sql"]))),
    m.EngineCoreOutputs([], timestamp=3.5, kv_delta=m.KVCacheDelta(stored=[2**64 - 1, 7], removed=[9], cleared=True)),
    m.EngineCoreReady(num_blocks=40, block_size=16, policy="fcfs (chunked=true)"),
    m.EngineDead("engine core exited"),
    m.TrackRequest("r1", [1, 2, 3], PARAMS),
    m.DetokenizedOutputs([m.SequenceDelta("r1", "hi", [11], [LOGPROBS], "stop", "\n", 16)]),
]
UNION = (m.EngineCoreRequest | m.AbortRequests | m.SchedulerOutput | m.ModelRunnerOutput | m.ExecutorFailed
         | m.EngineCoreOutputs | m.EngineCoreReady | m.EngineDead | m.TrackRequest | m.DetokenizedOutputs
         | m.WorkerReady | m.WorkerFailed)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_union_decoder(message: msgspec.Struct) -> None:
    decoder = msgspec.msgpack.Decoder(UNION)
    decoded = decoder.decode(msgspec.msgpack.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_every_message_type_has_an_example() -> None:
    tagged = {cls for cls in vars(m).values()
              if isinstance(cls, type) and issubclass(cls, m._Message) and cls is not m._Message}
    # GrammarBitmask carries a tensor, which only the transport codec encodes: test_structured_output.py
    # round-trips it there.
    covered = {type(e) for e in EXAMPLES} | {m.NewRequestData, m.CachedRequestData, m.TokenLogprobs,
                                              m.EngineCoreOutput, m.SequenceDelta, m.SchedulerStats,
                                              m.GrammarBitmask, m.KVCacheDelta, m.PromptLogprobs,
                                              m.SpecDecodeStats, m.LoRAStats}
    assert tagged == covered


def test_sampling_params_are_validated_when_decoded() -> None:
    bad = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature must be >= 0"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_speculative_decoding_counts_of_several_engines_add_up() -> None:
    parts = [m.SpecDecodeStats(4, 10, 6, 10, [3, 2, 1]), m.SpecDecodeStats(1, 3, 0, 1, [0, 0, 0])]
    assert m.SpecDecodeStats.total(parts) == m.SpecDecodeStats(5, 13, 6, 11, [3, 2, 1])


def test_the_lora_adapters_of_several_engines_are_named_once() -> None:
    parts = [m.LoRAStats(2, ["sql", "chat"], []), m.LoRAStats(2, ["sql"], ["law"])]
    assert m.LoRAStats.total(parts) == m.LoRAStats(2, ["chat", "sql"], ["law"])
