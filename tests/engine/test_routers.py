"""The router plugins: each built-in's choice from loads (and, for prefix-aware, cached prefixes:
tests/engine/test_data_parallel.py), found by name in the ``cadence.routers`` group; an unknown name
fails before any engine core starts."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.engine.async_engine import AsyncEngine
from cadence.engine.routers.base import Router, RouterContext, installed_routers, load_router
from cadence.engine.routers.load_based import LeastLoadedRouter, PowerOfTwoRouter, RoundRobinRouter
from cadence.engine_args import EngineArgs

PROMPT = [5, 6, 7]


def context(num_engines: int = 3, seed: int = 0) -> RouterContext:
    return RouterContext(num_engines, block_size=4, prefix_caching=True, seed=seed)


def test_the_builtins_are_installed_by_name() -> None:
    assert installed_routers() == ["least-loaded", "power-of-two", "prefix-aware", "round-robin"]
    for name in installed_routers():
        router = load_router(name, context())
        assert isinstance(router, Router) and router.name == name
    assert load_router("prefix-aware", context()).observes_prefix_caches
    assert not load_router("least-loaded", context()).observes_prefix_caches
    with pytest.raises(ValueError, match="unknown router 'nearest'; installed routers: least-loaded, "):
        load_router("nearest", context())
    with pytest.raises(ValueError, match="num_engines must be at least 1"):
        context(num_engines=0)
    with pytest.raises(ValueError, match="hash algorithm must be one of sha256, xxhash, got 'md5'"):
        RouterContext(2, block_size=4, prefix_caching=True, hash_algo="md5")


def test_round_robin_ignores_loads_and_least_loaded_takes_the_lowest_rank_among_equals() -> None:
    round_robin = RoundRobinRouter(context())
    assert [round_robin.choose([9, 0, 0], PROMPT) for _ in range(5)] == [0, 1, 2, 0, 1]
    least = LeastLoadedRouter(context())
    assert [least.choose(loads, PROMPT) for loads in ([3, 1, 2], [2, 1, 1], [0, 0, 0])] == [1, 1, 0]


def test_power_of_two_takes_the_less_loaded_of_two_seeded_draws() -> None:
    router = PowerOfTwoRouter(context(num_engines=4, seed=1))
    loads = [5, 0, 5, 5]
    picks = [router.choose(loads, PROMPT) for _ in range(400)]
    # Engine 1 wins whenever it is drawn (3 of the 6 pairs); the others split the rest.
    assert Counter(picks)[1] == pytest.approx(200, abs=40)
    again = PowerOfTwoRouter(context(num_engines=4, seed=1))
    assert picks == [again.choose(loads, PROMPT) for _ in range(400)]  # seeded
    assert PowerOfTwoRouter(context(num_engines=1)).choose([3], PROMPT) == 0
    equal = PowerOfTwoRouter(context(num_engines=2))
    assert {equal.choose([1, 1], PROMPT) for _ in range(20)} == {0}  # a tie goes to the lower rank


def test_an_unknown_router_fails_before_any_engine_core_starts(make_tiny_model: Callable[..., Path]) -> None:
    config = EngineArgs(model=str(make_tiny_model("llama")), data_parallel_size=2, router="nearest").create_config()

    async def launch() -> None:
        async with AsyncEngine.launch(config, startup_timeout_s=5):
            pass

    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        asyncio.run(launch())
