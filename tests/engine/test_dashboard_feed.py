"""``engine/dashboard_feed.py``: requests' phases, engine states, and the windows of a snapshot, on a
clock the test gives (exact values)."""

from __future__ import annotations

import pytest

from cadence.engine.dashboard_feed import DashboardFeed, EngineSample
from cadence.messages import SchedulerStats


def sample(running: int = 0, waiting: int = 0, kv: float = 0.0, queries: int = 0, hits: int = 0,
           preemptions: int = 0) -> EngineSample:
    return EngineSample(running, waiting, kv, queries, hits, preemptions)


def test_a_request_goes_through_its_phases() -> None:
    feed = DashboardFeed()
    feed.arrived("a", 10.0)
    feed.started("a", 0.5)
    feed.tokens("a", 11.0, 1)
    feed.preempted("a", 12.0)
    feed.tokens("a", 13.5, 2)
    feed.finished("a", 14.0, "length")
    [row] = feed.snapshot(14.0)["timeline"]
    assert row == {"id": "a", "arrival": 10.0, "reason": "length", "preemptions": 1,
                   "spans": [["waiting", 10.0, 10.5], ["prefill", 10.5, 11.0], ["decode", 11.0, 12.0],
                             ["preempted", 12.0, 13.5], ["decode", 13.5, 14.0]]}


def test_a_second_preemption_before_a_token_is_counted_in_the_same_span() -> None:
    feed = DashboardFeed()
    feed.arrived("a", 0.0)
    feed.tokens("a", 1.0, 1)
    feed.preempted("a", 2.0)
    feed.preempted("a", 3.0)  # recomputed, then preempted again before its next token
    feed.tokens("a", 4.0, 1)
    [row] = feed.snapshot(4.0)["timeline"]
    assert row["preemptions"] == 2
    assert row["spans"] == [["waiting", 0.0, 1.0], ["decode", 1.0, 2.0], ["preempted", 2.0, 4.0],
                            ["decode", 4.0, None]]


def test_a_start_heard_after_a_preemption_goes_before_it() -> None:
    # A request preempted in its prefill: the server hears of the preemption first, then of the
    # first step with the first tokens.
    feed = DashboardFeed()
    feed.arrived("a", 0.0)
    feed.preempted("a", 2.0)
    feed.started("a", 1.0)
    feed.tokens("a", 3.0, 1)
    assert feed.snapshot(3.0)["timeline"][0]["spans"] == [["waiting", 0.0, 1.0], ["prefill", 1.0, 2.0],
                                                          ["preempted", 2.0, 3.0], ["decode", 3.0, None]]


def test_an_unfinished_phase_has_no_end_and_a_repeated_phase_is_one_span() -> None:
    feed = DashboardFeed()
    feed.arrived("a", 0.0)
    feed.started("a", 1.0)
    feed.started("a", 2.0)  # the first step counts
    feed.tokens("a", 3.0, 1)
    feed.tokens("a", 4.0, 1)
    assert feed.snapshot(5.0)["timeline"][0]["spans"] == [["waiting", 0.0, 1.0], ["prefill", 1.0, 3.0],
                                                          ["decode", 3.0, None]]


def test_latencies_and_tokens_per_second_over_their_windows() -> None:
    feed = DashboardFeed(window_s=10.0, rate_s=2.0)
    feed.arrived("a", 0.0)
    feed.tokens("a", 0.1, 1)  # TTFT 100 ms
    feed.arrived("b", 5.0)
    feed.tokens("b", 5.3, 1)  # TTFT 300 ms
    feed.tokens("a", 5.6, 4)  # ITL 5.5 s, four tokens (accepted drafts)
    feed.tokens("b", 5.8, 1)  # ITL 500 ms
    snap = feed.snapshot(6.0)
    assert snap["ttft"] == {"n": 2, "p50": pytest.approx(200.0), "p90": pytest.approx(280.0),
                            "p99": pytest.approx(298.0)}
    assert snap["itl"]["n"] == 2 and snap["itl"]["p50"] == pytest.approx(3000.0)
    assert snap["tokens_per_s"] == pytest.approx((1 + 4 + 1) / 2.0)  # those of the last 2 s
    assert snap["output_tokens"] == 7
    later = feed.snapshot(10.2)  # a's first token left the 10 s window
    assert later["ttft"]["n"] == 1 and later["ttft"]["p50"] == pytest.approx(300.0)
    assert later["tokens_per_s"] == 0.0
    assert feed.snapshot(100.0)["ttft"] == {"n": 0, "p50": None, "p90": None, "p99": None}


def test_engine_states_are_summed_and_the_prefix_hit_rate_is_the_window_s() -> None:
    feed = DashboardFeed(num_engines=2, window_s=10.0)
    assert feed.snapshot(0.0)["prefix_hit_rate"] is None
    feed.engine(0, 1.0, sample(running=3, waiting=1, kv=0.5, queries=100, hits=50, preemptions=1))
    snap = feed.snapshot(1.0)
    assert (snap["running"], snap["waiting"], snap["kv_usage"], snap["preemptions"]) == (3, 1, 0.5, 1)
    assert snap["engines"] == [{"running": 3, "waiting": 1, "kv_usage": 0.5}, None]
    assert snap["prefix_hit_rate"] == 0.5  # counted from the start: the window began before them
    feed.engine(1, 2.0, sample(running=2, kv=0.75, queries=100, hits=100))
    snap = feed.snapshot(2.0)
    assert (snap["running"], snap["kv_usage"], snap["prefix_hit_rate"]) == (5, 0.75, 0.75)
    feed.engine(0, 15.0, sample(queries=200, hits=50))  # 100 looked up since the window began, none found
    assert feed.snapshot(15.0)["prefix_hit_rate"] == 0.0
    assert feed.snapshot(30.0)["prefix_hit_rate"] is None  # nothing looked up within the window


def test_an_engine_sample_of_scheduler_stats() -> None:
    stats = SchedulerStats(num_running=2, num_waiting=3, kv_cache_usage=0.25, num_free_blocks=1, num_blocks=4,
                           prefix_cache_queries=7, prefix_cache_hits=5, num_preemptions=1)
    assert EngineSample.of(stats) == sample(2, 3, 0.25, 7, 5, 1)


def test_the_timeline_shows_the_latest_arrivals_and_old_finished_requests_are_forgotten() -> None:
    feed = DashboardFeed(timeline_requests=3)
    feed.arrived("slow", 0.0)  # never finishes: kept
    for i in range(10):
        feed.arrived(str(i), float(i + 1))
        feed.finished(str(i), float(i + 1), "stop")
    assert [row["id"] for row in feed.snapshot(11.0)["timeline"]] == ["7", "8", "9"]
    assert feed.num_requests == 11 and feed.snapshot(11.0)["finished"] == 10
    assert len(feed._lives) <= 2 * 3 and "slow" in feed._lives
    feed.tokens("slow", 12.0, 1)
    assert feed.snapshot(12.0)["output_tokens"] == 1


def test_unknown_requests_and_a_second_finish_change_nothing() -> None:
    feed = DashboardFeed()
    feed.started("x", 1.0)
    feed.tokens("x", 1.0, 3)
    feed.preempted("x", 1.0)
    feed.finished("x", 1.0, "stop")
    feed.arrived("a", 0.0)
    feed.finished("a", 1.0, "abort")
    feed.finished("a", 2.0, "stop")
    snap = feed.snapshot(3.0)
    assert (snap["output_tokens"], snap["finished"]) == (0, 1)
    assert snap["timeline"][0]["reason"] == "abort"


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        DashboardFeed(window_s=0)
