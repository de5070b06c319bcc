"""Tensor parallelism: the split arithmetic, how ranks share a machine's devices and cores, the
parallel layers against their unsharded equivalents (two gloo ranks), and whole engines: TP=2 over
the mp executor picks TP=1's tokens, and a worker killed mid-generation fails the request and kills
the engine instead of hanging."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.multiprocessing
from tp_layer_check import Blocks, check_layers, check_quantized_layers
from transformers import LlamaConfig

from cadence import LLM, SamplingParams
from cadence.config import ConfigError, DeviceConfig, ParallelConfig, threads_per_rank
from cadence.distributed import check_shardable, even_split, head_shard
from cadence.distributed.group import ParallelGroup
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from cadence.errors import EngineDeadError
from cadence.executor.multiproc import MultiprocExecutor
from cadence.quantization.blocks import quantize_int8
from cadence.quantization.packed import kernel_available, kernel_takes_every_batch

# A hang guard only: generation here takes a few seconds.
HANG_GUARD_S = 300


# ---- how dimensions are split -----------------------------------------------------------------


@pytest.mark.parametrize(("total", "world_size"), [(8, 2), (9, 2), (3, 2), (13, 4), (5, 5)])
def test_even_split_covers_the_dimension_contiguously(total: int, world_size: int) -> None:
    splits = [even_split(total, rank, world_size) for rank in range(world_size)]
    assert splits[0].start == 0 and splits[-1].stop == total
    assert all(a.stop == b.start for a, b in itertools.pairwise(splits))
    assert max(s.size for s in splits) - min(s.size for s in splits) <= 1


def test_heads_split_by_kv_groups_unevenly_when_needed() -> None:
    # SmolLM2: 9 heads over 3 KV heads, on 2 ranks: whole groups of 3 query heads per KV head.
    shards = [head_shard(9, 3, rank, 2) for rank in range(2)]
    assert [(s.q.start, s.q.size, s.kv.start, s.kv.size) for s in shards] == [(0, 6, 0, 2), (6, 3, 2, 1)]


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    shards = [head_shard(8, 2, rank, 4) for rank in range(4)]
    assert [(s.q.start, s.q.size) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv.start for s in shards] == [0, 0, 1, 1] and all(s.kv.size == 1 for s in shards)
    with pytest.raises(ValueError, match="choose another --tensor-parallel-size"):
        head_shard(6, 2, 0, 4)


def test_a_model_with_fewer_heads_than_ranks_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        check_shardable(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 8)


# ---- how ranks share a machine ----------------------------------------------------------------


def test_each_engine_cores_ranks_take_their_own_devices() -> None:
    """-dp 2 -tp 2 on one machine: engine core 0 on devices 0 and 1, engine core 1 on 2 and 3."""
    indices = [ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=dp).device_index(tp)
               for dp in range(2) for tp in range(2)]
    assert indices == [0, 1, 2, 3]
    assert ParallelConfig(data_parallel_size=3, data_parallel_rank=2).device_index(0) == 2  # uni executors


def test_the_cores_are_split_among_every_rank_of_every_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    auto = DeviceConfig()
    assert threads_per_rank(auto, ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)) == 4
    assert threads_per_rank(auto, ParallelConfig(tensor_parallel_size=4)) == 4
    assert threads_per_rank(auto, ParallelConfig(data_parallel_size=32)) == 1  # never none
    assert threads_per_rank(DeviceConfig(num_threads=3), ParallelConfig(tensor_parallel_size=2)) == 3


@pytest.mark.parametrize(("omp", "threads"), [("6", 3), ("1", 1), ("0", 8), ("", 8), ("two", 8)])
def test_omp_num_threads_replaces_the_usable_cores_where_it_is_a_positive_number(
        monkeypatch: pytest.MonkeyPatch, omp: str, threads: int) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))  # cpu_count may be larger
    assert threads_per_rank(DeviceConfig(), ParallelConfig(tensor_parallel_size=2)) == threads


def test_a_data_parallel_rank_outside_the_engine_cores_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data_parallel_rank must be in \[0, 2\)"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)


def test_data_parallel_ray_without_a_shared_cluster_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine core would start a local Ray instance of its own."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="set RAY_ADDRESS"):
        ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray")
    monkeypatch.delenv("RAY_ADDRESS")
    ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)  # mp: one machine, no cluster


# ---- the parallel layers ----------------------------------------------------------------------


class _Recording:
    """A checkpoint tensor that records how it is indexed (what a rank actually reads)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[torch.Size] = []

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self.tensor[index]
        self.reads.append(part.shape)
        return part


def test_each_layer_reads_only_its_shard_of_a_checkpoint_tensor() -> None:
    rank1 = ParallelGroup(rank=1, world_size=2)  # loading needs no collective
    gate = _Recording(torch.randn(10, 6))
    ColumnParallelLinear(6, [even_split(10, 1, 2)] * 2, False, torch.float32, "cpu").load("weight", gate, 0)
    down = _Recording(torch.randn(6, 10))
    RowParallelLinear(even_split(10, 1, 2), 6, False, rank1, torch.float32, "cpu").load("weight", down, 0)
    embed = _Recording(torch.randn(13, 6))
    VocabParallelEmbedding(13, 6, rank1, torch.float32, "cpu").load("weight", embed, 0)
    assert (gate.reads, down.reads, embed.reads) == ([(5, 6)], [(6, 5)], [(6, 6)])


def test_parallel_layers_match_unsharded_ones_over_two_gloo_ranks(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(check_layers, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2)


def test_quantized_parallel_layers_match_unsharded_ones_over_two_gloo_ranks(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(check_quantized_layers, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2)


def test_a_row_split_off_the_blocks_of_a_quantized_weight_is_refused() -> None:
    weight = Blocks(quantize_int8(torch.randn(8, 96), block=16))
    layer = RowParallelLinear(even_split(96, 0, 5), 8, False, ParallelGroup(rank=0, world_size=5), torch.float32, "cpu")
    with pytest.raises(ValueError, match="columns 0:20 do not fall on the format's blocks of 16"):
        layer.load("weight", weight, 0)


# ---- whole engines ----------------------------------------------------------------------------


def greedy_and_seeded(prompts: list[list[int]], new_tokens: int) -> list[SamplingParams]:
    """Greedy rows, and one seeded random row: were rank 1 to sample on its own, it would diverge."""
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=new_tokens, ignore_eos=True)
    return [seeded if i == len(prompts) - 1 else greedy for i in range(len(prompts))]


def generate(llm: LLM, prompts: list[list[int]], new_tokens: int = 12) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy_and_seeded(prompts, new_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


TINY_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 100)), list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny_kv1(make_tiny_model: Callable[..., Path]) -> Path:
    """4 heads over a single KV head: at TP=2 each rank holds a replica of it."""
    return make_tiny_model("llama", num_key_value_heads=1)


@pytest.fixture(scope="module")
def tiny_tp2(tiny_kv1: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_kv1), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    yield llm
    llm.shutdown()


def test_tp2_over_gloo_picks_tp1_tokens_on_a_tiny_llama(tiny_kv1: Path, tiny_tp2: LLM) -> None:
    assert tiny_tp2.config.parallel.executor_backend == "mp"
    tp1 = LLM(model=str(tiny_kv1), dtype="float32", num_kv_blocks=64)
    assert generate(tiny_tp2, TINY_PROMPTS) == generate(tp1, TINY_PROMPTS)
    assert tiny_tp2.engine_core.allocator.num_blocks == tp1.engine_core.allocator.num_blocks == 64
    assert tiny_tp2.engine_core.allocator.num_free_blocks == 63  # everything was freed


@pytest.mark.slow
def test_tp2_over_gloo_picks_tp1_tokens_on_smollm2() -> None:
    """The real model: tied embeddings, and 9 heads over 3 KV heads, split 6 + 3."""
    tp1 = LLM(dtype="float32", num_kv_blocks=32, num_threads=1)
    prompts = [tp1.apply_chat_template([{"role": "user", "content": question}])
               for question in ("What is the capital of France?", "Name three colours.")]
    tp2 = LLM(dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert generate(tp2, prompts, 16) == generate(tp1, prompts, 16)
        # The ranks report the Q4_1 layers' row limit, where one applies (AVX2 without VNNI).
        limit = 16 if kernel_available() and not kernel_takes_every_batch(torch.float32) else None
        assert tp2.engine_core.executor.kernel_row_limit == tp1.engine_core.executor.kernel_row_limit == limit
    finally:
        tp2.shutdown()


def test_a_killed_worker_fails_the_request_and_the_engine(tiny_kv1: Path, kill_mid_generation) -> None:
    llm = LLM(model=str(tiny_kv1), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    executor = llm.engine_core.executor
    assert isinstance(executor, MultiprocExecutor)
    victim = executor.processes[1].pid
    assert victim is not None
    try:
        error = kill_mid_generation(llm, victim)
        assert isinstance(error, EngineDeadError)
        assert "worker rank 1" in str(error) and "SIGKILL" in str(error)
        assert llm.dead is not None
        with pytest.raises(EngineDeadError):
            llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(process.is_alive() for process in executor.processes)


def test_a_worker_that_dies_while_the_engine_is_idle_fails_the_engine(tiny_kv1: Path) -> None:
    """No step runs: the executor's watch on the worker processes sees the death, not a step."""
    llm = LLM(model=str(tiny_kv1), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    executor = llm.engine_core.executor
    assert isinstance(executor, MultiprocExecutor) and executor.processes[1].pid is not None
    deaths: list[str] = []

    async def run() -> None:
        async with llm.running(on_dead=deaths.append):
            os.kill(executor.processes[1].pid, signal.SIGKILL)
            with anyio.fail_after(HANG_GUARD_S):
                while not deaths:
                    await anyio.sleep(0.05)

    try:
        anyio.run(run)
        assert len(deaths) == 1 and "worker rank 1" in deaths[0] and "SIGKILL" in deaths[0], deaths
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
