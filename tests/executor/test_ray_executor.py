"""The Ray executor on a local Ray instance (2 CPUs, one actor per rank): the same tokens as the mp
executor, and a rank whose actor dies, mid-generation or while the engine is idle, fails the
request and the engine."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

from cadence import LLM, SamplingParams
from cadence.errors import EngineDeadError
from cadence.executor.ray_executor import RayExecutor

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 100))]
# A hang guard only: generation here takes a few seconds.
HANG_GUARD_S = 300


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One local Ray instance for the module: no dashboard, no usage report, nothing off this machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.delenv("RAY_ADDRESS", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny(make_tiny_model: Callable[..., Path]) -> str:
    return str(make_tiny_model("llama", num_key_value_heads=1))


def tp2(model: str, backend: str) -> LLM:
    return LLM(model=model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend=backend,
               num_kv_blocks=64)


def generate(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [greedy, greedy, seeded], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_ray_executor_picks_the_mp_executors_tokens(tiny: str) -> None:
    mp = tp2(tiny, "mp")
    try:
        expected = generate(mp)
    finally:
        mp.shutdown()
    on_ray = tp2(tiny, "ray")
    try:
        assert isinstance(on_ray.engine_core.executor, RayExecutor)
        assert generate(on_ray) == expected
        assert on_ray.engine_core.allocator.num_blocks == 64
    finally:
        on_ray.shutdown()


def actor_pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())))


def test_a_dead_ray_actor_fails_the_request_and_the_engine(tiny: str, kill_mid_generation) -> None:
    llm = tp2(tiny, "ray")
    executor = llm.engine_core.executor
    assert isinstance(executor, RayExecutor)
    try:
        error = kill_mid_generation(llm, actor_pid(executor.actors[1]))
        assert isinstance(error, EngineDeadError)
        assert "worker rank" in str(error)
        assert llm.dead is not None
    finally:
        llm.shutdown()


def test_an_actor_that_dies_while_the_engine_is_idle_fails_the_engine(tiny: str) -> None:
    llm = tp2(tiny, "ray")
    executor = llm.engine_core.executor
    assert isinstance(executor, RayExecutor)
    deaths: list[str] = []

    async def run() -> None:
        async with llm.running(on_dead=deaths.append):
            ray.kill(executor.actors[1])  # nothing runs
            with anyio.fail_after(HANG_GUARD_S):  # a hang guard only: the watch pings every second
                while not deaths:
                    await anyio.sleep(0.05)

    try:
        anyio.run(run)
        assert len(deaths) == 1 and "worker rank 1" in deaths[0]
        assert llm.dead == deaths[0]
    finally:
        llm.shutdown()
