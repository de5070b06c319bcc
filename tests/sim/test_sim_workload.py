"""Simulator workloads: arrival statistics, length distributions, JSONL traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cadence.sim.workload import (
    LengthDist,
    RequestSpec,
    arrival_times,
    load_trace,
    parse_tenants,
    save_trace,
    synthetic_workload,
)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gamma_arrivals_have_the_asked_rate_and_burstiness(burstiness: float, cv: float) -> None:
    times = arrival_times(40_000, 10.0, burstiness, rng=np.random.default_rng(1))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # Gamma(shape k) gaps have a coefficient of variation 1 / sqrt(k); Poisson (k = 1) has 1.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_poisson_counts_per_window_are_poisson() -> None:
    times = arrival_times(50_001, 5.0, rng=np.random.default_rng(2))
    counts = np.bincount(times.astype(int))[:-1]  # arrivals per second, last partial second dropped
    assert counts.mean() == pytest.approx(5.0, rel=0.03)
    assert counts.var() == pytest.approx(5.0, rel=0.08)  # Poisson: variance equals the mean


def test_infinite_rate_and_bad_arguments() -> None:
    assert (arrival_times(5, math.inf, rng=np.random.default_rng(0)) == 0).all()
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(5, 0.0, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(5, 1.0, -1.0, rng=np.random.default_rng(0))


@pytest.mark.parametrize(("spec", "mean"), [
    ("128", 128), ("uniform:10:30", 20), ("normal:200:20", 200), ("lognormal:300:0.5", 300),
    ("exponential:50", 50),
])
def test_length_distributions(spec: str, mean: float) -> None:
    dist = LengthDist.parse(spec)
    samples = dist.sample(20_000, np.random.default_rng(3))
    assert samples.min() >= 1 and samples.dtype == np.int64
    assert samples.mean() == pytest.approx(mean, rel=0.03)
    assert LengthDist.parse(str(dist)) == dist


@pytest.mark.parametrize("bad", ["", "zero", "uniform:5", "uniform:9:3", "normal:0:1", "poisson:3", "0"])
def test_bad_length_specs_say_what_is_accepted(bad: str) -> None:
    with pytest.raises(ValueError, match=r"uniform:LO:HI|out-of-range"):
        LengthDist.parse(bad)


def test_synthetic_workload_is_seeded() -> None:
    a = synthetic_workload(200, request_rate=4, input_len="uniform:8:64", output_len=16, tenants="a=3,b=1",
                           priority_levels=3, seed=7)
    assert a == synthetic_workload(200, request_rate=4, input_len="uniform:8:64", output_len=16,
                                   tenants="a=3,b=1", priority_levels=3, seed=7)
    assert a != synthetic_workload(200, request_rate=4, input_len="uniform:8:64", output_len=16,
                                   tenants="a=3,b=1", priority_levels=3, seed=8)
    assert {s.user for s in a} == {"a", "b"} and {s.priority for s in a} == {0, 1, 2}
    assert sum(s.user == "a" for s in a) > 120  # weight 3 of 4
    assert all(8 <= s.prompt_tokens <= 64 and s.output_tokens == 16 for s in a)


def test_parse_tenants() -> None:
    assert parse_tenants("2") == {"tenant-0": 1.0, "tenant-1": 1.0}
    assert parse_tenants("a=2,b") == {"a": 2.0, "b": 1.0}
    assert parse_tenants(None) == {}
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        parse_tenants("a=-1")


def test_trace_loads_sorted_with_ids_and_optional_fields(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"arrival_time": 2.0, "prompt_tokens": 5, "output_tokens": 3, "user": "bob", "priority": 1},
        {"arrival_time": 0.5, "prompt_tokens": [7, 8, 9], "output_tokens": 1, "request_id": "first"},
        {"arrival_time": 3.0, "prompt_tokens": 2, "output_tokens": 1, "extra_args": {"deadline_s": 1.5, "slo": "gold"}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = load_trace(path)
    assert [s.arrival_time for s in specs] == [0.5, 2.0, 3.0]
    assert specs[0] == RequestSpec(0.5, 3, 1, request_id="first", prompt_token_ids=(7, 8, 9))
    assert specs[1] == RequestSpec(2.0, 5, 3, priority=1, user="bob", request_id="0")
    assert specs[2] == RequestSpec(3.0, 2, 1, request_id="2", extra_args={"deadline_s": 1.5, "slo": "gold"})
    out = tmp_path / "again.jsonl"
    save_trace(specs, out)
    assert load_trace(out) == specs


@pytest.mark.parametrize(("row", "message"), [
    ({"arrival_time": 0, "prompt_tokens": 5}, "missing key"),
    ({"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 2, "colour": 1}, "unknown key"),
    ({"arrival_time": 0, "prompt_tokens": "long", "output_tokens": 2}, "prompt_tokens must be"),
    ({"arrival_time": -1, "prompt_tokens": 5, "output_tokens": 2}, "arrival_time must be"),
    ({"arrival_time": 0, "prompt_tokens": 0, "output_tokens": 2}, "at least one prompt token"),
    ({"arrival_time": 0, "prompt_tokens": 1, "output_tokens": 2, "extra_args": {"d": [1]}}, "extra_args must be"),
    ({"arrival_time": 0, "prompt_tokens": 1, "output_tokens": 2, "extra_args": 3}, "extra_args must be"),
])
def test_bad_trace_lines_name_the_line(tmp_path: Path, row: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_time": 0, "prompt_tokens": 1, "output_tokens": 1}) + "\n" + json.dumps(row))
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        load_trace(path)
