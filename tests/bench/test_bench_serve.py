"""The serving load generator against a scripted OpenAI-style SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest
from support.sse_server import TOKENS_PER_REPLY

from cadence.bench.datasets import BenchRequest
from cadence.bench.metrics import compute_metrics
from cadence.bench.serve import ServeTarget, arrival_delays, run_load


def test_records_every_streamed_chunk_and_counts_failures(server: str) -> None:
    target = ServeTarget(server, "/v1/completions", "m", None, ignore_eos=True)
    requests = [BenchRequest([1, 2], 2, 5)] * 6
    prompts = ["hello"] * 5 + ["fail"]
    records, start, end = asyncio.run(run_load(target, requests, prompts, request_rate=math.inf, burstiness=1.0,
                                               max_concurrency=3, seed=0, show_progress=False))
    metrics = compute_metrics(records, start_time=start, end_time=end, percentiles=[50])
    assert (metrics.completed, metrics.failed) == (5, 1)
    assert metrics.total_output_tokens == 5 * TOKENS_PER_REPLY
    assert metrics.total_input_tokens == 5 * 7  # from the server's usage
    ok = [r for r in records if r.completed]
    assert all(len(r.chunk_times) == TOKENS_PER_REPLY for r in ok)
    assert all(r.arrival_time < r.chunk_times[0] and list(r.chunk_times) == sorted(r.chunk_times) for r in ok)
    assert len(metrics_itls := [gap for r in ok for gap in r.itls]) == 5 * (TOKENS_PER_REPLY - 1)
    assert all(gap > 0 for gap in metrics_itls)


def test_poisson_and_gamma_arrivals_have_the_asked_rate() -> None:
    for burstiness in (1.0, 0.25, 4.0):
        delays = arrival_delays(20000, request_rate=8.0, burstiness=burstiness, seed=1)
        assert statistics.fmean(delays) == pytest.approx(1 / 8.0, rel=0.05)
        # Gamma(k, theta): variance k * theta^2 = mean^2 / k, so the CV is 1 / sqrt(k).
        cv = statistics.pstdev(delays) / statistics.fmean(delays)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_an_initial_untimed_request_must_succeed_first(server: str) -> None:
    target = ServeTarget(server, "/v1/completions", "m", None, ignore_eos=True)
    with pytest.raises(RuntimeError, match="initial test request"):
        asyncio.run(run_load(target, [BenchRequest([1, 2], 2, 5)] * 2, ["fail", "hello"], request_rate=math.inf,
                             burstiness=1.0, max_concurrency=None, seed=0, show_progress=False))
