"""The simulator: the real scheduler on a virtual clock, its cost model, its CLI verb and plots."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cadence.backends.cpu_kernels import build_for
from cadence.config import default_threads
from cadence.core.cost_model import step_shape
from cadence.core.scheduler import Scheduler
from cadence.engine_args import DEFAULT_TOKEN_BUDGET
from cadence.messages import SchedulerOutput
from cadence.policies.fcfs import FCFSPolicy
from cadence.policies.loader import installed_policies
from cadence.request import Request
from cadence.sim import (
    CostModel,
    EngineLimits,
    RequestSpec,
    StepShape,
    cost_store,
    fit_cost_model,
    run_loop,
    simulate,
    synthetic_workload,
)
from cadence.sim.cli import register
from cadence.sim.cost_store import FitKey
from cadence.sim.report import format_table, plot, repeated
from cadence.sim.workload import FIRST_ORDINARY_ID, SYNTHETIC_VOCAB

SMALL = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def _workload(n: int = 60, seed: int = 0) -> list[RequestSpec]:
    return synthetic_workload(n, request_rate=20.0, input_len="uniform:4:60", output_len="uniform:1:30",
                              tenants="a=1,b=1", seed=seed)


def test_simulation_is_deterministic_for_a_seed() -> None:
    a = simulate(_workload(), SMALL, "fcfs", CostModel.default(), seed=3)
    b = simulate(_workload(), SMALL, "fcfs", CostModel.default(), seed=3)
    assert a.records == b.records and a.steps == b.steps
    assert a.num_preemptions == b.num_preemptions > 0  # the small pool forces preemptions
    assert a.summary()["median_ttft_ms"] == b.summary()["median_ttft_ms"]
    c = simulate(_workload(seed=1), SMALL, "fcfs", CostModel.default(), seed=3)
    assert c.records != a.records


def test_synthetic_prompts_are_the_seed_s_draws_one_prompt_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator draws prompt tokens ahead in blocks (here of 7, so that prompts straddle them):
    the prompts are those a draw per prompt in arrival order gives."""
    monkeypatch.setattr(run_loop, "_DRAW_AHEAD", 7)
    prompts: dict[str, list[int]] = {}
    add = Scheduler.add_request

    def record(self: Scheduler, request: Request) -> None:
        prompts[request.request_id] = list(request.prompt_token_ids)
        add(self, request)

    monkeypatch.setattr(Scheduler, "add_request", record)
    workload = _workload(20)
    simulate(workload, SMALL, "fcfs", CostModel.default(), seed=3)
    rng = np.random.default_rng(3)
    assert [prompts[str(i)] for i in range(len(workload))] == [
        rng.integers(FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, size=spec.prompt_tokens).tolist() for spec in workload]


def test_every_request_gets_its_tokens_and_every_step_keeps_the_limits() -> None:
    seen: list[int] = []

    def check(scheduler: Scheduler, out: SchedulerOutput) -> None:
        assert out.total_num_scheduled_tokens <= SMALL.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= SMALL.max_num_seqs
        scheduler.allocator.check_integrity()
        seen.append(out.step_id)

    workload = _workload()
    result = simulate(workload, SMALL, FCFSPolicy(SMALL.policy_context()), CostModel.constant(0.01), on_step=check)
    assert len(seen) == result.num_steps
    by_id = {s.request_id: s for s in workload}
    for record in result.records:
        assert record.completed
        assert record.output_tokens == by_id[record.request_id].output_tokens
        assert all(b > a for a, b in zip(record.chunk_times, record.chunk_times[1:], strict=False))
        assert record.ttft >= 0.01 - 1e-12  # at least one step after arrival
    assert set(result.finish_reasons.values()) == {"length"}
    # A constant step time: the clock is steps x 10 ms plus idle jumps.
    assert all(s.duration == 0.01 for s in result.steps)


@pytest.mark.parametrize("policy", installed_policies())
def test_every_installed_policy_runs_in_the_simulator(policy: str) -> None:
    workload = synthetic_workload(80, request_rate=30.0, input_len="uniform:4:60", output_len="uniform:1:30",
                                  tenants="a=3,b=1", priority_levels=3, seed=5)
    first = simulate(workload, SMALL, policy, seed=1)
    assert all(r.completed for r in first.records)
    assert sum(r.output_tokens for r in first.records) == sum(s.output_tokens for s in workload)
    again = simulate(workload, SMALL, policy, seed=1)
    assert again.records == first.records and again.steps == first.steps


def test_clock_jumps_over_idle_time_and_steps_take_the_modelled_time() -> None:
    model = CostModel({"const": 0.5, "prefill_tokens": 0.01, "decode_seqs": 0.1})
    workload = [RequestSpec(0.0, 10, 3), RequestSpec(100.0, 10, 1)]
    result = simulate(workload, EngineLimits(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=64),
                      "fcfs", model)
    first, second = result.records
    # Prefill of 10 tokens (0.6 s) gives the first token, then two decodes of 0.6 s each.
    assert first.chunk_times == pytest.approx([0.6, 1.2, 1.8])
    assert second.chunk_times == pytest.approx([100.6])
    assert [s.start for s in result.steps] == pytest.approx([0.0, 0.6, 1.2, 100.0])


def test_requests_the_engine_would_reject_fail_at_the_boundary() -> None:
    limits = EngineLimits(num_kv_blocks=5, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([RequestSpec(0.0, 64, 1)], limits)
    with pytest.raises(ValueError, match="KV cache"):
        simulate([RequestSpec(0.0, 10, 20)], limits)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        simulate([RequestSpec(0.0, 4, 1)], limits, "no-such-policy")


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = CostModel({"const": 0.02, "prefill_tokens": 7e-4, "decode_seqs": 5e-4, "kv_tokens": 3e-7,
                       "prefill_attn": 2e-8, "prefills": 0.0, "sampled": 1e-4})
    shapes = []
    for _ in range(300):
        decodes, prefills = int(rng.integers(0, 64)), int(rng.integers(0, 4))
        chunk = [int(rng.integers(2, 600)) for _ in range(prefills)]
        context = int(rng.integers(1, 2000))
        shapes.append(StepShape(num_seqs=decodes + prefills, prefill_tokens=sum(chunk), decode_seqs=decodes,
                                kv_tokens=decodes * context, prefill_attn=sum(c * (c + context) for c in chunk),
                                prefills=prefills, sampled=decodes + int(rng.integers(0, prefills + 1))))
    times = [truth.step_time(s) for s in shapes]
    model, quality = fit_cost_model(shapes, times)
    for name, value in truth.coefficients.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    assert quality.median_rel_error < 1e-9 and quality.r2 == pytest.approx(1.0)
    # With 5% noise the fit stays close, and no coefficient goes negative.
    noisy = [t * (1 + 0.05 * rng.standard_normal()) for t in times]
    model, quality = fit_cost_model(shapes, noisy)
    assert all(v >= 0 for v in model.coefficients.values())
    assert model.coefficients["prefill_tokens"] == pytest.approx(7e-4, rel=0.05)
    # Decodes are nearly always sampled: the fit may split their cost either way, not change the sum.
    per_decode = model.coefficients.get("decode_seqs", 0) + model.coefficients.get("sampled", 0)
    assert per_decode == pytest.approx(6e-4, rel=0.1)
    assert quality.total_time_ratio == pytest.approx(1.0, rel=0.02)


def test_rows_under_the_kernel_s_limit_are_a_hinge_the_fit_recovers() -> None:
    """Past the quantized kernel's row limit a float GEMM takes the linear layers at a lower price a
    row: ``kernel_rows`` is ``min(rows, limit)``, drafts and prompt tokens counted as rows."""
    limit = 16
    assert step_shape([(1, 40, True, 0)] * 5, limit).kernel_rows == 5
    assert step_shape([(1, 40, True, 0)] * 5 + [(30, 30, True, 0)], limit).kernel_rows == 16
    assert step_shape([(4, 40, True, 3)] * 3, limit).kernel_rows == 12  # a decode and 3 drafts: 4 rows
    assert step_shape([(1, 40, True, 0)] * 40, None).kernel_rows == 0  # no limit: the kernel takes all
    truth = CostModel({"const": 0.008, "prefill_tokens": 3e-3, "decode_seqs": 3.5e-3, "kv_tokens": 9e-6,
                       "prefills": 0.015, "kernel_rows": 4.5e-3}, {"kernel_row_limit": limit})
    rng = np.random.default_rng(1)
    shapes = [step_shape([(1, int(rng.integers(20, 900)), True, 0)] * int(rng.integers(1, 40))
                         + [(int(rng.integers(2, 300)), 300, True, 0)] * int(rng.integers(0, 2)), limit)
              for _ in range(200)]
    model, _ = fit_cost_model(shapes, [truth.step_time(s) for s in shapes])
    for name, value in truth.coefficients.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    # The fast-forward's decode steps, bit for bit, on both sides of the limit.
    for n in (3, 16, 17, 40):
        kv = np.array([5 * n, 7 * n + 3, 12345])
        assert truth.decode_step_times(n, kv).tolist() == [truth.step_time(step_shape(
            [(1, int(k) // n, True, 0)] * (n - 1) + [(1, int(k) - (n - 1) * (int(k) // n), True, 0)], limit))
            for k in kv]


def test_a_version_2_cost_model_still_loads_and_prices_steps_as_it_did(tmp_path: Path) -> None:
    coefficients = {"const": 0.01, "decode_seqs": 0.002, "kv_tokens": 1e-7}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"format": "cadence-cost-model", "version": 2, "coefficients": coefficients,
                                "metadata": {"model": "m"}}))
    model = CostModel.load(path)
    assert model.coefficients == coefficients and model.row_limit is None
    assert model.step_time(StepShape(num_seqs=3, decode_seqs=3, kv_tokens=100, sampled=3)) == pytest.approx(0.01601)


def test_cost_model_round_trips_and_rejects_other_files(tmp_path: Path) -> None:
    model = CostModel({"const": 0.01, "kv_tokens": 1e-7, "kernel_rows": 1e-3},
                      {"model": "m", "dtype": "bfloat16", "kernel_row_limit": 16})
    model.save(tmp_path / "costs.json")
    assert CostModel.load(tmp_path / "costs.json") == model and model.row_limit == 16
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a cadence cost model"):
        CostModel.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="unknown cost-model feature"):
        CostModel({"flops": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        CostModel({"const": -1.0})


def test_plots_are_written(tmp_path: Path) -> None:
    results = [simulate(_workload(), SMALL, "fcfs", label=label) for label in ("one", "two")]
    paths = plot(results, tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "queue_kv.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_repeated_runs_give_each_figure_its_median_and_range() -> None:
    runs = [{"policy": "fcfs", "completed": 10, "median_ttft_ms": t, "request_goodput": None, "tenants": [i]}
            for i, t in enumerate((30.0, 10.0, 20.0, 50.0))]
    row = repeated(runs)
    assert row["median_ttft_ms"] == 25.0 and row["spread"]["median_ttft_ms"] == [10.0, 50.0]
    assert row["completed"] == 10 and row["spread"]["completed"] == [10, 10]
    assert row["request_goodput"] is None and "request_goodput" not in row["spread"]
    assert row["policy"] == "fcfs" and row["tenants"] == [0] and row["runs"] == runs
    one = {"policy": "fcfs", "completed": 10, "duration": 2.0, "request_throughput": 5.0, "output_throughput": 50.0,
           "total_token_throughput": 90.0, "num_preemptions": 0, "mean_ttft_ms": 1.0, "p50_ttft_ms": 1.0}
    table = format_table([one | {"spread": {"p50_ttft_ms": [0.5, 2.25]}}], percentiles=(50,))
    assert "1.0 [0.5, 2.2]" in table  # the median, then the lowest and the highest


def _cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence")
    register(parser.add_subparsers(dest="verb", required=True))
    return parser


def test_simulate_verb_prints_a_table_and_writes_json_and_plots(
        make_tiny_model: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(make_tiny_model("llama"))
    out = tmp_path / "out"
    ns = _cli().parse_args([
        "simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64", "--num-requests", "40",
        "--request-rate", "10",
        "--input-len", "uniform:8:64", "--output-len", "8", "--tenants", "2", "--compare", "fcfs:",
        "--goodput", "ttft:500", "tpot:100", "--output-dir", str(out), "--save-trace", str(tmp_path / "t.jsonl"),
    ])
    assert ns.run(ns) == 0
    table = capsys.readouterr().out
    assert "goodput (req/s)" in table and "output share tenant-1" in table and "p99 TTFT (ms)" in table
    data = json.loads((out / "results.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["fcfs", "fcfs:"]
    assert data["results"][0]["completed"] == 40 and data["results"][0]["request_goodput"] is not None
    assert data["results"][0]["median_ttft_ms"] == data["results"][1]["median_ttft_ms"]
    assert (out / "latency_cdf.png").stat().st_size > 0 and (out / "queue_kv.png").stat().st_size > 0

    # The saved trace replays to the same figures.
    ns = _cli().parse_args(["simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64",
                            "--trace", str(tmp_path / "t.jsonl"), "--output-dir", str(tmp_path / "again"),
                            "--no-plots"])
    assert ns.run(ns) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["results"][0]["median_ttft_ms"] == data["results"][0]["median_ttft_ms"]
    assert not (tmp_path / "again" / "latency_cdf.png").exists()
    # And step by step (no fast-forward), to the same figures again.
    ns = _cli().parse_args(["simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64",
                            "--trace", str(tmp_path / "t.jsonl"), "--output-dir", str(tmp_path / "slow"),
                            "--no-plots", "--no-fast-forward"])
    assert ns.run(ns) == 0
    slow = json.loads((tmp_path / "slow" / "results.json").read_text())
    assert [{k: v for k, v in r.items() if k != "wall_time_s"} for r in slow["results"]] == [
        {k: v for k, v in r.items() if k != "wall_time_s"} for r in again["results"]]


def test_simulate_step_time_noise_is_seeded_and_recorded(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    folder = str(make_tiny_model("llama"))
    medians = []
    for noise, seed in (("0", "1"), ("0.3", "1"), ("0.3", "1"), ("0.3", "2")):
        out = tmp_path / f"{noise}-{seed}-{len(medians)}"
        ns = _cli().parse_args(["simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64",
                                "--num-requests", "30", "--request-rate", "20", "--input-len", "uniform:8:64",
                                "--output-len", "16", "--step-time-noise", noise, "--seed", seed, "--output-dir",
                                str(out), "--no-plots"])
        assert ns.run(ns) == 0
        data = json.loads((out / "results.json").read_text())
        assert data["step_time_noise"] == float(noise) and data["seed"] == int(seed)
        medians.append(data["results"][0]["median_e2el_ms"])
    exact, noisy, again, other = medians
    assert noisy == again and len({exact, noisy, other}) == 3


def test_simulate_repeats_a_policy_over_noise_seeds_and_reports_the_median_and_range(
        make_tiny_model: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(make_tiny_model("llama"))
    common = ["simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64", "--num-requests",
              "30", "--request-rate", "20", "--input-len", "uniform:8:64", "--output-len", "16", "--no-plots"]
    ns = _cli().parse_args([*common, "--step-time-noise", "fit", "--repeat", "3", "--seed", "4",
                            "--output-dir", str(tmp_path / "band"), "--save-trace", str(tmp_path / "w.jsonl")])
    assert ns.run(ns) == 0
    assert re.search(r"p50 TTFT \(ms\) +[\d.]+ \[[\d.]+, [\d.]+\]", capsys.readouterr().out)  # median [range]
    data = json.loads((tmp_path / "band" / "results.json").read_text())
    assert data["step_time_noise"] == pytest.approx(0.070 / 0.6745) and data["repeat"] == 3  # the built-in fit's
    row = data["results"][0]
    ttfts = [run["median_ttft_ms"] for run in row["runs"]]
    assert len(set(ttfts)) == 3
    assert row["median_ttft_ms"] == sorted(ttfts)[1] and row["spread"]["median_ttft_ms"] == [min(ttfts), max(ttfts)]
    # Each run is the single run of its seed on the same workload.
    ns = _cli().parse_args([*common, "--step-time-noise", str(data["step_time_noise"]), "--seed", "5",
                            "--trace", str(tmp_path / "w.jsonl"), "--output-dir", str(tmp_path / "one")])
    assert ns.run(ns) == 0
    assert json.loads((tmp_path / "one" / "results.json").read_text())["results"][0]["median_ttft_ms"] == ttfts[1]
    refused = [(["--repeat", "2"], "give --step-time-noise too"), (["--repeat", "0"], "at least 1"),
               (["--step-time-noise", "lots"], "a SIGMA or 'fit'"),
               (["--repeat", "2", "--step-time-noise", "0.1", "--dashboard", "d.html"], "drop --dashboard")]
    for extra, message in refused:
        ns = _cli().parse_args([*common, *extra])
        with pytest.raises(ValueError, match=message):
            ns.run(ns)


def test_simulate_models_a_server_with_serves_defaults_and_one_engine_core(
        make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    folder = str(make_tiny_model("llama"))
    ns = _cli().parse_args(["simulate", "--model", folder, "--cost-model", "builtin", "--num-kv-blocks", "64",
                            "--trace-scheduling", str(tmp_path / "why.jsonl"), "--compare", "sjf:aging=2",
                            "--num-requests", "4",
                            "--input-len", "8", "--output-len", "4", "--output-dir", str(tmp_path), "--no-plots"])
    assert ns.run(ns) == 0
    # One scheduling trace per policy, named by its label.
    assert sorted(p.name for p in tmp_path.glob("why.*.jsonl")) == ["why.fcfs.jsonl", "why.sjf_aging=2.jsonl"]
    limits = json.loads((tmp_path / "results.json").read_text())["limits"]
    assert (limits["max_num_batched_tokens"], limits["target_itl_ms"]) == (DEFAULT_TOKEN_BUDGET, 0.0)
    assert (EngineLimits().max_num_batched_tokens, EngineLimits().target_itl_ms) == (DEFAULT_TOKEN_BUDGET, 0.0)
    for flag in ("--data-parallel-size", "--tensor-parallel-size"):
        ns = _cli().parse_args(["simulate", "--model", folder, flag, "2", "--output-dir", str(tmp_path)])
        with pytest.raises(ValueError, match="engine cores of one rank each"):
            ns.run(ns)


def test_calibrate_verb_writes_a_cost_model_the_simulator_loads(
        make_tiny_model: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path / "fits"))
    folder = str(make_tiny_model("llama"))
    costs = tmp_path / "costs.json"
    ns = _cli().parse_args(["simulate", "calibrate", "--model", folder, "--dtype", "float32",
                            "--num-kv-blocks", "512", "--quick", "--output", str(costs)])
    assert ns.run(ns) == 0
    model = CostModel.load(costs)
    assert model.metadata["dtype"] == "float32" and model.metadata["fit"]["num_samples"] > 20
    assert model.step_time(StepShape(num_seqs=1, decode_seqs=1, sampled=1)) > 0
    assert "step_time_s = " in capsys.readouterr().out
    # Also stored as this machine's fit for the model, dtype, quantization, threads and kernels' build.
    (stored,) = (tmp_path / "fits").iterdir()
    kernels = build_for(torch.device("cpu"), torch.float32)
    assert stored.name == f"{Path(folder).name}-float32-none-{default_threads()}t-{kernels}.json"
    assert stored == FitKey(Path(folder).name, "float32", "none", default_threads(), kernels).path
    assert CostModel.load(stored) == model


@pytest.mark.parametrize(("arch", "flags", "key"), [
    ("qwen3_moe", ["--dtype", "float32"], "float32-none-1t"),  # a family that keeps the Python layer loop
    ("llama", ["--dtype", "bfloat16", "--quantization", "int8"], "bfloat16-int8-1t"),  # quantized weights
])
def test_any_family_and_quantization_calibrates_into_its_own_fit(
        arch: str, flags: list[str], key: str, make_tiny_model: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path))
    folder = make_tiny_model(arch)
    ns = _cli().parse_args(["simulate", "calibrate", "--model", str(folder), *flags, "--num-threads", "1",
                            "--num-kv-blocks", "512", "--quick"])
    assert ns.run(ns) == 0
    (stored,) = tmp_path.iterdir()
    assert stored.name.startswith(f"{folder.name}-{key}-") and stored.suffix == ".json"
    model = CostModel.load(stored)
    assert model.metadata["quantization"] == key.split("-")[1] and model.metadata["fit"]["num_samples"] > 20


def test_simulate_uses_the_stored_fit_calibrates_first_without_one_and_names_the_fallback(
        make_tiny_model: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path / "fits"))
    folder = str(make_tiny_model("llama"))

    def simulate_verb(*flags: str) -> tuple[dict[str, Any], str]:
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        ns = _cli().parse_args(["simulate", "--model", folder, "--dtype", "float32", "--num-threads", "1",
                                "--num-kv-blocks", "512", "--num-requests", "4", "--input-len", "8",
                                "--output-len", "4", "--no-plots", "--output-dir", str(out), *flags])
        assert ns.run(ns) == 0
        return json.loads((out / "results.json").read_text())["cost_model"], capsys.readouterr().err

    first, log = simulate_verb("--quick-calibration")
    assert "calibrating first" in log
    (stored,) = (tmp_path / "fits").iterdir()
    assert f"-float32-none-1t-{build_for(torch.device('cpu'), torch.float32)}." in stored.name
    assert CostModel.load(stored).to_json() == first
    assert first["metadata"]["threads"] == 1 and first["metadata"]["fit"]["num_samples"] > 20
    again, log = simulate_verb()
    assert "calibrating" not in log and "this machine's fit" in log and again == first
    builtin, log = simulate_verb("--cost-model", "builtin")
    assert "fallback" in log and builtin == CostModel.default().to_json()
    # Other kernels (as after an upgrade) run the steps otherwise: this machine's fit for them is made afresh.
    monkeypatch.setattr(cost_store, "build_for", lambda device, dtype: "rebuilt")
    _, log = simulate_verb("--quick-calibration")
    assert "calibrating first" in log and "kernels rebuilt" in log
    assert sorted(path.name.endswith("-rebuilt.json") for path in (tmp_path / "fits").iterdir()) == [False, True]
