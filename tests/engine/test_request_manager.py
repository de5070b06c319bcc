"""The request manager, between fake mailboxes: it fans out ``n``, routes each sequence's deltas
back to its caller's stream by structure (never by parsing ids), and fails every stream at once
when the engine dies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest

from cadence.engine.admission import ModelLimits, PreparedRequest
from cadence.engine.request_manager import RequestHandle, RequestManager
from cadence.errors import EngineDeadError, InvalidRequestError
from cadence.messages import (
    AbortRequests,
    DetokenizedOutputs,
    EngineCoreRequest,
    SequenceDelta,
    TokenLogprobs,
    TrackRequest,
)
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

LIMITS = ModelLimits(max_model_len=64, vocab_size=320, kv_capacity_tokens=1024, eos_token_id=0)
TRICKY_IDS = ["a#1", "x/y/../z", "日本語-🎉-é\u0301", "\u0000", "", "k" * 1000, "order#7", "order", "0", "1"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Mailbox:
    """A fake mailbox: appends ``(name, message)`` to a log shared by the manager's two targets."""

    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        self.name = name
        self.log = log
        self.closed = False

    async def send(self, message: Any) -> None:
        self.log.append((self.name, message))

    def send_nowait(self, message: Any) -> None:
        self.log.append((self.name, message))

    def close(self) -> None:
        self.closed = True


class Harness:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.manager = RequestManager(LIMITS)
        self.manager.connect(Mailbox("core", self.log), Mailbox("detok", self.log))

    def sent(self, kind: type) -> list[Any]:
        return [message for _, message in self.log if isinstance(message, kind)]

    async def add(self, request_id: str, prepared: PreparedRequest, **kwargs: Any) -> tuple[RequestHandle, list[str]]:
        before = len(self.sent(EngineCoreRequest))
        handle = self.manager.add_request(request_id, prepared, **kwargs)
        children = [r.request_id for r in self.sent(EngineCoreRequest)[before:]]
        return handle, children

    async def deliver(self, *deltas: SequenceDelta) -> None:
        await self.manager.send(DetokenizedOutputs(list(deltas)))


def prepared(n: int = 1, seed: int | None = None, prompt: list[int] | None = None, text: str | None = None,
             **kwargs: Any) -> PreparedRequest:
    return PreparedRequest(prompt or [5, 6, 7], SamplingParams(n=n, seed=seed, **kwargs), text)


def delta(child: str, text: str = "", tokens: list[int] | None = None, finish: str | None = None,
          **kwargs: Any) -> SequenceDelta:
    return SequenceDelta(child, text, tokens if tokens is not None else [], finish_reason=finish, **kwargs)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A manager whose actor loop runs for the test (its inbox closed at the end)."""
    h = Harness()
    with anyio.fail_after(30):  # a hang guard only
        async with anyio.create_task_group() as group:
            group.start_soon(h.manager.run)
            yield h
            h.manager.close()


# ---- admission -----------------------------------------------------------------------------


async def test_each_child_is_tracked_before_it_reaches_the_engine_core(harness: Harness) -> None:
    request = prepared(n=3, seed=None, prompt=[9, 8])
    _, children = await harness.add("req", request, priority=-2, user="ann")
    assert [(name, type(message).__name__) for name, message in harness.log] == [
        ("detok", "TrackRequest"), ("core", "EngineCoreRequest")] * 3
    tracks, requests = harness.sent(TrackRequest), harness.sent(EngineCoreRequest)
    assert [t.request_id for t in tracks] == children == [r.request_id for r in requests]
    assert len(set(children)) == 3 and "req" not in children
    for track, sent in zip(tracks, requests, strict=True):
        assert track.prompt_token_ids == sent.prompt_token_ids == [9, 8]
        assert track.sampling_params == sent.sampling_params
        assert sent.sampling_params.n == 1 and sent.sampling_params.seed is None
        assert (sent.eos_token_id, sent.priority, sent.user) == (0, -2, "ann")
    assert len({r.arrival_time for r in requests}) == 1


async def test_n_fans_out_with_consecutive_seeds(harness: Harness) -> None:
    request = prepared(n=4, seed=10, temperature=0.5, stop=["x"], max_tokens=3)
    _, children = await harness.add("req", request)
    sent = harness.sent(EngineCoreRequest)
    assert [r.request_id for r in sent] == children and len(set(children)) == 4
    params = [r.sampling_params for r in sent]
    assert [p.seed for p in params] == [10, 11, 12, 13]
    assert all(p == msgspec.structs.replace(request.params, n=1, seed=p.seed) for p in params)
    assert request.params.n == 4 and request.params.seed == 10  # the caller's parameters are untouched


async def test_a_single_sequence_keeps_its_parameters(harness: Harness) -> None:
    request = prepared(n=1, seed=42)
    await harness.add("req", request)
    [sent] = harness.sent(EngineCoreRequest)
    assert sent.sampling_params is request.params and sent.sampling_params.seed == 42


async def test_child_ids_are_never_reused(harness: Harness) -> None:
    seen: list[str] = []
    for i in range(5):
        handle, children = await harness.add(f"r{i}", prepared(n=2))
        seen += children
        await harness.deliver(*(delta(c, finish="length") for c in children))
        await handle.result()
    _, children = await harness.add("r0", prepared(n=2))  # a caller's id again: fresh children
    seen += children
    assert len(seen) == len(set(seen)) == 12


async def test_a_pending_id_cannot_be_used_twice(harness: Harness) -> None:
    await harness.add("dup", prepared())
    log_size = len(harness.log)
    with pytest.raises(InvalidRequestError, match="request id 'dup' is already in use") as caught:
        await harness.add("dup", prepared(n=3))
    assert caught.value.param == "request_id"
    assert len(harness.log) == log_size  # nothing of it was sent
    assert harness.manager.num_pending == 1


async def test_a_finished_id_can_be_used_again(harness: Harness) -> None:
    for round_ in range(3):
        handle, [child] = await harness.add("again", prepared())
        await harness.deliver(delta(child, f"round {round_}", [round_], "stop"))
        result = await handle.result()
        assert result.outputs[0].text == f"round {round_}" and result.finished
        assert "again" not in harness.manager


# ---- outputs -------------------------------------------------------------------------------


async def test_deltas_stream_back_and_fold_into_the_result(harness: Harness) -> None:
    lp = TokenLogprobs([11, 3], [-0.5, -0.25], 1)
    request = prepared(n=2, text="the prompt", prompt=[1, 2])
    handle, (c0, c1) = await harness.add("req", request)
    assert "req" in harness.manager and harness.manager.num_pending == 1
    stream = handle.deltas()
    await harness.deliver(delta(c0, "He", [11], new_logprobs=[lp], num_cached_tokens=16, queue_time_s=0.25))
    first = await anext(stream)
    assert first.request_id == "req" and first.prompt == "the prompt" and first.prompt_token_ids == [1, 2]
    assert not first.finished and first.num_cached_tokens == 16 and first.queue_time_s == 0.25
    assert [(o.index, o.text, o.token_ids, o.cumulative_logprob) for o in first.outputs] == [(0, "He", [11], -0.5)]

    await harness.deliver(delta(c1, "Yo", [12, 13]), delta(c0, "llo", [14, 15], new_logprobs=[lp, lp]))
    second = await anext(stream)
    assert [(o.index, o.text, o.token_ids) for o in second.outputs] == [(1, "Yo", [12, 13]), (0, "llo", [14, 15])]
    assert second.outputs[1].cumulative_logprob == -1.5 and second.outputs[1].logprobs == [lp, lp]

    await harness.deliver(delta(c0, "!", [16], "stop", stop_reason="!"), delta("unknown-child", "x", [1]))
    third = await anext(stream)
    assert [(o.index, o.finish_reason, o.stop_reason) for o in third.outputs] == [(0, "stop", "!")]
    assert not third.finished and "req" in harness.manager

    await harness.deliver(delta(c1, "", [], "length", num_cached_tokens=3))
    last = await anext(stream)
    assert last.finished and [o.index for o in last.outputs] == [1]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert "req" not in harness.manager and harness.manager.num_pending == 0

    result = handle.output
    assert result.finished and result.num_cached_tokens == 16 and result.queue_time_s == 0.25
    assert [(o.text, o.token_ids, o.finish_reason) for o in result.outputs] == [
        ("Hello!", [11, 14, 15, 16], "stop"), ("Yo", [12, 13], "length")]
    assert result.outputs[0].cumulative_logprob == -1.5 and result.outputs[0].logprobs == [lp, lp, lp]
    assert result.outputs[1].logprobs is None and result.outputs[1].cumulative_logprob is None


async def test_a_failed_sequence_reports_its_error(harness: Harness) -> None:
    handle, [child] = await harness.add("req", prepared())
    await harness.deliver(delta(child, "", [], "error", error="the grammar did not compile"))
    result = await handle.result()
    assert result.finished and result.error == "the grammar did not compile"
    assert result.outputs[0].finish_reason == "error"


async def test_identity_is_structure_not_syntax(harness: Harness) -> None:
    """Ids that look like another's child, or another's prefix, never receive its outputs."""
    requests = {request_id: prepared(n=8 if request_id == "order" else 2) for request_id in TRICKY_IDS}
    handles: dict[str, RequestHandle] = {}
    children: dict[str, list[str]] = {}
    for request_id, request in requests.items():
        handles[request_id], children[request_id] = await harness.add(request_id, request)
    assert len({c for cs in children.values() for c in cs}) == sum(r.params.n for r in requests.values())

    # Every sequence in each of three steps, all requests in every batch, the last finishing them.
    for step in range(3):
        await harness.deliver(*(
            delta(child, f"<{request_id}|{index}|{step}>", [step], "length" if step == 2 else None)
            for request_id, cs in reversed(children.items()) for index, child in enumerate(cs)))
    for request_id, handle in handles.items():
        result = await handle.result()
        assert result.request_id == request_id and result.finished
        assert [o.text for o in result.outputs] == [
            "".join(f"<{request_id}|{index}|{step}>" for step in range(3))
            for index in range(requests[request_id].params.n)]
        assert all(o.token_ids == [0, 1, 2] for o in result.outputs)
    assert harness.manager.num_pending == 0


async def test_a_reader_that_stopped_reading_does_not_stop_the_others(harness: Harness) -> None:
    gone, [g] = await harness.add("gone", prepared())
    stays, [s] = await harness.add("stays", prepared())
    await harness.deliver(delta(g, "a", [1]))
    async for _ in gone.deltas():
        break  # the caller left: its stream is closed
    await harness.deliver(delta(g, "b", [2]), delta(s, "c", [3]))
    await harness.deliver(delta(g, "", [], "abort"), delta(s, "d", [4], "stop"))
    result = await stays.result()
    assert result.outputs[0].text == "cd" and "gone" not in harness.manager


# ---- aborts and death ----------------------------------------------------------------------


async def test_abort_names_the_unfinished_children(harness: Harness) -> None:
    handle, children = await harness.add("req#1", prepared(n=3))
    await harness.deliver(delta(children[1], "x", [1], "length"))
    stream = handle.deltas()
    await anext(stream)
    await harness.manager.abort("req#1")
    assert harness.sent(AbortRequests) == [AbortRequests([children[0], children[2]])]
    await harness.manager.abort("req")  # unknown: nothing sent
    assert len(harness.sent(AbortRequests)) == 1
    await harness.deliver(delta(children[0], "", [], "abort"), delta(children[2], "", [], "abort"))
    async for _ in stream:
        pass
    assert [o.finish_reason for o in handle.output.outputs] == ["abort", "length", "abort"]
    assert handle.output.finished and "req#1" not in harness.manager


async def test_fail_all_ends_every_stream_with_the_error(harness: Harness) -> None:
    handles = [(await harness.add(request_id, prepared(n=2)))[0] for request_id in ("a", "a#0", "b/c")]
    started, [c0, _] = await harness.add("x", prepared(n=2))
    await harness.deliver(delta(c0, "partial", [1]))
    harness.manager.fail_all("engine core exited with code -9")
    assert harness.manager.num_pending == 0 and "a" not in harness.manager
    for handle in [*handles, started]:
        with pytest.raises(EngineDeadError, match="engine core exited with code -9"):
            await handle.result()
    # Late outputs are ignored; no new request, and no abort, goes out.
    await harness.deliver(delta(c0, "late", [2], "stop"))
    log_size = len(harness.log)
    await harness.manager.abort("a")
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        await harness.add("new", prepared())
    assert len(harness.log) == log_size


async def test_the_stream_of_a_request_failed_mid_way_keeps_what_came_before(harness: Harness) -> None:
    handle, [child] = await harness.add("req", prepared())
    await harness.deliver(delta(child, "so far", [4]))
    stream = handle.deltas()
    assert (await anext(stream)).outputs[0].text == "so far"
    harness.manager.fail_all("boom")
    with pytest.raises(EngineDeadError, match="boom"):
        await anext(stream)
    assert handle.output.outputs[0].text == "so far" and not handle.output.finished


async def test_the_actor_ends_when_its_inbox_closes() -> None:
    h = Harness()
    await h.manager.send(DetokenizedOutputs([delta("nobody", "x", [1])]))
    h.manager.close()
    with anyio.fail_after(10):
        await h.manager.run()


async def test_a_cancelled_caller_never_leaves_a_request_half_submitted() -> None:
    """Submitting never yields: a cancellation (a client gone) lands before or after it, never inside,
    so every registered request has all its sequences at the engine core."""
    harness = Harness()
    with anyio.CancelScope() as scope:
        scope.cancel()
        handle, children = await harness.add("r", prepared(n=3))
    assert len(children) == 3 and "r" in harness.manager
    assert [m.request_id for m in harness.sent(TrackRequest)] == children
    await harness.manager.abort(handle.request_id)
    assert harness.sent(AbortRequests) == [AbortRequests(children)]
