"""Data parallelism: the router's choices, its view of each engine's prefix cache (from the KV
events), and two engine cores behind one server: load, correctness, metrics and one core's death."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from support.processes import engine_core_pids

from cadence import SamplingParams
from cadence.api.testing import ServerProcess
from cadence.config import HASH_ALGOS
from cadence.core.block_hash import hash_block
from cadence.core.kv_allocator import KVAllocator
from cadence.core.kv_events import fold_kv_events
from cadence.core.testing import FakeRequest
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.llm import LLM
from cadence.engine.routers.base import RouterContext
from cadence.engine.routers.prefix_aware import PrefixAwareRouter
from cadence.engine_args import EngineArgs
from cadence.messages import KVCacheDelta

BS = 4  # small blocks: short prompts still fill some


def block_hashes(token_ids: list[int], num_blocks: int) -> list[int]:
    hashes: list[int] = []
    for i in range(num_blocks):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * BS:(i + 1) * BS]))
    return hashes


def router(num_engines: int = 2, **options: Any) -> PrefixAwareRouter:
    return PrefixAwareRouter(RouterContext(num_engines, BS, prefix_caching=True), **options)


PROMPT = list(range(10, 30))  # 5 full blocks


# ---- routing ---------------------------------------------------------------------------------


def test_least_loaded_wins_and_ties_go_to_the_lowest_rank() -> None:
    r = PrefixAwareRouter(RouterContext(3, BS, prefix_caching=False))
    assert r.choose([3, 1, 2], PROMPT) == 1
    assert r.choose([2, 1, 1], PROMPT) == 1
    assert r.choose([0, 0, 0], PROMPT) == 0


def test_a_prompt_nobody_cached_goes_to_the_least_loaded() -> None:
    r = router()
    r.apply(0, KVCacheDelta(stored=block_hashes(PROMPT, 5), removed=[]))
    assert r.choose([3, 1], list(range(100, 120))) == 1


def test_the_engine_holding_the_longest_prefix_wins_within_the_slack() -> None:
    r = router(3, slack=4)
    r.apply(1, KVCacheDelta(stored=block_hashes(PROMPT, 2), removed=[]))
    r.apply(2, KVCacheDelta(stored=block_hashes(PROMPT, 4), removed=[]))
    assert r.matched_blocks([*PROMPT, 1, 2]) == [0, 2, 4]
    assert r.choose([0, 0, 0], [*PROMPT, 1, 2]) == 2
    assert r.choose([0, 1, 4], [*PROMPT, 1, 2]) == 2  # 4 busier than the least: within the slack
    assert r.choose([0, 1, 5], [*PROMPT, 1, 2]) == 1  # past it: the next longest prefix within it
    assert r.choose([0, 5, 5], [*PROMPT, 1, 2]) == 0  # past it for both: least loaded


def test_the_slack_grows_with_the_load() -> None:
    r = router(slack=4, slack_ratio=0.25)
    r.apply(1, KVCacheDelta(stored=block_hashes(PROMPT, 5), removed=[]))
    assert r.choose([40, 50], PROMPT) == 1  # 40 + 40 / 4
    assert r.choose([40, 51], PROMPT) == 0


def test_a_sticky_prefix_cannot_overload_one_engine() -> None:
    """Every request shares one prefix cached on engine 0; the loads never drift past the slack."""
    r = router(slack=4, slack_ratio=0.0)
    r.apply(0, KVCacheDelta(stored=block_hashes(PROMPT, 5), removed=[]))
    loads = [0, 0]
    for _ in range(200):
        loads[r.choose(loads, PROMPT)] += 1
        assert loads[0] - loads[1] <= 4 + 1
    assert min(loads) > 0


def test_the_last_prompt_token_is_never_counted_as_cached() -> None:
    r = router()
    r.apply(0, KVCacheDelta(stored=block_hashes(PROMPT, 5), removed=[]))
    assert r.matched_blocks(PROMPT) == [4, 0]  # 20 tokens: the fifth block holds the last one
    assert r.matched_blocks([*PROMPT, 7]) == [5, 0]


def test_removed_and_cleared_blocks_stop_attracting() -> None:
    r = router()
    hashes = block_hashes(PROMPT, 5)
    r.apply(0, KVCacheDelta(stored=hashes, removed=[]))
    r.apply(0, KVCacheDelta(stored=[], removed=hashes[2:3]))
    assert r.matched_blocks([*PROMPT, 7]) == [2, 0]  # a hole ends the usable prefix
    r.apply(0, KVCacheDelta(stored=hashes[:1], removed=[], cleared=True))
    assert r.matched_blocks([*PROMPT, 7]) == [1, 0]


SALTS = [None, "lora:1:a"]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_the_router_sees_what_the_allocator_caches(algo: str) -> None:
    """Random admissions, frees and evictions on a small pool, some under a LoRA adapter's salt, the
    events folded into deltas at random points: the router's prefix match always equals the
    allocator's own lookup, salted or not, under either key (the router's context names the engines')."""
    rng = random.Random(0)
    alloc = KVAllocator(num_blocks=12, block_size=BS, enable_kv_events=True, hash_algo=algo)
    r = PrefixAwareRouter(RouterContext(1, BS, prefix_caching=True, hash_algo=algo))
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    prompts = [stem + [rng.randrange(50) for _ in range(rng.randrange(1, 10))] for stem in stems for _ in range(3)]
    live: list[str] = []
    for step in range(300):
        if live and (rng.random() < 0.4 or len(live) > 2):
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            request = FakeRequest(f"r{step}", prompts[rng.randrange(len(prompts))], cache_salt=rng.choice(SALTS))
            hit_ids, num_hit = alloc.get_computed_blocks(request)
            if alloc.allocate(request, request.num_tokens - num_hit, hit_ids, num_hit) is None:
                alloc.free(request.request_id)
                continue
            request.num_computed_tokens = request.num_tokens
            live.append(request.request_id)
        if rng.random() < 0.3:
            delta = fold_kv_events(alloc.take_events())
            if delta is not None:
                r.apply(0, delta)
            for i, prompt in enumerate(prompts):
                for salt in SALTS:
                    probe = FakeRequest(f"probe{step}-{i}", prompt, cache_salt=salt)
                    assert r.matched_blocks(prompt, salt)[0] * BS == alloc.get_computed_blocks(probe)[1]
                    alloc.free(probe.request_id)


def test_an_adapter_s_prompt_follows_the_engine_that_cached_it_under_that_adapter() -> None:
    salted = []
    for i in range(5):
        salt = ("lora:1:a",) if i == 0 else ()
        salted.append(hash_block(salted[-1] if salted else None, PROMPT[i * BS:(i + 1) * BS], salt))
    r = router()
    r.apply(1, KVCacheDelta(stored=salted, removed=[]))
    assert r.choose_salted([1, 2], PROMPT, "lora:1:a") == 1
    assert r.choose_salted([1, 2], PROMPT, "lora:2:b") == 0  # another adapter's blocks: least loaded
    assert r.choose([1, 2], PROMPT) == 0  # the base model's too


def test_folding_keeps_the_net_effect_in_order() -> None:
    alloc = KVAllocator(num_blocks=4, block_size=BS, enable_kv_events=True)
    first = FakeRequest("a", list(range(8)))
    alloc.allocate(first, 8)
    first.num_computed_tokens = 8
    alloc.free("a")
    alloc.allocate(FakeRequest("b", list(range(50, 62))), 12)  # evicts both of a's blocks
    delta = fold_kv_events(alloc.take_events())
    assert delta is not None and delta.stored == block_hashes(list(range(50, 62)), 3)
    assert sorted(delta.removed) == sorted(block_hashes(list(range(8)), 2))
    assert fold_kv_events(alloc.take_events()) is None


# ---- two engine cores behind one AsyncEngine -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", max_position_embeddings=1024)


def dp_args(model: Path, **overrides: Any) -> EngineArgs:
    return EngineArgs(model=str(model), dtype="float32", num_threads=1, block_size=BS, data_parallel_size=2,
                      **overrides)


def test_in_process_data_parallelism_is_refused(tiny_model: Path) -> None:
    async def run() -> None:
        async with AsyncEngine.launch(dp_args(tiny_model).create_config(), in_process=True):
            pass

    with pytest.raises(ValueError, match="own process"):
        anyio.run(run)


def test_an_engine_core_that_cannot_start_fails_the_launch_by_name(tiny_model: Path) -> None:
    async def run() -> None:
        async with AsyncEngine.launch(dp_args(tiny_model, policy="no-such-policy").create_config()):
            pass

    with pytest.raises(RuntimeError, match=r"engine core \d of 2: engine core failed to start: .*no-such-policy"):
        anyio.run(run)


@pytest.mark.parametrize("algo", HASH_ALGOS)  # the engine cores' block keys and the router's alike
def test_a_shared_prefix_follows_its_engine_and_new_prompts_the_least_loaded(tiny_model: Path, algo: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run_to_end(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> int:
        """Run a request to its end; the prompt tokens it found cached (only its engine can have them)."""
        cached = -1
        async for delta in engine.generate(prompt, params):
            cached = delta.num_cached_tokens
        return cached

    async def run() -> None:
        async with AsyncEngine.launch(dp_args(tiny_model, prefix_caching_hash_algo=algo).create_config()) as engine:
            assert len(engine.cores) == 2
            assert await run_to_end(engine, PROMPT, greedy) == 0  # an idle tie: engine 0
            long = engine.generate(list(range(200, 210)), SamplingParams(temperature=0, max_tokens=900,
                                                                         ignore_eos=True))
            await long.__anext__()  # pending on engine 0 (tie again): loads are now [1, 0]
            # Least loaded alone would pick engine 1; the cached prefix keeps it on engine 0.
            assert await run_to_end(engine, [*PROMPT, 1, 2, 3], greedy) == 20
            assert await run_to_end(engine, list(range(300, 320)), greedy) == 0  # no prefix: engine 1
            await long.aclose()  # aborted on its own engine
            with anyio.fail_after(60):  # a hang guard only
                while engine.num_pending_requests or engine.stats is None or engine.stats.num_running:
                    await anyio.sleep(0.02)
            zero, one = (e.stats for e in engine.cores)
            assert zero is not None and one is not None
            assert zero.prefix_cache_hits == 20 and one.prefix_cache_hits == 0
            assert zero.prefix_cache_queries == 20 + 10 + 23 and one.prefix_cache_queries == 20
            total = engine.stats
            assert total.num_free_blocks == zero.num_free_blocks + one.num_free_blocks
            assert total.num_blocks == zero.num_blocks + one.num_blocks and total.kv_cache_usage == 0

    anyio.run(run)


def test_the_router_is_a_plugin_chosen_by_name(tiny_model: Path) -> None:
    """Round robin alternates between the engine cores even when both are idle (least-loaded and
    prefix-aware send every request of a sequential run to engine 0)."""
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run() -> None:
        async with AsyncEngine.launch(dp_args(tiny_model, router="round-robin").create_config()) as engine:
            for first in range(4):
                async for _ in engine.generate(list(range(100 + 10 * first, 108 + 10 * first)), greedy):
                    pass
            with anyio.fail_after(60):  # a hang guard only
                while engine.num_pending_requests or any(c.stats is None for c in engine.cores):
                    await anyio.sleep(0.02)
            assert [c.stats.prefix_cache_queries for c in engine.cores if c.stats] == [16, 16]

    anyio.run(run)


# ---- two engine cores behind one server ----------------------------------------------------------


PROMPTS = ["The capital of France is", "The capital of France is Paris. Hello world!", "Hello world!",
           "A paged KV cache stores keys", "A paged KV cache stores keys and values in fixed-size blocks.",
           "0123456789 + - * /", "How are you today?", "( ) [ ] { }"]
LENGTHS = [3, 7, 12]
NUM_REQUESTS = 100


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(model=str(tiny_model), dtype="float32", block_size=BS)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_model), "--dtype", "float32", "--block-size", str(BS), "--data-parallel-size", "2",
            "--stay-up-on-engine-death"]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as process:
        yield process


def metrics(url: str) -> dict[str, float]:
    """``name{engine="i"}`` (other labels dropped) or ``name`` -> value."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if not line.startswith("cadence:"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        engine = next((item for item in labels.rstrip("}").split(",") if item.startswith("engine=")), None)
        key = f"{name}{{{engine}}}" if engine else name
        samples[key] = samples.get(key, 0.0) + float(value)
    return samples


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.json()


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """Every event of a streamed completion, ``"[DONE]"`` included."""
    events: list[Any] = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_result(events: list[Any]) -> tuple[str, str | None, str]:
    """(text, the one finish reason, id) of a stream that ended well, checking it answered once."""
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert all("error" not in chunk for chunk in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and len({c["id"] for c in chunks}) == 1
    return "".join(c["choices"][0]["text"] for c in chunks), finishes[0], chunks[0]["id"]


def test_100_concurrent_requests_are_each_answered_once_and_correctly(server: ServerProcess, offline: LLM) -> None:
    pairs = [(p, n) for p in PROMPTS for n in LENGTHS]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in pairs]
    reference = {pair: out.outputs[0].text for pair, out in zip(
        pairs, offline.generate([p for p, _ in pairs], greedy, use_tqdm=False), strict=True)}

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, str | None, str]:
        prompt, length = pairs[i % len(pairs)]
        body = {"prompt": prompt, "max_tokens": length, "temperature": 0, "ignore_eos": True}
        if i // 2 % 2:  # both engines get both kinds (requests alternate between them in arrival order)
            return streamed_result(await stream(session, server.url, body))
        status, result = await complete(session, server.url, body)
        assert status == 200, result
        assert len(result["choices"]) == 1
        return result["choices"][0]["text"], result["choices"][0]["finish_reason"], result["id"]

    async def run() -> list[tuple[str, str | None, str]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.wait_for(asyncio.gather(*(one(session, i) for i in range(NUM_REQUESTS))), 300)

    results = asyncio.run(run())
    for i, (text, finish, _) in enumerate(results):
        assert (text, finish) == (reference[pairs[i % len(pairs)]], "length"), i
    assert len({request_id for _, _, request_id in results}) == NUM_REQUESTS
    m = metrics(server.url)
    assert m["cadence:request_success_total"] == NUM_REQUESTS  # each finished once, by the front end's count
    for rank in (0, 1):  # both engine cores served, and neither holds anything now
        assert m[f'cadence:prefix_cache_queries_total{{engine="{rank}"}}'] > 0
        assert m[f'cadence:num_requests_pending{{engine="{rank}"}}'] == 0
        assert m[f'cadence:kv_cache_num_blocks{{engine="{rank}"}}'] > 0


async def until(condition: Callable[[], bool]) -> None:
    """Poll until ``condition`` holds; the timeout is a hang guard, not a speed requirement."""
    with anyio.fail_after(120):
        while not condition():
            await anyio.sleep(0.02)


def test_killing_one_engine_core_fails_its_requests_and_the_other_finishes(server: ServerProcess,
                                                                          offline: LLM) -> None:
    """Both cores busy; both paused (SIGSTOP), so that what each holds is known exactly; one killed,
    the other resumed: exactly the killed core's requests fail, at once, and the rest finish right."""
    prompts, length, num = ["Hello world!", "The capital of France is"], 300, 12
    expected = [out.outputs[0].text for out in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True), use_tqdm=False)]
    pids = engine_core_pids(server.pid)
    assert sorted(pids) == [0, 1]

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, str | None]:
        """(text, None) when it finished, or ("", error code) when it failed."""
        # Requests alternate between the engines in arrival order: both get both prompts, streamed or not.
        body = {"prompt": prompts[i // 4 % 2], "max_tokens": length, "temperature": 0, "ignore_eos": True}
        if i // 2 % 2:
            events = await stream(session, server.url, body)
            if "[DONE]" not in events:
                assert all("error" not in e for e in events[:-1])
                return "", events[-1]["error"]["code"]
            text, _, _ = streamed_result(events)
            return text, None
        status, result = await complete(session, server.url, body)
        if status != 200:
            assert status == 503, result
            return "", result["error"]["code"]
        return result["choices"][0]["text"], None

    stopped: set[int] = set()

    def pause_each_once_running(m: dict[str, float]) -> bool:
        """SIGSTOP each core the moment it is seen running requests (waiting for both together let
        the first one finish all of its own first); True once both are paused and all admitted."""
        for rank, pid in pids.items():
            if rank not in stopped and m[f'cadence:num_requests_running{{engine="{rank}"}}'] > 0:
                os.kill(pid, signal.SIGSTOP)
                stopped.add(rank)
        return len(stopped) == 2 and sum(m[f'cadence:num_requests_pending{{engine="{r}"}}'] for r in (0, 1)) == num

    async def run() -> tuple[list[tuple[str, str | None]], dict[str, float]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            jobs = asyncio.gather(*(one(session, i) for i in range(num)))
            try:
                await until(lambda: pause_each_once_running(metrics(server.url)))
                # Outputs sent before the pause may still be on their way; then nothing changes.
                held = metrics(server.url)
                while (now := metrics(server.url)) != held:
                    held = now
                os.kill(pids[1], signal.SIGKILL)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            return await asyncio.wait_for(jobs, 120), held

    results, held = asyncio.run(run())
    on_one = held['cadence:num_requests_pending{engine="1"}']
    assert on_one > 0 and held['cadence:num_requests_pending{engine="0"}'] > 0
    failed = [code for _, code in results if code is not None]
    assert failed == ["engine_dead"] * int(on_one)
    for i, (text, code) in enumerate(results):
        assert code is not None or text == expected[i // 4 % 2], i
    assert server.health() == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    assert "engine core 1 of 2" in refused.json()["error"]["message"]
    server.signal(signal.SIGTERM)
    assert server.wait(30) == 1, server.log()
