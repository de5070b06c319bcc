"""``EngineCore``: what ``build`` assembles on a tiny model, the actors it makes, and its failure modes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import cadence.core.engine_core as engine_core_module
from cadence.core.engine_core import EngineCore
from cadence.core.scheduler_actor import SchedulerActor
from cadence.engine_args import EngineArgs
from cadence.executor.actor import ExecutorActor
from cadence.executor.base import UniExecutor
from cadence.messages import EngineCoreOutputs, EngineCoreRequest
from cadence.policies.loader import installed_policies
from cadence.request import Request
from cadence.runtime.actor import run_actors
from cadence.sampling_params import SamplingParams

NUM_KV_BLOCKS = 32


def tiny_config(make_tiny_model: Callable[..., Path], **overrides: Any) -> Any:
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                      num_threads=1, **overrides).create_config()


@pytest.fixture(scope="module")
def core(make_tiny_model: Callable[..., Path]) -> Iterator[EngineCore]:
    built = EngineCore.build(tiny_config(make_tiny_model))
    yield built
    built.shutdown()


class Collect:
    """The outputs channel: closes the scheduler actor once every expected request finished."""

    def __init__(self, expected: set[str]) -> None:
        self.expected = set(expected)
        self.batches: list[EngineCoreOutputs] = []
        self.scheduler: SchedulerActor | None = None

    async def send(self, batch: EngineCoreOutputs) -> None:
        self.batches.append(batch)
        self.expected -= {o.request_id for o in batch.outputs if o.finish_reason is not None}
        if not self.expected and self.scheduler is not None:
            self.scheduler.close()

    def close(self) -> None:
        pass

    def tokens(self, request_id: str) -> list[int]:
        return [t for b in self.batches for o in b.outputs if o.request_id == request_id for t in o.new_token_ids]


def generate(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> Collect:
    """One run of a fresh actor pair until every prompt finished."""
    collect = Collect(set(prompts))
    scheduler, executor = core.actors(collect)
    collect.scheduler = scheduler
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        scheduler.send_nowait(EngineCoreRequest(request_id, prompt, params, eos_token_id=0, arrival_time=time.time()))
    crashes: list[str] = []

    async def main() -> None:
        with anyio.fail_after(120):
            await run_actors([scheduler, executor], crashes.append)

    anyio.run(main)
    assert crashes == []
    return collect


def test_build_sizes_the_allocator_from_the_executor(core: EngineCore) -> None:
    assert core.executor.num_blocks == NUM_KV_BLOCKS
    assert core.allocator.num_blocks == core.executor.num_blocks
    assert core.allocator.block_size == core.config.cache.block_size
    assert core.allocator.enable_prefix_caching == core.config.cache.enable_prefix_caching
    assert core.scheduler.allocator is core.allocator
    assert core.scheduler.config == core.config.scheduler
    assert core.scheduler.policy.name == "fcfs"
    assert core.hf_config.num_hidden_layers == 2


def test_worker_is_the_uni_executors_worker(core: EngineCore) -> None:
    assert isinstance(core.executor, UniExecutor)
    assert core.worker is core.executor.worker
    assert core.worker.num_blocks == NUM_KV_BLOCKS


def test_worker_of_an_executor_in_other_processes_is_refused(core: EngineCore) -> None:
    class Remote:
        num_blocks = NUM_KV_BLOCKS

    elsewhere = EngineCore(core.config, core.hf_config, Remote(), core.allocator, core.scheduler)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="only the uni executor has an in-process worker"):
        _ = elsewhere.worker


def test_actors_are_a_fresh_connected_pair_each_call(core: EngineCore) -> None:
    outputs_to = Collect(set())
    first = core.actors(outputs_to)
    second = core.actors(outputs_to)
    for scheduler, executor in (first, second):
        assert isinstance(scheduler, SchedulerActor) and isinstance(executor, ExecutorActor)
        assert scheduler.executor is executor and executor.reply_to is scheduler
        assert scheduler.outputs_to is outputs_to
        assert scheduler.scheduler is core.scheduler and executor.executor is core.executor
        assert scheduler.timing is core.timing
        assert scheduler.max_model_len == core.config.model.max_model_len
    assert first[0] is not second[0] and first[1] is not second[1]
    assert first[0].inbox is not second[0].inbox


def test_each_run_gets_fresh_actors_over_the_same_core(core: EngineCore) -> None:
    prompt = [5, 6, 7, 8, 9]
    first = generate(core, {"a": prompt, "b": [10, 11, 12]}, max_tokens=4)
    # The first run's actors are finished (their inboxes closed); new ones serve the same scheduler.
    second = generate(core, {"c": prompt}, max_tokens=4)
    assert len(first.tokens("a")) == 4 and len(first.tokens("b")) == 4
    assert second.tokens("c") == first.tokens("a")  # greedy, same prompt
    assert core.scheduler.requests == {}
    assert core.allocator.num_free_blocks == NUM_KV_BLOCKS - 1


def test_abort_all_empties_the_scheduler(core: EngineCore) -> None:
    scheduler = core.scheduler
    for i in range(3):
        scheduler.add_request(Request(f"abort-{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=4), 0, 0.0,
                                      core.config.model.max_model_len))
    assert scheduler.num_unfinished == 3
    core.abort_all()
    assert scheduler.requests == {} and scheduler.running == [] and not scheduler.waiting
    assert scheduler.num_unfinished == 0
    assert core.allocator.num_free_blocks == NUM_KV_BLOCKS - 1
    core.abort_all()  # nothing left: a no-op


def test_a_bad_policy_name_fails_before_the_model_loads(make_tiny_model: Callable[..., Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(make_tiny_model, policy="no-such-policy")

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded before the policy was checked")

    monkeypatch.setattr(engine_core_module, "load_hf_config", must_not_run)
    monkeypatch.setattr(engine_core_module, "create_executor", must_not_run)
    with pytest.raises(ValueError, match="unknown scheduling policy 'no-such-policy'; installed policies: ") as info:
        EngineCore.build(config)
    assert all(name in str(info.value) for name in installed_policies())
    assert "fcfs" in installed_policies()


def test_a_bad_policy_option_fails_before_the_model_loads(make_tiny_model: Callable[..., Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(make_tiny_model, policy="sjf", policy_options={"nope": "1"})
    monkeypatch.setattr(engine_core_module, "create_executor", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ValueError, match=r"policy 'sjf' does not take option\(s\) \['nope'\]"):
        EngineCore.build(config)
