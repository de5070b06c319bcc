"""AsyncEngine over a real in-process engine core (``LLM.running``) on a tiny model: any string is a
request id, prepared requests, duplicate ids, aborts, and an engine whose worker fails.

(The engine core in its own process is tested in tests/engine/test_async_engine.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cadence.engine.admission import PreparedRequest
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.llm import LLM
from cadence.errors import EngineDeadError, InvalidRequestError
from cadence.messages import RequestOutput
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def llm(make_tiny_model: Callable[..., Path]) -> Any:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(llm: LLM) -> list[int]:
    """What the offline API generates greedily for PROMPT."""
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@dataclass
class Collected:
    """One request's deltas from ``generate``, folded per sequence."""

    deltas: list[RequestOutput] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)

    @property
    def last(self) -> RequestOutput:
        return self.deltas[-1]


async def collect(engine: AsyncEngine, prompt: Any, params: SamplingParams | None, request_id: str | None = None
                  ) -> Collected:
    collected = Collected()
    async for delta in engine.generate(prompt, params, request_id):
        collected.deltas.append(delta)
        for seq in delta.outputs:
            collected.tokens.setdefault(seq.index, []).extend(seq.token_ids)
            collected.finish[seq.index] = seq.finish_reason
    return collected


async def test_any_string_is_a_request_id(llm: LLM, offline: list[int]) -> None:
    """Ids that look like paths, another's child (``order#7`` next to ``order`` with n=8), or are long."""
    ids = {"a#1": 1, "x/y/../z": 1, "日本語-🎉-é\u0301": 1, "k" * 1000: 1, "order#7": 1, "order": 8, "": 1}
    results: dict[str, Collected] = {}
    async with llm.running() as engine:

        async def one(request_id: str, n: int) -> None:
            params = GREEDY if n == 1 else SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
            results[request_id] = await collect(engine, PROMPT, params, request_id)

        with anyio.fail_after(120):  # a hang guard only
            async with anyio.create_task_group() as group:
                for request_id, n in ids.items():
                    group.start_soon(one, request_id, n)
        assert engine.num_pending_requests == 0
        assert engine.stats is not None and engine.stats.num_running == 0
    for request_id, n in ids.items():
        result = results[request_id]
        assert all(d.request_id == request_id for d in result.deltas) and result.last.finished
        assert sorted(result.tokens) == list(range(n))
        assert all(len(tokens) == 5 for tokens in result.tokens.values())
        assert result.finish == dict.fromkeys(range(n), "length")
        if n == 1:
            assert result.tokens[0] == offline


async def test_a_prepared_request_carries_its_parameters(llm: LLM, offline: list[int]) -> None:
    async with llm.running() as engine:
        prepared = engine.prepare("Hello world", GREEDY)
        assert isinstance(prepared, PreparedRequest) and prepared.prompt_text == "Hello world"
        with anyio.fail_after(60):
            result = await collect(engine, prepared, None, "prepared")
            by_ids = await collect(engine, PROMPT, GREEDY)
        assert result.last.prompt == "Hello world" and result.last.prompt_token_ids == prepared.prompt_token_ids
        assert len(result.tokens[0]) == 5
        assert by_ids.last.prompt is None and by_ids.tokens[0] == offline
        assert by_ids.last.request_id.startswith("req-")  # a fresh id when none is given
        with pytest.raises(TypeError, match="carries its own sampling parameters"):
            async for _ in engine.generate(prepared, GREEDY):
                pass
        with pytest.raises(TypeError, match="needs params"):
            async for _ in engine.generate(PROMPT):
                pass
        assert engine.num_pending_requests == 0


async def test_a_pending_id_cannot_be_submitted_twice(llm: LLM) -> None:
    async with llm.running() as engine:
        first = await engine.submit(engine.prepare(PROMPT, LONG), "dup")
        with pytest.raises(InvalidRequestError, match="'dup' is already in use") as caught:
            await engine.submit(engine.prepare(PROMPT, GREEDY), "dup")
        assert caught.value.param == "request_id"
        with pytest.raises(InvalidRequestError) as via_generate:
            async for _ in engine.generate(PROMPT, GREEDY, "dup"):
                pass
        assert via_generate.value.param == "request_id"
        await engine.abort("dup")
        with anyio.fail_after(60):
            result = await first.result()
        assert result.outputs[0].finish_reason == "abort"
        # Finished: the id is free again.
        with anyio.fail_after(60):
            again = await collect(engine, PROMPT, GREEDY, "dup")
        assert again.last.finished and len(again.tokens[0]) == 5


async def test_abort_ends_every_sequence_of_a_request(llm: LLM) -> None:
    async with llm.running() as engine:
        handle = await engine.submit(engine.prepare(PROMPT, SamplingParams(n=3, max_tokens=400, ignore_eos=True)),
                                     "to-abort")
        with anyio.fail_after(60):
            async with aclosing(handle.deltas()) as stream:
                await anext(stream)
                await engine.abort("to-abort")
                await engine.abort("never-submitted")  # ignored
                async for _ in stream:
                    pass
            result = handle.output
            assert result.finished and [o.finish_reason for o in result.outputs] == ["abort"] * 3
            assert all(len(o.token_ids) < 400 for o in result.outputs)
            assert engine.num_pending_requests == 0
            while engine.stats is None or engine.stats.num_running:  # the abort reaches the scheduler
                await anyio.sleep(0.01)


async def test_leaving_generate_early_aborts_the_request(llm: LLM) -> None:
    async with llm.running() as engine:
        seen = 0
        with anyio.fail_after(60):
            async with aclosing(engine.generate(PROMPT, LONG, "left")) as stream:
                async for _ in stream:
                    seen += 1
                    if seen == 2:
                        break
            # Pending (its id in use) until the engine core's abort comes back.
            while "left" in engine.cores[0].manager or engine.stats is None or engine.stats.num_running:
                await anyio.sleep(0.01)
            assert engine.num_pending_requests == 0
        assert llm.engine_core.scheduler.num_unfinished == 0


@pytest.mark.parametrize("yields_before_cancel", [0, 1, 2, 3])
async def test_a_caller_cancelled_while_it_submits_leaves_nothing_pending(llm: LLM, yields_before_cancel: int) -> None:
    """A client gone while its request was being submitted (a handler cancelled at any point)."""
    async with llm.running() as engine:

        async def consume() -> None:
            async for _ in engine.generate(PROMPT, LONG):
                pass

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(consume)
                for _ in range(yields_before_cancel):
                    await anyio.lowlevel.checkpoint()
                group.cancel_scope.cancel()
            while engine.num_pending_requests or engine.stats is None or engine.stats.num_running:
                await anyio.sleep(0.01)
        assert engine.cores[0].stalled_for(float("inf")) == 0.0  # nothing for the watchdog to see
    assert llm.engine_core.scheduler.num_unfinished == 0


async def test_a_failing_worker_fails_pending_requests_and_kills_the_engine(
        make_tiny_model: Callable[..., Path]) -> None:
    broken = LLM(model=str(make_tiny_model("llama")), dtype="float32")

    def explode(*_: object) -> None:
        raise RuntimeError("simulated device failure")

    broken.engine_core.worker.execute_model = explode  # type: ignore[method-assign]
    deaths: list[str] = []
    errors: list[BaseException] = []
    try:
        async with broken.running(on_dead=deaths.append) as engine:

            async def doomed(request_id: str) -> None:
                try:
                    await collect(engine, PROMPT, GREEDY, request_id)
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(60):  # a hang guard only
                async with anyio.create_task_group() as group:
                    for request_id in ("a", "a#0", "b/c"):
                        group.start_soon(doomed, request_id)
            assert len(errors) == 3 and all("simulated device failure" in str(e) for e in errors)
            assert not engine.is_healthy and engine.dead is not None and engine.num_pending_requests == 0
            assert deaths == [engine.dead] and "simulated device failure" in engine.dead
            with pytest.raises(EngineDeadError, match="simulated device failure"):
                await engine.submit(engine.prepare(PROMPT, GREEDY))
        assert broken.dead is not None and "simulated device failure" in broken.dead
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async with broken.running():
                pass
    finally:
        broken.shutdown()
