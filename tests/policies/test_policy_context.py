"""What a policy reads besides the request's counts: the clock (wall time in the engine, virtual time in
the simulator) and the request's own ``extra_args``. The earliest-deadline-first example of
docs/policies.md, installed beside the tests as a plugin would be, runs by name in the simulator, in
the offline engine and behind ``cadence serve`` (deadlines sent as ``vllm_xargs``)."""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.scripted_engine import ScriptedEngine, out, post_json, step

from cadence import LLM, SamplingParams
from cadence.api.testing import ServerProcess
from cadence.bench.cli import register as register_bench
from cadence.bench.serve import measure
from cadence.policies.base import PolicyContext
from cadence.policies.clock import VirtualClock, WallClock
from cadence.policies.loader import load_policy
from cadence.request import Request
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.workload import RequestSpec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
LOGGED_EDF = '''
import json
from edf_policy import EarliestDeadlineFirst

class LoggedEDF(EarliestDeadlineFirst):
    """The documented policy, writing what it sees of each arriving request to the file its log option names."""
    name = "edf-logged"

    @classmethod
    def accepted_options(cls):
        return {**super().accepted_options(), "log": "where to append what the policy saw"}

    def on_arrival(self, request):
        with open(self.options["log"], "a") as f:
            f.write(json.dumps({"id": request.request_id, "extra_args": dict(request.extra_args),
                                "arrival_time": request.arrival_time, "now": self.now()}) + "\\n")
'''


@pytest.fixture
def plugin_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path holding docs/policies.md's edf_policy.py (and a logging subclass) with a
    dist-info that registers them in the ``cadence.policies`` group, as ``pip install`` would."""
    folder = tmp_path_factory.mktemp("edf-plugin")
    block = re.search(r"^`edf_policy.py`\n\n```python\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    assert block, "docs/policies.md has no edf_policy.py block"
    (folder / "edf_policy.py").write_text(block.group(1))
    (folder / "edf_logged.py").write_text(LOGGED_EDF)
    info = folder / "cadence_edf-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cadence-edf\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[cadence.policies]\nedf = edf_policy:EarliestDeadlineFirst\n"
                                           "edf-logged = edf_logged:LoggedEDF\n")
    monkeypatch.syspath_prepend(str(folder))
    yield folder


def test_the_documented_edf_orders_by_deadline_and_puts_missed_ones_last(plugin_dir: Path) -> None:
    clock = VirtualClock(10.0)
    context = PolicyContext(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True,
                            long_prefill_token_threshold=0, clock=clock)
    policy = load_policy("edf", context, {"default_deadline_s": "5"})
    specs = [RequestSpec(9.0, 4, 4, request_id="missed", extra_args={"deadline_s": 0.5}),
             RequestSpec(8.0, 4, 4, request_id="default"),  # 8 + 5 = 13
             RequestSpec(9.5, 4, 4, request_id="soon", extra_args={"deadline_s": 1})]  # 10.5
    waiting = [Request(s.request_id or "", [1] * 4, SamplingParams(extra_args=s.extra_args and dict(s.extra_args)),
                       None, s.arrival_time, 64) for s in specs]
    assert [r.request_id for r in policy.order_waiting(waiting)] == ["soon", "default", "missed"]
    clock.time = 8.5  # nothing has missed its deadline yet
    assert [r.request_id for r in policy.order_waiting(waiting)] == ["missed", "soon", "default"]
    assert policy.describe() == "edf (chunked=true, default_deadline_s=5)"


def test_the_simulator_runs_it_on_its_virtual_clock_with_the_traces_extra_args(plugin_dir: Path,
                                                                               tmp_path: Path) -> None:
    # One seat: the first arrival runs, the rest wait and are admitted by deadline.
    workload = [RequestSpec(0.0, 8, 4, request_id="first")] + [
        RequestSpec(0.001 * i, 8, 4, request_id=f"d{deadline}", extra_args={"deadline_s": deadline})
        for i, deadline in enumerate([40, 10, 30, 20], start=1)]
    limits = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=1,
                          max_num_batched_tokens=64)
    log = tmp_path / "seen.jsonl"
    result = simulate(workload, limits, "edf-logged", policy_options={"log": str(log)})
    first_tokens = {r.request_id: r.chunk_times[0] for r in result.records}
    assert sorted(first_tokens, key=first_tokens.__getitem__) == ["first", "d10", "d20", "d30", "d40"]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    # Requests arrive when the virtual clock passes their arrival time: never before, and in order.
    assert [s["extra_args"] for s in seen] == [{}] + [{"deadline_s": d} for d in (40, 10, 30, 20)]
    assert all(s["now"] >= s["arrival_time"] for s in seen) and seen[0]["now"] == 0.0
    assert [s["now"] for s in seen] == sorted(s["now"] for s in seen)


def test_the_engine_runs_it_on_the_wall_clock_with_sampling_params_extra_args(
        plugin_dir: Path, tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    log = tmp_path / "seen.jsonl"
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32", policy="edf-logged", max_num_seqs=1,
              policy_options={"log": str(log)})
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
    deadlines = [40, 10, 30, 20]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args={"deadline_s": d})
              for d in deadlines]
    admitted: list[str] = []
    scheduler = llm.engine_core.scheduler
    schedule = scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        output = schedule()
        admitted.extend(new.request_id for new in output.new_requests)
        return output

    scheduler.schedule = spy  # type: ignore[method-assign]
    before = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(s["extra_args"]["deadline_s"] for s in seen) == sorted(deadlines)
    # The engine's clock is the wall clock arrivals are stamped with.
    assert all(before <= s["arrival_time"] <= s["now"] <= time.time() for s in seen)
    # All four are in the engine before its first step (generate submits them without yielding),
    # and wait for the one seat: admitted by deadline.
    deadline_of = {s["id"]: s["extra_args"]["deadline_s"] for s in seen}
    assert [deadline_of[request_id] for request_id in admitted] == [10, 20, 30, 40]


def test_vllm_xargs_reach_the_engine_as_extra_args_and_bad_ones_are_refused() -> None:
    engine = ScriptedEngine(lambda call: [step(out(0, "a", [67], "stop"))])
    reply = post_json(engine, "/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                                   "vllm_xargs": {"deadline_s": 2.5, "tier": "gold", "vip": True}})
    assert reply.status == 200, reply.text
    assert engine.calls[0].request.params.extra_args == {"deadline_s": 2.5, "tier": "gold", "vip": True}
    reply = post_json(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "vllm_xargs": {"deadline_s": [1]}})
    assert reply.status == 400 and json.loads(reply.text)["error"]["param"] == "vllm_xargs", reply.text


def test_a_policy_built_without_a_clock_reads_the_wall_clock() -> None:
    context = PolicyContext(max_num_batched_tokens=8, max_num_seqs=1, enable_chunked_prefill=True,
                            long_prefill_token_threshold=0)
    assert isinstance(context.clock, WallClock)
    policy = load_policy("fcfs", context)
    before = time.time()
    assert before <= policy.now() <= time.time()


def test_behind_cadence_serve_a_replayed_traces_extra_args_reach_the_policy(
        plugin_dir: Path, tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    """``bench serve --dataset-name trace`` sends each line's token ids, user and extra_args (as
    ``vllm_xargs``); the server shows its policy at start and in /metrics."""
    tiny = str(make_tiny_model("llama"))
    log, trace = tmp_path / "seen.jsonl", tmp_path / "trace.jsonl"
    rows = [{"arrival_time": 5.0, "prompt_tokens": [5, 6, 7, 8], "output_tokens": 3, "extra_args": {"deadline_s": 3}},
            {"arrival_time": 5.25, "prompt_tokens": [9, 10, 11, 12, 13, 14], "output_tokens": 2, "user": "bob",
             "extra_args": {"deadline_s": 1, "tier": "gold"}}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--model", tiny, "--dtype", "float32", "--num-threads", "1", "--policy", "edf-logged",
            "--policy-option", f"log={log}"]
    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers(dest="verb", required=True))
    with ServerProcess(args, log_path=tmp_path / "server.log", env={"PYTHONPATH": str(plugin_dir)}) as server:
        described = f"edf-logged (chunked=true, log={log})"
        assert f"scheduling policy {described}" in server.log()
        ns = parser.parse_args(["bench", "serve", "--disable-tqdm", "--base-url", server.url, "--tokenizer", tiny,
                                "--dataset-name", "trace", "--dataset-path", str(trace)])
        _, metrics = measure(ns)
        with urllib.request.urlopen(f"{server.url}/metrics") as response:
            page = response.read().decode()
        assert server.stop() == 0, server.log()
    labels = f'engine="0",model_name="{Path(tiny).name}",policy="{described}"'
    assert f"cadence:scheduling_policy_info{{{labels}}} 1.0" in page
    assert (metrics.completed, metrics.total_input_tokens, metrics.total_output_tokens) == (2, 4 + 6, 3 + 2)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    # The untimed first request (the trace's first line), then the two timed ones.
    assert [s["extra_args"] for s in seen] == [{"deadline_s": 3}, {"deadline_s": 3}, {"deadline_s": 1, "tier": "gold"}]
