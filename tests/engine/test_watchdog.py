"""A stuck engine is an unhealthy engine: the front end's watchdog turns silence while requests are
pending into the engine's death, and a working engine core reports often enough never to trip it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from cadence import LLM, SamplingParams
from cadence.core import scheduler_actor
from cadence.engine.front_end import CoreFrontEnd
from cadence.errors import EngineDeadError

pytestmark = pytest.mark.anyio
HANG_GUARD_S = 60


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def front(pending: int, last_heard: float, busy_since: float) -> CoreFrontEnd:
    manager = SimpleNamespace(num_pending=pending, busy_since=busy_since)
    detokenizer = SimpleNamespace(last_heard=last_heard)
    return CoreFrontEnd(client=None, manager=manager, detokenizer=detokenizer, actors=())  # type: ignore[arg-type]


def test_silence_counts_only_while_requests_are_pending_and_from_the_later_of_its_two_clocks() -> None:
    assert front(0, last_heard=0.0, busy_since=0.0).stalled_for(100.0) == 0.0
    assert front(3, last_heard=10.0, busy_since=40.0).stalled_for(100.0) == 60.0  # idle for a while, then busy
    assert front(3, last_heard=90.0, busy_since=40.0).stalled_for(100.0) == 10.0  # busy, heard from lately


async def test_a_step_that_never_ends_fails_the_pending_requests(make_tiny_model: Callable[..., Path]) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32")
    release = threading.Event()
    execute = llm.engine_core.worker.execute_model

    def stuck(step: Any) -> Any:
        release.wait()  # the step never ends until the test lets it
        return execute(step)

    llm.engine_core.worker.execute_model = stuck  # type: ignore[method-assign]
    deaths: list[str] = []
    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with llm.running(on_dead=deaths.append, stall_timeout_s=0.5) as engine:
                with pytest.raises(EngineDeadError, match=r"made no progress for \d+ s with 1 requests pending"):
                    async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=4)):
                        pass
                assert engine.dead is not None and not engine.is_healthy
            # Leaving did not wait for the step: it is still stuck.
            assert not release.is_set()
        assert len(deaths) == 1 and "no progress" in deaths[0]
    finally:
        release.set()


async def test_a_long_run_of_steps_without_outputs_still_reports(make_tiny_model: Callable[..., Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill of a long prompt: steps with no sampled token still send a heartbeat."""
    monkeypatch.setattr(scheduler_actor, "HEARTBEAT_S", 0.0)  # every step reports
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32", max_num_batched_tokens=16)
    batches: list[int] = []
    with anyio.fail_after(HANG_GUARD_S):
        async with llm.running() as engine:
            detokenizer = engine.cores[0].detokenizer
            process = detokenizer._process

            async def count(batch: Any) -> None:
                batches.append(len(batch.outputs))
                await process(batch)

            detokenizer._process = count  # type: ignore[method-assign]
            async for _ in engine.generate([5] * 100, SamplingParams(max_tokens=1)):
                pass
    # 100 prompt tokens in chunks of 16: six steps without a token, then the one that samples.
    assert batches == [0, 0, 0, 0, 0, 0, 1]
