"""``cadence simulate --dashboard FILE`` (``sim/dashboard_report.py``): the live dashboard's page with
a simulated run's snapshots, checked against the run's own records, then in headless Chromium."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from support.browser import chromium_page

from cadence.sim import CostModel, EngineLimits, RequestSpec, simulate, synthetic_workload
from cadence.sim.cli import register
from cadence.sim.dashboard_report import MAX_SNAPSHOTS, SimDashboard

# A pool small enough to preempt.
SMALL = EngineLimits(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def workload(n: int = 60) -> list[RequestSpec]:
    return synthetic_workload(n, request_rate=20.0, input_len="uniform:4:60", output_len="uniform:1:30", seed=0)


def page_data(html: str) -> dict[str, Any]:
    found = re.search(r'<script id="dashboard-data" type="application/json">(.*?)</script>', html, re.S)
    assert found is not None
    return dict(json.loads(found.group(1)))


def test_the_snapshots_tell_what_the_run_did() -> None:
    dashboard = SimDashboard(num_engines=1)
    result = simulate(workload(), SMALL, "fcfs", CostModel.default(), seed=3, dashboard=dashboard)
    snaps = dashboard.snapshots
    times = [s["t"] for s in snaps]
    assert times == sorted(times) and len(set(times)) == len(times) and times[-1] == result.end_time
    last = snaps[-1]
    assert (last["requests"], last["finished"], last["running"], last["waiting"]) == (60, 60, 0, 0)
    assert last["output_tokens"] == sum(r.output_tokens for r in result.records)
    assert last["preemptions"] == result.num_preemptions > 0
    records = {r.request_id: r for r in result.records}
    rows = last["timeline"]
    assert [row["id"] for row in rows] == [r.request_id for r in result.records][-40:]
    preempted = 0
    for row in rows:
        record, spans = records[row["id"]], row["spans"]
        assert row["arrival"] == record.arrival_time and spans[0][:2] == ["waiting", record.arrival_time]
        assert all(a[2] == b[1] for a, b in pairwise(spans))
        first_decode = next(span for span in spans if span[0] == "decode")
        assert first_decode[1] == record.chunk_times[0] and spans[-1][2] == record.finish_time
        assert row["reason"] == "length"
        preempted += sum(span[0] == "preempted" for span in spans)
    assert preempted > 0
    # Latency percentiles over the last window, from the same times the records hold.
    assert last["ttft"]["n"] == sum(r.chunk_times[0] >= last["t"] - 30.0 for r in result.records)


def test_a_long_run_keeps_a_bounded_number_of_snapshots() -> None:
    dashboard = SimDashboard(num_engines=1, interval_s=0.001)
    result = simulate(workload(200), SMALL, "fcfs", CostModel.default(), seed=3, dashboard=dashboard)
    snaps = dashboard.snapshots
    assert MAX_SNAPSHOTS // 2 <= len(snaps) <= MAX_SNAPSHOTS and dashboard.interval_s > 0.001
    assert snaps[-1]["t"] == result.end_time and snaps[-1]["finished"] == 200


def test_a_fleet_shows_each_engine() -> None:
    dashboard = SimDashboard(num_engines=2)
    simulate(workload(), SMALL, "fcfs", [CostModel.default()] * 2, seed=3, engines=2, router="round-robin",
             dashboard=dashboard)
    assert all(engine is not None for engine in dashboard.snapshots[-1]["engines"])
    assert any(s["engines"][1] is not None and s["engines"][1]["running"] > 0 for s in dashboard.snapshots)


def simulate_cli(model: str, out: Path, *flags: str) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="verb", required=True))
    ns = parser.parse_args(["simulate", "--model", model, "--cost-model", "builtin", "--num-kv-blocks", "64",
                            "--num-requests", "60", "--request-rate", "20", "--input-len", "uniform:8:64",
                            "--output-len", "uniform:1:30", "--output-dir", str(out), "--no-plots", *flags])
    assert ns.run(ns) == 0


def test_the_verb_writes_one_page_per_policy(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    simulate_cli(str(make_tiny_model("llama")), tmp_path, "--dashboard", str(tmp_path / "run.html"), "--compare", "sjf")
    for policy in ("fcfs", "sjf"):
        data = page_data((tmp_path / f"run.{policy}.html").read_text())
        assert data["live"] is False and data["meta"]["policy"] == policy and data["meta"]["engines"] == 1
        assert data["snapshots"][-1]["finished"] == 60


def test_the_report_in_a_browser(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    page_file = tmp_path / "run.html"
    simulate_cli(str(make_tiny_model("llama")), tmp_path, "--dashboard", str(page_file))
    snaps = page_data(page_file.read_text())["snapshots"]
    with chromium_page() as page:
        page.goto(page_file.as_uri())
        assert page.inner_text("#mode") == "simulated run"
        assert page.inner_text("#requests") == "60 / 60"
        assert page.inner_text("#updates") == str(len(snaps))
        assert page.locator("#chart-queue polyline").count() == 2
        assert page.locator("#timeline rect.phase-decode").count() >= 40
        # The slider goes back in the run's time: the first snapshot, before most requests arrived.
        page.eval_on_selector("#scrub", "e => { e.value = 0; e.dispatchEvent(new Event('input')); }")
        first = snaps[0]
        assert page.inner_text("#requests") == f"{first['finished']} / {first['requests']}"
        assert page.inner_text("#clock") == f"t = {first['t']:.1f} s"
        assert page.locator("#timeline rect").count() == sum(len(row["spans"]) for row in first["timeline"])
        shot = page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert shot.startswith(b"\x89PNG")
