"""The scheduler actor (the engine core's step loop) between a fake executor and a fake output channel.

The fake executor answers each ``SchedulerOutput`` by sending a ``ModelRunnerOutput`` back into the
actor's inbox (as the executor actor does), sampling one token for every request whose scheduled
tokens reached its end; it can also slip other messages in before or after its reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from cadence.config import SchedulerConfig
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.scheduler_actor import SchedulerActor
from cadence.core.step_timing import StepTiming
from cadence.executor.base import WorkerError
from cadence.lora.adapter import AdapterLimits
from cadence.lora_request import LoRARequest
from cadence.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExecutorFailed,
    ModelRunnerOutput,
    SchedulerOutput,
)
from cadence.policies.base import PolicyContext
from cadence.policies.loader import load_policy
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

BS = 4
NUM_BLOCKS = 33
VOCAB = 100
TOKEN = 7
FORWARD_S = 0.001
TIMEOUT_S = 10


def make_actor(*, budget: int = 64, engine_chunked: bool = True, num_blocks: int = NUM_BLOCKS) -> SchedulerActor:
    config = SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=engine_chunked)
    policy = load_policy("fcfs", PolicyContext(budget, config.max_num_seqs, engine_chunked, 0))
    scheduler = Scheduler(config, KVCacheManager(num_blocks, BS), policy)
    return SchedulerActor(scheduler, max_model_len=64, timing=StepTiming(), vocab_size=VOCAB)


def new_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=0,
                             arrival_time=time.time())


class FakeExecutor:
    """The executor actor's side of the conversation."""

    def __init__(self, actor: SchedulerActor, *, before: dict[int, list[Any]] | None = None,
                 after: dict[int, list[Any]] | None = None, fail_at: int | None = None,
                 close_at: int | None = None) -> None:
        self.actor = actor
        self.steps: list[SchedulerOutput] = []
        self.before = before or {}  # step id -> messages sent into the inbox before the reply
        self.after = after or {}  # ... and after it
        self.fail_at = fail_at
        self.close_at = close_at
        self.closed = False

    async def send(self, step: SchedulerOutput) -> None:
        self.steps.append(step)
        scheduler = self.actor.scheduler
        sampled = [rid for rid in step.num_scheduled_tokens
                   if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens]
        for message in self.before.get(step.step_id, []):
            await self.actor.send(message)
        if step.step_id == self.close_at:
            self.actor.close()
            return
        if step.step_id == self.fail_at:
            await self.actor.send(ExecutorFailed(step.step_id, "RuntimeError: boom"))
            return
        await self.actor.send(ModelRunnerOutput(step.step_id, sampled, [TOKEN] * len(sampled),
                                                forward_time_s=FORWARD_S))
        for message in self.after.get(step.step_id, []):
            await self.actor.send(message)

    def close(self) -> None:
        self.closed = True


class Outputs:
    """The output channel; closes the actor's inbox once ``expected`` requests have all finished."""

    def __init__(self, actor: SchedulerActor, expected: set[str]) -> None:
        self.actor = actor
        self.expected = set(expected)
        self.batches: list[EngineCoreOutputs] = []
        self.closed = False

    async def send(self, batch: EngineCoreOutputs) -> None:
        self.batches.append(batch)
        self.expected -= {o.request_id for o in batch.outputs if o.finish_reason is not None}
        if not self.expected:
            self.actor.close()

    def close(self) -> None:
        self.closed = True

    def tokens(self) -> list[list[tuple[str, list[int], str | None]]]:
        return [[(o.request_id, o.new_token_ids, o.finish_reason) for o in b.outputs] for b in self.batches]


def connect(actor: SchedulerActor, expected: set[str], **executor: Any) -> tuple[FakeExecutor, Outputs]:
    fake, outputs = FakeExecutor(actor, **executor), Outputs(actor, expected)
    actor.connect(fake, outputs)
    return fake, outputs


def run(actor: SchedulerActor) -> None:
    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            await actor.run()

    anyio.run(main)


def test_each_output_batch_names_the_requests_its_step_preempted() -> None:
    actor = make_actor(num_blocks=5)  # four usable blocks of 4 tokens: two requests outgrow them
    fake, outputs = connect(actor, {"r1", "r2"})
    actor.send_nowait(new_request("r1", list(range(1, 7)), max_tokens=8))
    actor.send_nowait(new_request("r2", list(range(20, 26)), max_tokens=8))
    run(actor)

    preempted = [s.preempted_request_ids for s in fake.steps]
    assert ["r2"] in preempted  # the later request made room for the earlier one
    assert [b.preempted for b in outputs.batches] == preempted  # each step's outputs went out alone
    assert actor.scheduler.num_preemptions == sum(map(len, preempted))


def test_requests_in_outputs_with_stats_out() -> None:
    actor = make_actor()
    fake, outputs = connect(actor, {"r1", "r2"})
    actor.send_nowait(new_request("r1", list(range(1, 6)), max_tokens=3))
    actor.send_nowait(new_request("r2", list(range(20, 23)), max_tokens=2))
    run(actor)

    assert [s.num_scheduled_tokens for s in fake.steps] == [{"r1": 5, "r2": 3}, {"r1": 1, "r2": 1}, {"r1": 1}]
    assert [s.finished_request_ids for s in fake.steps] == [[], [], ["r2"]]
    assert outputs.tokens() == [
        [("r1", [TOKEN], None), ("r2", [TOKEN], None)],
        [("r1", [TOKEN], None), ("r2", [TOKEN], "length")],
        [("r1", [TOKEN], "length")],
    ]
    # The queue time comes with a request's first output only.
    first, *rest = outputs.batches
    assert all(o.queue_time_s is not None and 0 <= o.queue_time_s < TIMEOUT_S for o in first.outputs)
    assert all(o.queue_time_s is None for b in rest for o in b.outputs)
    stats = [b.stats for b in outputs.batches]
    assert all(s is not None for s in stats)
    assert [(s.num_running, s.num_waiting, s.num_free_blocks, s.num_steps) for s in stats if s] == [
        (2, 0, 32 - 2 - 1, 1),  # r1 computed 5 tokens (2 blocks), r2 3 (1 block)
        (1, 0, 32 - 2, 2),
        (0, 0, 32, 3),
    ]
    last = stats[-1]
    assert last is not None
    assert (last.num_blocks, last.kv_cache_usage, last.num_preemptions) == (NUM_BLOCKS, 0.0, 0)
    assert (last.prefix_cache_queries, last.prefix_cache_hits) == (5 + 3, 0)
    assert last.forward_time_s == pytest.approx(3 * FORWARD_S)
    assert last.step_time_s > 0  # wall time, measured around the fake executor
    assert {size: totals.num_steps for size, totals in actor.timing.by_batch_size.items()} == {2: 2, 1: 1}
    # The inbox closed once everything finished: the loop ended and closed the executor's mailbox.
    assert fake.closed and not outputs.closed
    assert actor.scheduler.requests == {}


def test_an_abort_during_a_step_and_one_between_steps() -> None:
    actor = make_actor()
    # b is aborted while step 1 runs (its sampled token is dropped); a after step 2 came back.
    fake, outputs = connect(actor, {"a", "b"}, before={1: [AbortRequests(["b"])]}, after={2: [AbortRequests(["a"])]})
    actor.send_nowait(new_request("a", [1, 2, 3], max_tokens=10))
    actor.send_nowait(new_request("b", [4, 5, 6], max_tokens=10))
    run(actor)

    assert [s.num_scheduled_tokens for s in fake.steps] == [{"a": 3, "b": 3}, {"a": 1}]
    assert fake.steps[1].finished_request_ids == ["b"]
    assert outputs.tokens() == [
        [("b", [], "abort"), ("a", [TOKEN], None)],
        [("a", [TOKEN], None)],
        [("a", [], "abort")],  # emitted without another step
    ]
    assert outputs.batches[-1].stats is not None and outputs.batches[-1].stats.num_free_blocks == 32
    assert actor.scheduler.requests == {} and fake.closed


def test_an_executor_failure_fails_the_loop_with_a_worker_error() -> None:
    actor = make_actor()
    fake, outputs = connect(actor, {"a"}, fail_at=2)
    actor.send_nowait(new_request("a", [1, 2, 3], max_tokens=10))
    with pytest.raises(WorkerError, match="step 2 failed in the worker: RuntimeError: boom"):
        run(actor)
    assert len(fake.steps) == 2 and fake.closed
    assert outputs.tokens() == [[("a", [TOKEN], None)]]  # step 1's output went out before


def test_the_inbox_closing_during_a_step_is_an_error() -> None:
    actor = make_actor()
    fake, _ = connect(actor, {"a"}, close_at=1)
    actor.send_nowait(new_request("a", [1, 2, 3], max_tokens=10))
    with pytest.raises(RuntimeError, match="inbox closed while a step was running"):
        run(actor)
    assert fake.closed


def test_an_idle_actor_waits_on_its_inbox_and_exits_when_it_closes() -> None:
    actor = make_actor()
    fake, outputs = connect(actor, set())
    ended = []

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as group:
                async def run_actor() -> None:
                    await actor.run()
                    ended.append(True)

                group.start_soon(run_actor)
                # Returns only once every other task is blocked: a busy loop would never let it.
                await anyio.wait_all_tasks_blocked()
                for _ in range(10):
                    await anyio.lowlevel.checkpoint()
                assert actor.inbox.reader_waiting
                assert not ended
                actor.close()

    anyio.run(main)
    assert ended == [True]
    assert fake.steps == [] and outputs.batches == []
    assert fake.closed


def test_a_model_output_outside_a_step_is_refused() -> None:
    actor = make_actor()
    connect(actor, set())
    actor.send_nowait(ModelRunnerOutput(1, [], []))
    with pytest.raises(TypeError, match="unexpected ModelRunnerOutput outside a step"):
        run(actor)


def test_a_request_that_can_never_be_scheduled_fails_the_loop() -> None:
    # Without chunked prefill a prompt longer than the step budget never fits; the front end must
    # reject it, and the engine core refuses to spin on it.
    actor = make_actor(budget=8, engine_chunked=False)
    fake, _ = connect(actor, {"long"})
    actor.send_nowait(new_request("long", list(range(1, 10)), max_tokens=2))
    with pytest.raises(RuntimeError, match="no waiting request can be scheduled on an idle engine"):
        run(actor)
    assert fake.steps == [] and fake.closed


def _stats_of(outputs: Outputs, pick: Callable[[Any], Any]) -> list[Any]:
    return [pick(b.stats) for b in outputs.batches]


def test_outputs_of_every_request_finished_in_a_step_are_one_batch() -> None:
    actor = make_actor()
    _, outputs = connect(actor, {"a", "b", "c"})
    for rid, start in (("a", 1), ("b", 10), ("c", 20)):
        actor.send_nowait(new_request(rid, [start, start + 1], max_tokens=1))
    run(actor)
    assert len(outputs.batches) == 1
    assert sorted(o.request_id for o in outputs.batches[0].outputs) == ["a", "b", "c"]
    assert all(isinstance(o, EngineCoreOutput) and o.finish_reason == "length" for o in outputs.batches[0].outputs)
    assert _stats_of(outputs, lambda s: (s.num_running, s.num_steps)) == [(0, 1)]


def test_aborts_taken_as_the_inbox_closes_still_report_their_requests() -> None:
    actor = make_actor()
    fake, outputs = connect(actor, set())
    actor.send_nowait(new_request("a", [1, 2, 3], max_tokens=10))
    actor.send_nowait(AbortRequests(["a"]))
    actor.close()
    run(actor)

    assert fake.steps == []
    assert outputs.tokens() == [[("a", [], "abort")]]
    assert actor.scheduler.requests == {} and fake.closed


# ---- requests the engine core refuses -------------------------------------------------------


def _request(request_id: str = "bad", prompt: list[int] | None = None, eos: int | None = 0, arrival: float = 0.0,
             **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3] if prompt is None else prompt, SamplingParams(**params),
                             eos_token_id=eos, arrival_time=arrival)


REFUSED = {
    "empty-prompt": (_request(prompt=[]), "prompt: the prompt is empty"),
    "prompt-of-max-model-len": (_request(prompt=[1] * 64), "prompt: the prompt has 64 tokens but max_model_len is 64"),
    "huge-prompt-id": (_request(prompt=[1, 10**9, 2]),
                       "prompt: token id 1000000000 is outside the vocabulary (size 100)"),
    "negative-prompt-id": (_request(prompt=[1, -1]), "prompt: token id -1 is outside the vocabulary (size 100)"),
    "prompt-id-of-vocab-size": (_request(prompt=[VOCAB]), "prompt: token id 100 is outside the vocabulary (size 100)"),
    "stop-token-id": (_request(stop_token_ids=[5, VOCAB]),
                      "stop_token_ids: token id 100 is outside the vocabulary (size 100)"),
    "logit-bias-key": (_request(logit_bias={3: 1.0, 10**9: 5.0}),
                       "logit_bias: token id 1000000000 is outside the vocabulary (size 100)"),
    "negative-logit-bias-key": (_request(logit_bias={-1: 5.0}),
                                "logit_bias: token id -1 is outside the vocabulary (size 100)"),
    "eos-token-id": (_request(eos=VOCAB), "eos_token_id: token id 100 is outside the vocabulary (size 100)"),
    "arrival-time": (_request(arrival=float("nan")), "arrival_time must be finite, got nan"),
    "lora-off": (msgspec.structs.replace(_request(), lora_request=LoRARequest("x", 1, "/adapters/x")),
                 "model: this engine core serves no LoRA adapter (start it with --enable-lora)"),
    # No grammar manager in these tests' scheduler: its ValueError is the request's error.
    "constraint": (_request(structured_outputs=StructuredOutputsParams(regex="a+")),
                   "this scheduler has no structured-output manager for a constrained request"),
}


@pytest.mark.parametrize(("bad", "error"), REFUSED.values(), ids=REFUSED.keys())
def test_a_request_the_engine_cannot_serve_is_answered_with_an_error_and_the_loop_serves_on(
        bad: EngineCoreRequest, error: str, caplog: pytest.LogCaptureFixture) -> None:
    actor = make_actor()
    fake, outputs = connect(actor, {"bad", "good"})
    caplog.set_level(logging.WARNING, logger="cadence.core.scheduler_actor")
    actor.send_nowait(bad)
    actor.send_nowait(new_request("good", [1, 2, 3], max_tokens=2))
    run(actor)

    assert outputs.tokens() == [[("bad", [], "error"), ("good", [TOKEN], None)], [("good", [TOKEN], "length")]]
    assert outputs.batches[0].outputs[0].error == error
    assert [s.num_scheduled_tokens for s in fake.steps] == [{"good": 3}, {"good": 1}]
    assert [r.getMessage() for r in caplog.records] == [f"refused request 'bad': {error}"]
    assert actor.scheduler.requests == {}


def test_a_request_whose_adapter_the_workers_could_not_read_is_refused(tmp_path: Path) -> None:
    """Checked again in the engine core: a worker that failed to read an adapter would fail the core."""
    actor = make_actor()
    actor.lora = AdapterLimits((("q_proj", (8, 8)),), num_layers=1, max_rank=4)
    _, outputs = connect(actor, {"bad"})
    actor.send_nowait(msgspec.structs.replace(_request(), lora_request=LoRARequest("x", 1, str(tmp_path / "x"))))
    run(actor)
    [answer] = outputs.batches[0].outputs
    assert answer.finish_reason == "error"
    assert answer.error == ("model: LoRA adapter 'x': no LoRA adapter at "
                            f"'{tmp_path / 'x'}': No such file or directory (adapter_model.safetensors)")


def test_a_request_needing_more_kv_cache_than_the_pool_holds_is_refused_during_a_step() -> None:
    actor = make_actor(num_blocks=9)  # 8 usable blocks of 4: 32 tokens
    # "big" comes in while the first step runs; its answer goes out with that step's outputs.
    fake, outputs = connect(actor, {"big", "fits", "good"},
                            before={1: [new_request("big", [1] * 10, max_tokens=23)]})
    actor.send_nowait(new_request("good", [1, 2, 3], max_tokens=2))
    actor.send_nowait(new_request("fits", [1] * 10, max_tokens=22))  # 32 tokens: the whole pool
    run(actor)

    big = [o for b in outputs.batches for o in b.outputs if o.request_id == "big"]
    assert [(o.finish_reason, o.error) for o in big] == [
        ("error", "max_tokens: the request needs up to 33 tokens of KV cache but the whole cache holds 32")]
    assert big[0] in outputs.batches[0].outputs
    assert all("big" not in s.num_scheduled_tokens for s in fake.steps)
    finished = {o.request_id: o.finish_reason for b in outputs.batches for o in b.outputs if o.finish_reason}
    assert finished == {"big": "error", "good": "length", "fits": "length"}


def test_a_request_whose_id_is_in_the_engine_is_dropped_unanswered(caplog: pytest.LogCaptureFixture) -> None:
    # An answer under that id would finish the live request in the front end.
    actor = make_actor()
    fake, outputs = connect(actor, {"a"}, before={1: [new_request("a", [9, 9, 9, 9, 9], max_tokens=7)]})
    caplog.set_level(logging.WARNING, logger="cadence.core.scheduler_actor")
    actor.send_nowait(new_request("a", [1, 2, 3], max_tokens=2))
    actor.send_nowait(new_request("a", [4, 5], max_tokens=2))
    run(actor)

    assert outputs.tokens() == [[("a", [TOKEN], None)], [("a", [TOKEN], "length")]]
    assert [s.num_scheduled_tokens for s in fake.steps] == [{"a": 3}, {"a": 1}]
    assert [r.getMessage() for r in caplog.records] == ["dropped a request whose id 'a' is already in the engine"] * 2
