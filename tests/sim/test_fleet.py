"""A simulated fleet: N engines (each its own scheduler, policy, KV allocator and cost model) behind the
real data-parallel router on one virtual clock (``simulate(..., engines=N, router=NAME)``,
``cadence simulate --engines N --router NAME``)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from cadence.config import HASH_ALGOS
from cadence.core.cost_model import CostModel
from cadence.policies.fcfs import FCFSPolicy
from cadence.sim.cli import register
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.step_log import StepRecord
from cadence.sim.workload import RequestSpec

LIMITS = EngineLimits(num_kv_blocks=256, block_size=4, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
                      target_itl_ms=0.0)
STEP = CostModel.constant(0.01)


def same_requests(count: int) -> list[RequestSpec]:
    return [RequestSpec(0.0, 8, 5, request_id=f"r{i}") for i in range(count)]


def test_round_robin_splits_a_burst_evenly_and_four_engines_finish_it_as_one_engine_finishes_a_quarter() -> None:
    one = simulate(same_requests(10), LIMITS, "fcfs", STEP)
    fleet = simulate(same_requests(40), LIMITS, "fcfs", STEP, engines=4, router="round-robin")
    assert fleet.end_time == pytest.approx(one.end_time) and fleet.metrics().completed == 40
    assert Counter(s.engine for s in fleet.steps) == {rank: one.num_steps for rank in range(4)}
    assert [s.start for s in fleet.steps] == sorted(s.start for s in fleet.steps)
    assert all(isinstance(s, StepRecord) for s in fleet.steps)


def test_least_loaded_sends_arrivals_to_the_idle_engine_and_heterogeneous_engines_keep_their_costs() -> None:
    workload = [RequestSpec(0.001 * i, 8, 20, request_id=f"r{i}") for i in range(6)]
    fast, slow = CostModel.constant(0.01), CostModel.constant(0.03)
    result = simulate(workload, LIMITS, "fcfs", [fast, slow], engines=2, router="least-loaded")
    assert {s.engine: s.duration for s in result.steps} == {0: pytest.approx(0.01), 1: pytest.approx(0.03)}
    # One at a time: 0 -> engine 0, 1 -> engine 1 (0 has one), 2 -> engine 0 (a tie) ...
    assert result.metrics().completed == 6 and {s.engine for s in result.steps} == {0, 1}


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_prefix_aware_follows_the_engine_that_cached_the_prefix(tmp_path: Path, algo: str) -> None:
    prefix = list(range(100, 132))  # 8 full blocks of 4
    workload = [RequestSpec(0.0, 36, 200, request_id="first", prompt_token_ids=(*prefix, 1, 2, 3, 4)),
                RequestSpec(0.5, 36, 2, request_id="again", prompt_token_ids=(*prefix, 5, 6, 7, 8)),
                RequestSpec(0.6, 8, 2, request_id="other", prompt_token_ids=tuple(range(500, 508)))]
    limits = replace(LIMITS, prefix_caching_hash_algo=algo)  # the router's keys follow the engines'
    simulate(workload, limits, "fcfs", STEP, engines=2, router="prefix-aware", trace_scheduling=tmp_path / "t.jsonl")
    admitted = {}
    for rank in range(2):
        for line in (tmp_path / f"t.jsonl.dp{rank}").read_text().splitlines():
            event = json.loads(line)
            if event.get("admitted"):
                admitted[event["request"]] = (rank, event["cached"])
    # "again" joins the busy engine 0, which holds its prefix (least loaded alone would pick engine 1);
    # "other" has no prefix anywhere: the least loaded engine.
    assert admitted == {"first": (0, 0), "again": (0, 32), "other": (1, 0)}


def test_a_fleet_s_figures_are_the_same_under_either_block_key() -> None:
    """Shared prefixes behind the prefix-aware router, the pool small enough to evict: the keys decide
    nothing but equality, so xxhash (fast) simulates exactly what sha256 does."""
    stems = [tuple(range(1000 * s, 1000 * s + 24)) for s in range(3)]
    workload = [RequestSpec(0.02 * i, 28, 6 + i % 5, request_id=f"r{i}", prompt_token_ids=(*stems[i % 3], i, i, i, i))
                for i in range(40)]
    limits = replace(LIMITS, num_kv_blocks=40)
    runs = [simulate(workload, replace(limits, prefix_caching_hash_algo=algo), "fcfs", STEP, engines=2,
                     router="prefix-aware") for algo in HASH_ALGOS]
    assert [run.summary() | {"wall_time_s": 0} for run in runs] == [runs[0].summary() | {"wall_time_s": 0}] * 2
    assert runs[0].metrics().completed == 40
    assert sum(s.prefill_tokens for s in runs[0].steps) < 40 * 28  # prefix hits were taken


def test_a_fleet_needs_a_policy_name_and_a_cost_model_per_engine() -> None:
    with pytest.raises(ValueError, match="needs a policy name"):
        simulate(same_requests(2), LIMITS, FCFSPolicy(LIMITS.policy_context()), STEP, engines=2)
    with pytest.raises(ValueError, match="2 engine\\(s\\) need as many cost models, got 3"):
        simulate(same_requests(2), LIMITS, "fcfs", [STEP] * 3, engines=2)
    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        simulate(same_requests(2), LIMITS, "fcfs", STEP, engines=2, router="nearest")
    with pytest.raises(ValueError, match="prefix caching hash algorithm must be one of sha256, xxhash, got 'crc'"):
        replace(LIMITS, prefix_caching_hash_algo="crc")


def test_the_verb_simulates_a_fleet(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="verb", required=True))
    ns = parser.parse_args(["simulate", "--model", str(make_tiny_model("llama")), "--cost-model", "builtin",
                            "--num-requests", "30", "--input-len", "16", "--output-len", "4", "--engines", "3",
                            "--router", "power-of-two", "--prefix-caching-hash-algo", "xxhash",
                            "--output-dir", str(tmp_path), "--no-plots"])
    assert ns.run(ns) == 0
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["completed"] == 30
    ns = parser.parse_args(["simulate", "--model", str(make_tiny_model("llama")), "--engines", "0"])
    with pytest.raises(ValueError, match="--engines must be at least 1"):
        ns.run(ns)
