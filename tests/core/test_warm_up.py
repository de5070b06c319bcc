"""The warm-up before ready: which steps it runs through the workers, and that it leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cadence.core.engine_core as engine_core_module
from cadence.core.engine_core import EngineCore
from cadence.core.warm_up import WarmUpStep, warm_up
from cadence.engine_args import EngineArgs
from cadence.executor.base import UniExecutor
from cadence.models.kv_groups import kv_cache_groups_of


def _config(make_tiny_model: Callable[..., Path], **overrides: Any) -> Any:
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_threads=1,
                      **overrides).create_config()


@pytest.fixture(scope="module")
def targeted_core(make_tiny_model: Callable[..., Path]) -> Any:
    core = EngineCore.build(_config(make_tiny_model, max_num_batched_tokens=512, target_itl_ms=100.0, num_kv_blocks=64))
    yield core
    core.shutdown()


def test_the_warm_up_runs_a_long_prefill_alone_a_mixed_step_and_decodes(targeted_core: EngineCore) -> None:
    config = targeted_core.config
    groups = kv_cache_groups_of(targeted_core.hf_config, config.cache.hybrid_kv_cache)
    steps = warm_up(targeted_core.executor, config, targeted_core.hf_config, groups.windows)
    long = config.model.max_model_len - 2  # the tiny model's context (512) is the limit here
    # The long prompt alone; then its decode beside the short prompts (as much of them as the
    # latency target lets in), then decodes only, with the sampling paths the short ones take.
    assert steps[0] == WarmUpStep(prefills=1, decodes=0, num_tokens=long)
    assert steps[1].prefills >= 1 and steps[1].decodes == 1
    assert steps[-1].prefills == 0 and steps[-1].decodes > 1
    assert sum(s.num_tokens for s in steps) == long + 1 + 4 * (16 + 1)


def test_under_the_default_budget_the_long_prompt_is_512_tokens_and_alone(
        make_tiny_model: Callable[..., Path]) -> None:
    """The 2,048-token default budget: a longer warm-up prefill cost seconds on a slow CPU and spared
    the first burst nothing; the short prompts still come beside the long one's decode, not in its step."""
    folder = make_tiny_model("llama", max_position_embeddings=4096)
    core = EngineCore.build(EngineArgs(model=str(folder), dtype="float32", num_threads=1,
                                       num_kv_blocks=64).create_config())
    try:
        groups = kv_cache_groups_of(core.hf_config, core.config.cache.hybrid_kv_cache)
        steps = warm_up(core.executor, core.config, core.hf_config, groups.windows)
        assert steps[:2] == [WarmUpStep(prefills=1, decodes=0, num_tokens=512),
                             WarmUpStep(prefills=4, decodes=1, num_tokens=1 + 4 * 16)]
        assert steps[2:] == [WarmUpStep(prefills=0, decodes=4, num_tokens=4)]  # the long one done
    finally:
        core.shutdown()


def test_the_warm_up_leaves_the_workers_and_the_engine_as_it_found_them(targeted_core: EngineCore) -> None:
    assert isinstance(targeted_core.executor, UniExecutor)
    assert targeted_core.executor.worker.runner.states == {}
    scheduler = targeted_core.scheduler
    assert not scheduler.requests and not scheduler.has_work and scheduler.num_preemptions == 0
    assert scheduler.allocator.num_free_blocks == targeted_core.executor.num_blocks - 1
    assert targeted_core.scheduler.allocator.prefix_cache_queries == 0
    if scheduler.step_budget is not None:
        assert scheduler.step_budget.model.metadata.get("source") != "refitted while running"


def test_a_cache_too_small_for_the_short_prompts_warms_up_with_the_long_one(
        make_tiny_model: Callable[..., Path]) -> None:
    config = _config(make_tiny_model, target_itl_ms=100.0, num_kv_blocks=4)
    core = EngineCore.build(config)
    try:
        groups = kv_cache_groups_of(core.hf_config, config.cache.hybrid_kv_cache)
        steps = warm_up(core.executor, config, core.hf_config, groups.windows)
        # 3 usable blocks of 16 tokens: no room for two short prompts' blocks, so the long one alone.
        assert steps == [WarmUpStep(prefills=1, decodes=0, num_tokens=46),
                         WarmUpStep(prefills=0, decodes=1, num_tokens=1)]
        assert core.executor.worker.runner.states == {}
    finally:
        core.shutdown()


def test_build_warms_up_before_it_returns(make_tiny_model: Callable[..., Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(engine_core_module, "warm_up", lambda executor, *_: calls.append(executor.num_blocks))
    core = EngineCore.build(_config(make_tiny_model, num_kv_blocks=16))
    core.shutdown()
    assert calls == [16]
