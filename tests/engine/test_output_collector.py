"""A request's outputs between the request manager and a reader: bounded whatever the reader's pace."""

from __future__ import annotations

import anyio
import pytest

from cadence.engine.output_collector import OutputCollector, merge
from cadence.messages import SequenceDelta, TokenLogprobs

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs([token], [-1.0], 1)


def test_merge_appends_what_both_gained_and_ends_as_the_later_ends() -> None:
    earlier = SequenceDelta("c", "Hel", [1, 2], new_logprobs=[lp(1), lp(2)], num_cached_tokens=16, queue_time_s=0.5)
    later = SequenceDelta("c", "lo", [3], finish_reason="stop", stop_reason=3, num_cached_tokens=0)
    assert merge(earlier, later) == SequenceDelta(
        "c", "Hello", [1, 2, 3], new_logprobs=[lp(1), lp(2)], finish_reason="stop", stop_reason=3,
        num_cached_tokens=16, queue_time_s=0.5)
    assert merge(SequenceDelta("c", "a", [1]), SequenceDelta("c", "b", [2], new_logprobs=[lp(2)])).new_logprobs == [
        lp(2)]
    assert merge(SequenceDelta("c", "a", [1]), SequenceDelta("c", "b", [2])).new_logprobs is None
    failed = merge(SequenceDelta("c", "a", [1]), SequenceDelta("c", "", [], finish_reason="error", error="no"))
    assert (failed.finish_reason, failed.error, failed.new_text) == ("error", "no", "a")


async def test_a_reader_that_falls_behind_holds_one_delta_per_sequence() -> None:
    outputs = OutputCollector()
    for step in range(1_000):  # a thousand steps while the reader is away
        outputs.put([(1, SequenceDelta("b", "y", [step])), (0, SequenceDelta("a", "x", [step]))])
        assert outputs.num_pending == 2
    batch = await outputs.get()
    assert batch is not None and [i for i, _ in batch] == [1, 0]  # the order they first changed in
    assert [(d.new_text, d.new_token_ids) for _, d in batch] == [("y" * 1_000, list(range(1_000))),
                                                                 ("x" * 1_000, list(range(1_000)))]
    assert outputs.num_pending == 0


async def test_get_waits_for_outputs_and_ends_once_closed_and_drained() -> None:
    outputs = OutputCollector()
    got: list[object] = []

    async def read() -> None:
        while (batch := await outputs.get()) is not None:
            got.append(batch)
        got.append(None)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # nothing yet: the reader waits
        outputs.put([(0, SequenceDelta("a", "x", [1]))])
        outputs.close()
    assert got == [[(0, SequenceDelta("a", "x", [1]))], None]
    assert outputs.error is None


async def test_closing_with_an_error_says_why_after_what_was_pending() -> None:
    outputs = OutputCollector()
    outputs.put([(0, SequenceDelta("a", "x", [1]))])
    outputs.close("engine core process exited with code -9")
    assert await outputs.get() == [(0, SequenceDelta("a", "x", [1]))]
    assert await outputs.get() is None
    assert outputs.error == "engine core process exited with code -9"
