"""Choosing and running executors: ``create_executor`` picks the in-process executor for one rank
and refuses a model that cannot be split before starting anything; ``UniExecutor`` runs every
worker call on one thread of its own; the worker sizes its KV cache, broadcasts rank 0's tokens
under tensor parallelism, and a worker process's loop runs every published step.

The mp and Ray executors themselves are covered end to end by tests/distributed/test_tensor_parallel.py and
tests/executor/test_ray_executor.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.tiny_models import tiny_config

import cadence.executor.multiproc
import cadence.executor.ray_executor
from cadence.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig
from cadence.executor import base, create_executor
from cadence.executor.base import UniExecutor
from cadence.executor.worker import BroadcastSampler, _rank_device, num_kv_blocks
from cadence.executor.worker_process import _serve
from cadence.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerFailed,
    WorkerReply,
)
from cadence.models.loader import load_hf_config
from cadence.runtime.codec import Codec
from cadence.sampling_params import SamplingParams

NUM_BLOCKS = 16
BLOCK_SIZE = 4


def engine_config(path: str = "unused", **parallel: Any) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=path, dtype="float32", max_model_len=512),
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
                        parallel=ParallelConfig(**parallel), device=DeviceConfig(device="cpu"))


def step(step_id: int, scheduled: dict[str, int], new: list[NewRequestData] | None = None,
         cached: list[CachedRequestData] | None = None) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, new_requests=new or [], cached_requests=cached or [],
                           num_scheduled_tokens=scheduled, finished_request_ids=[], preempted_request_ids=[])


# ---- create_executor ---------------------------------------------------------------------------


@pytest.fixture
def no_process_executors(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, EngineConfig]]:
    """The mp and Ray executors replaced by recorders: nothing is started."""
    started: list[tuple[str, EngineConfig]] = []

    def recorder(name: str) -> Callable[[EngineConfig], str]:
        def start(config: EngineConfig) -> str:
            started.append((name, config))
            return name
        return start

    monkeypatch.setattr(cadence.executor.multiproc, "MultiprocExecutor", recorder("mp"))
    monkeypatch.setattr(cadence.executor.ray_executor, "RayExecutor", recorder("ray"))
    return started


@pytest.mark.parametrize(("parallel", "message"), [
    ({"tensor_parallel_size": 8}, "exceeds the model's 4 attention heads"),
    ({"tensor_parallel_size": 3}, "cannot split 4 attention heads over 2 KV heads across 3 ranks"),
    ({"tensor_parallel_size": 8, "distributed_executor_backend": "ray"}, "exceeds the model's 4 attention heads"),
])
def test_a_model_that_cannot_be_split_is_refused_before_anything_starts(
        no_process_executors: list[tuple[str, EngineConfig]], parallel: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_executor(engine_config(**parallel), tiny_config("llama"))
    assert no_process_executors == []


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_several_ranks_go_to_the_chosen_process_executor(no_process_executors: list[tuple[str, EngineConfig]],
                                                        backend: str) -> None:
    config = engine_config(tensor_parallel_size=2, distributed_executor_backend=backend)
    assert create_executor(config, tiny_config("llama")) == backend
    assert no_process_executors == [(backend, config)]


def test_one_rank_runs_in_process_with_the_kv_cache_allocated(make_tiny_model,
                                                              no_process_executors: list[tuple[str, EngineConfig]]
                                                              ) -> None:
    folder = str(make_tiny_model("llama"))
    executor = create_executor(engine_config(folder), load_hf_config(folder))
    try:
        assert isinstance(executor, UniExecutor)
        assert executor.num_blocks == executor.worker.num_blocks == NUM_BLOCKS
        assert executor.kernel_row_limit is None  # float weights: no quantized kernel, no row limit
        runner = executor.worker.runner
        assert runner.block_size == BLOCK_SIZE and runner.states == {}
        shape = type(runner.backend).kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, 2, 16)  # 2 KV heads of 16
        assert len(runner.kv_caches) == 2  # one (K, V) pair per layer
        for k, v in runner.kv_caches:
            assert k.shape == v.shape == shape and k.dtype == torch.float32
            assert not k.any() and not v.any()  # zeroed, not empty
    finally:
        executor.shutdown()
    assert no_process_executors == []


def test_a_chunked_prefill_on_the_real_model_picks_the_whole_prefills_tokens(make_tiny_model) -> None:
    """Two copies of one prompt, one prefilled whole and one in two chunks over the paged cache,
    then decoded side by side: the same tokens and logprobs."""
    folder = str(make_tiny_model("llama"))
    executor = create_executor(engine_config(folder), load_hf_config(folder))
    prompt = [5, 9, 60, 17, 3, 8, 100]
    params = SamplingParams(temperature=0.0, logprobs=3)

    def request(request_id: str, blocks: list[int]) -> NewRequestData:
        return NewRequestData(request_id, prompt, len(prompt), params, None, [blocks], 0)

    try:
        whole = executor.execute_model(step(1, {"w": 7, "c": 4}, [request("w", [1, 2]), request("c", [3])]))
        assert whole.request_ids == ["w"]
        chunked = executor.execute_model(step(2, {"c": 3}, cached=[CachedRequestData("c", [[4]], 4)]))
        assert chunked.request_ids == ["c"]
        assert chunked.sampled_token_ids == whole.sampled_token_ids
        assert whole.logprobs is not None and chunked.logprobs is not None
        assert chunked.logprobs[0].token_ids == whole.logprobs[0].token_ids
        torch.testing.assert_close(chunked.logprobs[0].logprobs, whole.logprobs[0].logprobs, atol=1e-5, rtol=0)

        decode = executor.execute_model(step(3, {"w": 1, "c": 1},
                                             cached=[CachedRequestData("w", [[]], 7), CachedRequestData("c", [[]], 7)]))
        assert decode.request_ids == ["w", "c"]
        assert decode.sampled_token_ids[0] == decode.sampled_token_ids[1]
        assert decode.logprobs is not None
        torch.testing.assert_close(decode.logprobs[0].logprobs, decode.logprobs[1].logprobs, atol=1e-5, rtol=0)
    finally:
        executor.shutdown()


# ---- UniExecutor -------------------------------------------------------------------------------


class FakeWorker:
    """Records the thread of every call instead of loading a model."""

    def __init__(self, config: EngineConfig, hf_config: Any, local_rank: int = 0) -> None:
        self.local_rank = local_rank
        self.num_blocks = 7
        self.kernel_row_limit = 5
        self.threads = [threading.current_thread().name]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.threads.append(threading.current_thread().name)
        return ModelRunnerOutput(scheduler_output.step_id, ["a"], [42])


@pytest.fixture
def uni(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., UniExecutor]]:
    monkeypatch.setattr(base, "Worker", FakeWorker)
    made: list[UniExecutor] = []

    def make(**parallel: Any) -> UniExecutor:
        made.append(UniExecutor(engine_config(**parallel), tiny_config("llama")))
        return made[-1]

    yield make
    for executor in made:
        executor.shutdown()


def test_uni_executor_loads_and_steps_on_one_thread_of_its_own(uni: Callable[..., UniExecutor]) -> None:
    executor = uni()
    worker = executor.worker
    assert isinstance(worker, FakeWorker)
    assert (executor.num_blocks, executor.kernel_row_limit) == (7, 5)  # the worker's
    for i in range(3):
        assert executor.execute_model(step(i, {"a": 1})) == ModelRunnerOutput(i, ["a"], [42])
    assert len(worker.threads) == 4
    assert len(set(worker.threads)) == 1  # loading and every step: the same thread
    assert worker.threads[0].startswith("cadence-model")
    assert worker.threads[0] != threading.current_thread().name


def test_every_uni_executor_of_a_process_runs_on_one_model_thread(uni: Callable[..., UniExecutor]) -> None:
    """One OpenMP team in the process: a second, idle one slows every parallel region down."""
    first, second = uni(), uni()
    first.execute_model(step(1, {"a": 1}))
    second.execute_model(step(1, {"a": 1}))
    first.shutdown()  # the thread stays for the other engine
    second.execute_model(step(2, {"a": 1}))
    threads = {*first.worker.threads, *second.worker.threads}
    assert len(threads) == 1 and threads.pop().startswith("cadence-model")


def test_uni_executor_picks_its_engine_cores_device(uni: Callable[..., UniExecutor]) -> None:
    """Data-parallel engine core 1 of 2, one rank each: device 1."""
    assert uni().worker.local_rank == 0
    assert uni(data_parallel_size=2, data_parallel_rank=1).worker.local_rank == 1


def test_uni_executor_shutdown_is_idempotent(uni: Callable[..., UniExecutor]) -> None:
    executor = uni()
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(RuntimeError):  # unusable afterwards
        executor.execute_model(step(1, {"a": 1}))


# ---- the worker --------------------------------------------------------------------------------


def test_kv_blocks_are_what_the_memory_holds_or_the_configured_count() -> None:
    # (K + V) x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8192 bytes per block.
    def blocks(cache: CacheConfig, dtype: torch.dtype = torch.float32) -> int:
        return num_kv_blocks(cache, 2, 2, 16, dtype)

    assert blocks(CacheConfig(kv_cache_memory=10 * 8192 + 8191)) == 10
    assert blocks(CacheConfig(kv_cache_memory=10 * 8192), torch.bfloat16) == 20
    assert blocks(CacheConfig()) == (1 << 30) // 8192  # the default: 1 GiB
    assert blocks(CacheConfig(num_blocks=5, kv_cache_memory=1)) == 5  # a count wins over memory
    with pytest.raises(ValueError, match=r"holds no KV block \(one block needs 8192 bytes\)"):
        blocks(CacheConfig(kv_cache_memory=2 * 8192 - 1))  # one block: only the null block


def test_rank_device_is_the_configured_one_for_rank_zero_and_cpus() -> None:
    assert _rank_device(torch.device("cpu"), 3) == torch.device("cpu")
    assert _rank_device(torch.device("cuda", 1), 0) == torch.device("cuda", 1)


class FakeGroup:
    def __init__(self, rank: int, rank0_tokens: list[int] | None = None) -> None:
        self.rank = rank
        self.world_size = 2
        self.rank0_tokens = rank0_tokens
        self.broadcasts: list[list[int]] = []

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank0_tokens is not None:
            x.copy_(torch.tensor(self.rank0_tokens))
        self.broadcasts.append(x.tolist())
        return x


def test_rank_zero_samples_and_broadcasts_its_tokens() -> None:
    from cadence.executor.sampling_plan import SamplingRow

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=0), [1], [], None)] * 2
    group = FakeGroup(rank=0)
    out = BroadcastSampler(group)(logits, rows)  # type: ignore[arg-type]
    assert out.token_ids == [1, 0]
    assert group.broadcasts == [[1, 0]]
    assert out.logprobs is not None and [e.token_ids for e in out.logprobs] == [[1], [0]]


def test_other_ranks_take_rank_zeros_tokens_without_sampling() -> None:
    from cadence.executor.sampling_plan import SamplingRow

    logits = torch.full((2, 3), float("nan"))  # whatever this rank computed is not looked at
    rows = [SamplingRow(SamplingParams(temperature=1.0, logprobs=2), [1], [], None)] * 2
    group = FakeGroup(rank=1, rank0_tokens=[2, 1])
    out = BroadcastSampler(group)(logits, rows)  # type: ignore[arg-type]
    assert out.token_ids == [2, 1]
    assert out.logprobs is None  # only rank 0's output leaves the worker


# ---- a worker process's loop -------------------------------------------------------------------


class StopLoop(Exception):
    pass


class FakeSteps:
    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def recv(self) -> bytes:
        if not self.frames:
            raise StopLoop
        return self.frames.pop(0)


class FakeReplies:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)


class EchoWorker:
    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        return ModelRunnerOutput(scheduler_output.step_id, list(scheduler_output.num_scheduled_tokens),
                                 [scheduler_output.step_id])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_process_runs_every_published_step_and_only_rank_zero_replies(rank: int) -> None:
    steps = [step(1, {"a": 3}, [NewRequestData("a", [1, 2, 3], 3, SamplingParams(seed=4), 0, [[1]], 0)]),
             step(2, {"a": 1}, cached=[CachedRequestData("a", [[]], 3)])]
    step_codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
    reply_codec: Codec[WorkerReply] = Codec(WorkerReply)
    worker, replies = EchoWorker(), FakeReplies()
    with pytest.raises(StopLoop):  # the loop runs until the process ends
        _serve(worker, rank, FakeSteps([step_codec.encode(s) for s in steps]), replies,  # type: ignore[arg-type]
               reply_codec)
    assert worker.steps == steps
    expected = [ModelRunnerOutput(1, ["a"], [1]), ModelRunnerOutput(2, ["a"], [2])] if rank == 0 else []
    assert [reply_codec.decode(frame) for frame in replies.frames] == expected



def test_a_rank_failing_as_its_peer_is_killed_names_the_killed_peer() -> None:
    """A killed rank's sockets close, and its peers' collective fails, a moment before its exit shows:
    the executor waits briefly for that exit before it blames the rank that reported the failure (the
    report below comes while rank 1 is still alive; it is killed 0.1 s later)."""
    import os
    import signal
    import time
    from multiprocessing import get_context

    processes = [get_context("fork").Process(target=time.sleep, args=(30,), daemon=True) for _ in range(2)]
    for process in processes:
        process.start()
    executor = object.__new__(cadence.executor.multiproc.MultiprocExecutor)
    executor.processes = processes
    killer = threading.Timer(0.1, os.kill, (processes[1].pid, signal.SIGKILL))
    killer.start()
    try:
        error = executor._failure(WorkerFailed(rank=0, error="gloo: connection closed by peer"))
    finally:
        killer.join()
        processes[0].kill()
        processes[0].join()
    assert str(error).startswith(f"worker rank 1 (pid {processes[1].pid}) was killed by SIGKILL; rank 0 then failed")
