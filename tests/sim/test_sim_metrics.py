"""Serving metrics on hand-made records: vLLM ``bench serve``'s definitions, exact values."""

from __future__ import annotations

from array import array
from dataclasses import replace

import numpy as np
import pytest

from cadence.bench.metrics import (
    LatencyStats,
    RequestRecord,
    compute_metrics,
    inter_token_gaps,
    parse_goodput,
    tenant_shares,
)

# A: four tokens in four chunks. B: a single token. C: three tokens, two of them in one chunk.
# D: failed before any token.
A = RequestRecord(arrival_time=0.0, chunk_times=[1.0, 1.5, 2.0, 3.0], prompt_tokens=10, output_tokens=4, user="x")
B = RequestRecord(arrival_time=1.0, chunk_times=[1.5], prompt_tokens=20, output_tokens=1, user="y")
C = RequestRecord(arrival_time=2.0, chunk_times=[4.0, 5.0], prompt_tokens=30, output_tokens=3, user="x")
D = RequestRecord(arrival_time=2.5, chunk_times=[], prompt_tokens=5, output_tokens=0, success=False)


def test_per_request_definitions() -> None:
    assert (A.ttft, A.e2el, A.itls) == (1.0, 3.0, [0.5, 0.5, 1.0])
    assert A.tpot == pytest.approx(2.0 / 3)  # (e2el - ttft) / (output_tokens - 1)
    assert B.tpot is None and B.itls == []
    assert C.tpot == pytest.approx(0.5)  # per token, though ITL is per chunk
    assert C.itls == [1.0]
    assert not D.completed


def test_inter_token_gaps_are_each_records_own_in_order() -> None:
    # Joined and differenced at once: no gap spans two records, whatever their lengths (none, one)
    # and whether their times are a list or the simulator's doubles.
    doubles = RequestRecord(arrival_time=6.0, chunk_times=array("d", [7.0, 7.25, 9.0]), prompt_tokens=1,
                            output_tokens=3)
    records = [D, A, B, D, C, doubles, B]
    gaps = inter_token_gaps(records)
    assert gaps.dtype == np.float64
    assert gaps.tolist() == [gap for r in records for gap in r.itls] == [0.5, 0.5, 1.0, 1.0, 0.25, 1.75]
    as_doubles = [replace(r, chunk_times=array("d", r.chunk_times)) for r in records]  # joined as bytes
    assert inter_token_gaps(as_doubles).tolist() == gaps.tolist()
    assert inter_token_gaps([B, D]).tolist() == [] and inter_token_gaps([]).tolist() == []


def test_latency_percentiles_are_numpys_each_alone() -> None:
    values = np.random.default_rng(0).lognormal(sigma=3.0, size=1001)  # wide: a sum's rounding follows the order
    given = values.copy()
    stats = LatencyStats.of(values, (50, 90, 99.9))
    assert stats.percentiles == {p: float(np.percentile(values * 1000.0, p)) for p in (50, 90, 99.9)}
    assert stats.median == float(np.median(values * 1000.0)) and LatencyStats.of(values, ()).percentiles == {}
    # The mean and spread as numpy sums them in the given order; the caller's array left as it was.
    assert (stats.mean, stats.std) == (float((values * 1000.0).mean()), float((values * 1000.0).std()))
    assert np.array_equal(values, given)


def test_aggregate_metrics() -> None:
    m = compute_metrics([A, B, C, D], percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)
    assert m.duration_s == 5.0  # first arrival to last chunk
    assert m.request_throughput == pytest.approx(3 / 5)
    assert m.output_throughput == pytest.approx(8 / 5)
    assert m.total_token_throughput == pytest.approx(68 / 5)
    assert m.request_goodput is None
    assert m.ttft.mean == pytest.approx(3500 / 3)
    assert m.ttft.median == pytest.approx(1000)
    assert m.tpot.mean == pytest.approx((2000 / 3 + 500) / 2)
    assert m.itl.mean == pytest.approx(750)
    assert m.itl.percentiles[99] == pytest.approx(1000)
    assert m.e2el.median == pytest.approx(3000)
    assert m.e2el.std == pytest.approx(1178.5113, rel=1e-6)
    flat = m.to_dict()
    assert flat["median_ttft_ms"] == pytest.approx(1000)
    assert flat["p99_itl_ms"] == pytest.approx(1000)
    assert flat["p50_e2el_ms"] == pytest.approx(3000)


def test_goodput_counts_requests_that_meet_every_slo() -> None:
    # A misses TPOT (667 ms), C misses TTFT (2 s); B's single token counts as TPOT 0.
    m = compute_metrics([A, B, C, D], goodput_slos_ms=parse_goodput(["ttft:1500", "tpot:550"]))
    assert m.request_goodput == pytest.approx(1 / 5)
    # An SLO equal to the value is met.
    assert compute_metrics([A, B, C], goodput_slos_ms={"e2el": 3000}).request_goodput == pytest.approx(3 / 5)


def test_explicit_window_and_empty_input() -> None:
    m = compute_metrics([A], start_time=-1.0, end_time=4.0)
    assert m.duration_s == 5.0 and m.request_throughput == pytest.approx(0.2)
    empty = compute_metrics([])
    assert empty.completed == 0 and empty.ttft.mean == 0.0 and empty.request_throughput == 0.0


@pytest.mark.parametrize("bad", ["ttft", "speed:10", "ttft:-1", "tpot:fast", "e2el:inf"])
def test_parse_goodput_rejects_bad_slos(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput SLO"):
        parse_goodput([bad])


def test_tenant_shares() -> None:
    shares = {s.user: s for s in tenant_shares([A, B, C, D])}
    assert set(shares) == {"x", "y"}
    assert shares["x"].requests == 2 and shares["x"].output_tokens == 7
    assert shares["x"].output_share == pytest.approx(7 / 8)
    assert shares["y"].mean_ttft_ms == pytest.approx(500)
