"""build_front_end wires one engine core's client to a fresh request manager and detokenizer. Here
the client is a fake whose engine core is a small actor that answers each request with the tokens
of a fixed text, so the whole front end runs in a few milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from support.tiny_models import build_tiny_tokenizer

from cadence.core.block_hash import hash_block
from cadence.engine.admission import ModelLimits, PreparedRequest
from cadence.engine.core_client import EngineCoreClient
from cadence.engine.detokenizer_actor import DetokenizerActor
from cadence.engine.front_end import CoreFrontEnd, build_front_end
from cadence.engine.request_manager import RequestManager
from cadence.engine.routers.base import RouterContext
from cadence.engine.routers.prefix_aware import PrefixAwareRouter
from cadence.errors import EngineDeadError
from cadence.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVCacheDelta,
    SchedulerStats,
)
from cadence.runtime.actor import UNBOUNDED, Actor, Mailbox, run_actors
from cadence.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

TEXT = "Hello world! How are you today?"
TOKENS = [276, 295, 223, 306, 294, 3, 223, 277, 89, 223, 261, 71, 223, 308, 223, 303, 33]
LIMITS = ModelLimits(max_model_len=64, vocab_size=320, kv_capacity_tokens=1024, eos_token_id=0)
BLOCK = 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


class FakeEngineCore(Actor[EngineCoreInput]):
    """Answers each request with ``max_tokens`` tokens of TEXT, one output batch per token; each
    batch reports stats (``waiting`` requests queued) and, optionally, a prefix-cache delta that
    stores the request's first prompt block."""

    inbox_size = UNBOUNDED

    def __init__(self, outputs_to: Mailbox[EngineCoreOutputs], *, waiting: int = 0, kv_deltas: bool = False) -> None:
        super().__init__()
        self.outputs_to = outputs_to
        self.waiting = waiting
        self.kv_deltas = kv_deltas
        self.requests: list[EngineCoreRequest] = []
        self.aborts: list[AbortRequests] = []

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                if isinstance(message, AbortRequests):
                    self.aborts.append(message)
                    continue
                self.requests.append(message)
                count = message.sampling_params.max_tokens or 1
                delta = KVCacheDelta([hash_block(None, message.prompt_token_ids[:BLOCK])], []) \
                    if self.kv_deltas else None
                for i in range(count):
                    output = EngineCoreOutput(message.request_id, [TOKENS[i % len(TOKENS)]],
                                              finish_reason="length" if i == count - 1 else None)
                    stats = SchedulerStats(1, self.waiting, 0.5, 10, 20, 0, 0, 0, num_steps=len(self.requests))
                    await self.outputs_to.send(EngineCoreOutputs([output], float(i), stats=stats,
                                                                 kv_delta=delta if i == 0 else None))


class FakeClient(EngineCoreClient):
    def __init__(self, rank: int = 0, **core_options: Any) -> None:
        self.rank = rank
        self.num_blocks = 65
        self.core_options = core_options
        self.core: FakeEngineCore | None = None
        self.on_dead: Callable[[str], None] | None = None

    def connect(self, outputs_to: Mailbox[EngineCoreOutputs], on_dead: Callable[[str], None]
                ) -> tuple[Mailbox[EngineCoreInput], list[Actor[Any]]]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.on_dead = on_dead
        self.core = FakeEngineCore(outputs_to, **self.core_options)
        return self.core, [self.core]

    def shutdown(self) -> None:
        pass


async def run_front_end(front: CoreFrontEnd, body: Callable[[], Any]) -> None:
    """Run the front end's actors while ``body`` runs, then stop them."""
    crashes: list[str] = []
    with anyio.fail_after(30):  # a hang guard only
        async with anyio.create_task_group() as group:
            started = anyio.Event()
            group.start_soon(run_actors, front.actors, crashes.append, started)
            await started.wait()
            await body()
            group.cancel_scope.cancel()
    assert crashes == []


def request(max_tokens: int, n: int = 1, prompt: list[int] | None = None, **kwargs: Any) -> PreparedRequest:
    return PreparedRequest(prompt or [5, 6, 7, 8, 9], SamplingParams(n=n, max_tokens=max_tokens, **kwargs))


def test_the_graph(tokenizer: Any) -> None:
    client = FakeClient(rank=3)
    deaths: list[str] = []
    front = build_front_end(client, tokenizer, LIMITS, deaths.append)
    assert isinstance(front.manager, RequestManager) and isinstance(front.detokenizer, DetokenizerActor)
    assert front.actors == (front.detokenizer, front.manager, client.core)
    assert front.client is client and front.rank == 3
    assert front.manager.engine_core is client.core and front.manager.detokenizer is front.detokenizer
    assert front.detokenizer.engine_core is client.core and front.detokenizer.outputs_to is front.manager
    assert client.core is not None and client.core.outputs_to is front.detokenizer  # no router: no tap
    assert front.manager.limits is LIMITS and front.detokenizer.tokenizer is tokenizer
    assert client.on_dead is not None
    client.on_dead("gone")
    assert deaths == ["gone"]


def test_a_dead_engine_core_gets_no_front_end(tokenizer: Any) -> None:
    client = FakeClient()
    client.dead = "engine core process exited with code 1"
    with pytest.raises(EngineDeadError, match="exited with code 1"):
        build_front_end(client, tokenizer, LIMITS, lambda error: None)


async def test_requests_round_trip_through_the_front_end(tokenizer: Any) -> None:
    front = build_front_end(FakeClient(), tokenizer, LIMITS, lambda error: None)
    results: dict[str, Any] = {}

    async def body() -> None:
        assert front.stats is None and front.num_pending == 0 and front.load == 0
        handles = [front.manager.add_request(request_id, request(len(TOKENS), n=2))
                   for request_id in ("a#0", "a")]
        for handle in handles:
            results[handle.request_id] = await handle.result()

    await run_front_end(front, body)
    for result in results.values():
        assert [o.text for o in result.outputs] == [TEXT, TEXT] and result.finished
        assert all(o.token_ids == TOKENS and o.finish_reason == "length" for o in result.outputs)
    assert front.stats is not None and front.stats.num_steps == 4  # the latest batch's
    assert front.num_pending == 0


async def test_a_stop_string_aborts_in_the_engine_core(tokenizer: Any) -> None:
    client = FakeClient()
    front = build_front_end(client, tokenizer, LIMITS, lambda error: None)

    async def body() -> None:
        handle = front.manager.add_request("r", request(len(TOKENS), stop=["How"]))
        result = await handle.result()
        assert result.outputs[0].text == "Hello world! " and result.outputs[0].stop_reason == "How"

    await run_front_end(front, body)
    assert client.core is not None
    assert client.core.aborts == [AbortRequests([client.core.requests[0].request_id])]


async def test_load_counts_pending_and_queued_requests(tokenizer: Any) -> None:
    front = build_front_end(FakeClient(waiting=5), tokenizer, LIMITS, lambda error: None)

    async def body() -> None:
        assert front.load == 0  # nothing pending, no stats yet
        await front.manager.add_request("r0", request(1)).result()
        assert front.num_pending == 0 and front.load == 5  # the engine core's stats: 5 queued
        handles = [front.manager.add_request(f"r{i}", request(1)) for i in (1, 2)]
        assert front.num_pending == 2 and front.load == 2 + 5  # submitted, not answered yet
        for handle in handles:
            await handle.result()
        assert front.num_pending == 0 and front.load == 5

    await run_front_end(front, body)


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_the_router_sees_the_prefix_cache_before_the_caller_sees_the_output(
        tokenizer: Any, prefix_caching: bool) -> None:
    router = PrefixAwareRouter(RouterContext(2, BLOCK, prefix_caching=prefix_caching))
    prompt = [5, 6, 7, 8, 9, 10]
    front = build_front_end(FakeClient(rank=1, kv_deltas=True), tokenizer, LIMITS, lambda error: None, router)

    async def body() -> None:
        assert router.matched_blocks(prompt) == [0, 0]
        handle = front.manager.add_request("r", request(3, prompt=prompt))
        async for _ in handle.deltas():
            # Already by the first output: the step that cached the block has been taken in.
            assert router.matched_blocks(prompt) == ([0, 1] if prefix_caching else [0, 0])
        assert handle.output.outputs[0].text == "Hello "

    await run_front_end(front, body)
