"""Scheduling traces: the scheduler writes what it decided about each request, with why a waiting
request waited, in the same format from the engine and the simulator (the two agree step by step on
the same workload); ``cadence trace explain`` tells one request's story and ``cadence trace diff``
compares two runs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cadence import LLM, SamplingParams
from cadence.cli import main
from cadence.core.cost_model import CostModel
from cadence.core.engine_core import scheduling_trace_of
from cadence.core.scheduling_trace import SchedulingTrace
from cadence.engine_args import EngineArgs
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.trace_story import TraceFile, explain
from cadence.sim.workload import RequestSpec

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 3, [12, 13, 14, 15, 16], [17, 18] * 10]


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_queued_request_waits_for_a_seat_at_the_head_and_its_story_says_so(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    workload = [RequestSpec(0.0, 8, 3, request_id="a"), RequestSpec(0.0, 4, 2, request_id="b"),
                RequestSpec(0.0, 4, 2, request_id="c")]
    limits = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64,
                          target_itl_ms=0.0)
    simulate(workload, limits, "fcfs", CostModel.constant(0.01), trace_scheduling=path)
    header, *trace = events(path)
    assert header == {"event": "engine", "step": 0, "t": 0.0, "simulated": True, "model": None, "dtype": None,
                      "quantization": None, "threads": None, "kernel_row_limit": None, "speculative": None}
    assert [e["event"] for e in trace[:6]] == ["arrival", "arrival", "arrival", "blocked", "scheduled", "end"]
    assert {k: trace[3][k] for k in ("step", "head", "reason", "waiting")} == {
        "step": 1, "head": "b", "reason": "seats", "waiting": 2}
    assert {k: trace[4][k] for k in ("request", "tokens", "start", "samples", "admitted", "cached")} == {
        "request": "a", "tokens": 8, "start": 0, "samples": True, "admitted": True, "cached": 0}
    # Virtual time: steps of 10 ms; a finished at the end of its third step.
    finished = {e["request"]: e for e in trace if e["event"] == "finished"}
    assert (finished["a"]["step"], finished["a"]["t"], finished["a"]["reason"]) == (3, pytest.approx(0.03), "length")
    stories = TraceFile(path).stories
    # b waits 3 steps at the head for the one seat, c 3 + 2 behind it then at the head.
    assert [why for _, why in stories["b"].waits] == ["at the head of the queue: seats"] * 3
    assert [why for _, why in stories["c"].waits] == ["behind the head: seats"] * 3 + [
        "at the head of the queue: seats"] * 2
    assert stories["c"].ttft == pytest.approx(0.06) and stories["c"].e2e == pytest.approx(0.07)
    story = explain(stories["c"])
    assert "waited 5 steps (1-5): 3 behind the head: seats, 2 at the head of the queue: seats" in story
    assert "admitted: 0 prompt tokens from the prefix cache; first chunk 4 tokens, first token" in story
    assert "finished: length" in story and "TTFT 0.060 s, end to end 0.070 s, 0 preemption(s)" in story


def test_a_burst_under_max_prompts_per_step_waits_for_the_prompt_cap_and_its_story_says_so(tmp_path: Path) -> None:
    """Three short prompts at once, one admitted a step (``--max-prompts-per-step 1``, in the simulator
    as in the engine): the second waits one step at the head for the cap, the third one behind it."""
    path = tmp_path / "trace.jsonl"
    workload = [RequestSpec(0.0, 4, 2, request_id=name) for name in "abc"]
    limits = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                          max_prompts_per_step=1, target_itl_ms=0.0)
    simulate(workload, limits, "fcfs", CostModel.constant(0.01), trace_scheduling=path)
    blocked = [(e["step"], e["head"], e["reason"], e["waiting"]) for e in events(path) if e["event"] == "blocked"]
    assert blocked == [(1, "b", "prompt_cap", 2), (2, "c", "prompt_cap", 1)]
    stories = TraceFile(path).stories
    assert [why for _, why in stories["c"].waits] == ["behind the head: prompt_cap",
                                                      "at the head of the queue: prompt_cap"]
    assert stories["a"].ttft == pytest.approx(0.01) and stories["c"].ttft == pytest.approx(0.03)


def test_preemptions_name_who_they_made_room_for(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    # Five blocks of 4 tokens: two requests that each grow to 10 tokens cannot both keep theirs.
    workload = [RequestSpec(0.0, 4, 6, request_id="a"), RequestSpec(0.0, 4, 6, request_id="b")]
    limits = EngineLimits(num_kv_blocks=5, block_size=4, max_model_len=16, max_num_seqs=2, max_num_batched_tokens=16,
                          target_itl_ms=0.0, enable_prefix_caching=False)
    result = simulate(workload, limits, "fcfs", CostModel.constant(0.01), trace_scheduling=path)
    preempted = [e for e in events(path) if e["event"] == "preempted"]
    assert len(preempted) == result.num_preemptions > 0
    assert all(e["reason"] == "kv_blocks" and e["by"] in ("a", "b") for e in preempted)
    story = TraceFile(path).stories[preempted[0]["request"]]
    assert story.num_preemptions >= 1 and "back to waiting" in explain(story)


def test_the_engine_and_the_simulator_write_the_same_decisions_step_by_step(
        tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    """Same prompts (token ids), same limits, all arriving at once, no latency target: the real
    engine's trace and the simulator's hold the same scheduled events and waits, step for step."""
    real, simulated = tmp_path / "real.jsonl", tmp_path / "sim.jsonl"
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
              num_kv_blocks=64, trace_scheduling=str(real))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 2, 4)]
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    limits = EngineLimits.from_engine_config(llm.config, num_kv_blocks=64)
    workload = [RequestSpec(0.0, len(p), s.max_tokens or 1, request_id=str(i), prompt_token_ids=tuple(p))
                for i, (p, s) in enumerate(zip(PROMPTS, params, strict=True))]
    simulate(workload, limits, "fcfs", CostModel.constant(0.01), trace_scheduling=simulated)

    def decisions(path: Path) -> list[tuple[Any, ...]]:
        keys = ("event", "step", "request", "tokens", "start", "samples", "admitted", "cached", "head", "reason")
        return [tuple(e.get(k) for k in keys) for e in events(path) if e["event"] not in ("end", "engine")]

    assert decisions(real) == decisions(simulated)
    assert {e["client_id"] for e in events(real) if e["event"] == "arrival"} == {"1", "2", "3", "4"}
    # The caller's id finds its sequence ("4" is no engine id here).
    assert explain(TraceFile(real).find("4")[0]).startswith("request 3 (client id 4): 20 prompt tokens")


def test_the_trace_verbs_explain_a_request_and_diff_two_policies(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    workload = [RequestSpec(0.01 * i, 4 + 12 * (i % 3), 3, request_id=f"r{i}") for i in range(12)]
    limits = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                          target_itl_ms=0.0)
    for policy in ("fcfs", "sjf"):
        simulate(workload, limits, policy, CostModel.constant(0.01), trace_scheduling=tmp_path / f"{policy}.jsonl")
    assert main(["trace", "explain", str(tmp_path / "sjf.jsonl"), "--request", "r11"]) == 0
    assert capsys.readouterr().out.startswith("request r11: 28 prompt tokens, max_tokens 3")
    assert main(["trace", "diff", str(tmp_path / "fcfs.jsonl"), str(tmp_path / "sjf.jsonl"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("12 requests in both") and "requests whose TTFT moved most" in out
    assert len(out.split("requests whose TTFT moved most (s):\n")[1].splitlines()) == 1 + 3
    with pytest.raises(ValueError, match="no request 'nope'"):
        TraceFile(tmp_path / "sjf.jsonl").find("nope")


def test_each_engine_core_of_several_writes_its_own_file(tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    config = EngineArgs(model=str(make_tiny_model("llama")), trace_scheduling=str(tmp_path / "t.jsonl"),
                        data_parallel_size=2).create_config()
    ranked = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=1))
    trace = scheduling_trace_of(ranked)
    assert isinstance(trace, SchedulingTrace) and trace.path == tmp_path / "t.jsonl.dp1"
    trace.close()
    assert scheduling_trace_of(dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, trace_scheduling=None))) is None
