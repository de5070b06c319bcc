"""The soak's report: the tables printed at the end of a run, its failures, and the JSON summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from cadence.bench.metrics import percentile
from cadence.bench.soak.outcome import ABANDONED, COMPLETED, LOST, KindStats, account
from cadence.bench.soak.probe import gauge
from cadence.bench.soak.run import Result
from cadence.bench.soak.verdict import MIB, judge_rss_growth, theil_sen_slope, verdict


def _mib(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value / MIB:+.1f}" if signed else f"{value / MIB:.1f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(base_url: str, result: Result, server_problems: list[str], *, concurrency: int,
           max_rss_growth_mib: float, local: bool) -> tuple[list[str], dict[str, Any]]:
    """Print the tables; return the failures and a JSON summary."""
    table = account(result.outcomes)
    lost_reasons = Counter(o.reason for o in result.outcomes if o.status == LOST)
    abandon_reasons = Counter(o.reason.split(" after")[0] for o in result.outcomes if o.status == ABANDONED)
    print(f"\n== soak of {base_url}: {concurrency} clients sent for {result.sending_s:.0f} s, the last request "
          f"ended at {result.load_s:.0f} s; warm-up {result.warmup_s:.0f} s; drain {result.drain_s:.1f} s ==\n")
    print(f"{'kind':<18}{'sent':>7}{'completed':>11}{'abandoned':>11}{'lost':>6}{'tokens':>9}{'p50 s':>8}{'p99 s':>8}")
    for kind, s in table.items():
        print(f"{kind:<18}{s.sent:>7}{s.completed:>11}{s.abandoned:>11}{s.lost:>6}{s.tokens:>9}"
              f"{_seconds(percentile(s.latencies, 50)):>8}{_seconds(percentile(s.latencies, 99)):>8}")
    total = table.get("all", KindStats())
    completed_tokens = sum(o.tokens for o in result.outcomes if o.status == COMPLETED)
    ttfts = [o.ttft_s for o in result.outcomes if o.ttft_s is not None and o.status == COMPLETED]
    print(f"\nabandoned on purpose: {dict(abandon_reasons) or 'none'}")
    print(f"tokens/s: {completed_tokens / result.load_s:.1f} (completed requests, by usage) ", end="")
    server_tokens = None
    if result.before and result.end_of_load:
        server_tokens = (gauge(result.end_of_load, "generation_tokens_total")
                         - gauge(result.before, "generation_tokens_total"))
        print(f"| {server_tokens / result.load_s:.1f} (server's generation_tokens_total, abandoned included)")
    else:
        print()
    print(f"latency of completed requests: p50 {_seconds(percentile(total.latencies, 50))} s, "
          f"p99 {_seconds(percentile(total.latencies, 99))} s; streams' TTFT p50 {_seconds(percentile(ttfts, 50))} s,"
          f" p99 {_seconds(percentile(ttfts, 99))} s")

    limit = max_rss_growth_mib * MIB
    growths = []
    if not local:
        print("\nRSS: not measured (--base-url: this script cannot see that server's processes)")
    else:
        print(f"\n{'process':<26}{'warm-up end':>12}{'end of load':>12}{'growth':>9}{'bound':>7}{'after drain':>12}"
              f"{'trend MiB/min':>15}  samples (window)")
        for name, series in result.samples.rss.items():
            g = judge_rss_growth(series, result.warmup_s, result.load_s, limit, process=name)
            growths.append(g)
            slope = theil_sen_slope([(t, v) for t, v in series if result.warmup_s <= t <= result.load_s])
            trend = "-" if slope is None else f"{slope * 60 / MIB:+.2f}"
            print(f"{name:<26}{_mib(g.baseline):>12}{_mib(g.final):>12}{_mib(g.growth, True):>9}"
                  f"{max_rss_growth_mib:>7g}{_mib(result.after_drain_rss.get(name)):>12}{trend:>15}"
                  f"  {g.samples} ({g.window}){'  ' + g.note if g.note else ''}")
        print("(MiB; warm-up end and end of load: medians of the first and last samples after the warm-up)")

    metrics = result.drained or {}
    peak = max((gauge(m, "kv_cache_usage_perc") for _, m in result.samples.metrics), default=None)
    queries = gauge(metrics, "prefix_cache_queries_total")
    hits = gauge(metrics, "prefix_cache_hits_total")
    print(f"\nKV at the end: usage {gauge(metrics, 'kv_cache_usage_perc'):.4f}, running "
          f"{gauge(metrics, 'num_requests_running'):g}, waiting {gauge(metrics, 'num_requests_waiting'):g}, "
          f"pending {gauge(metrics, 'num_requests_pending'):g}, free blocks "
          f"{gauge(metrics, 'kv_cache_free_blocks'):g} of {gauge(metrics, 'kv_cache_num_blocks'):g}; "
          f"peak usage {'-' if peak is None else f'{peak:.2f}'}; prefix-cache hit rate "
          f"{hits / queries if queries else 0:.0%}; preemptions {gauge(metrics, 'num_preemptions_total'):g}")
    before = (result.before or {}).get("cadence:request_success_total", {})
    finished = {key.removeprefix("finished_reason="): int(v - before.get(key, 0))
                for key, v in metrics.get("cadence:request_success_total", {}).items()}
    print(f"server's sequences finished during the soak, by reason: {finished or '-'}; /metrics failures: "
          f"{result.samples.metrics_failures}")
    if lost_reasons:
        print("lost requests:")
        for reason, n in lost_reasons.most_common(10):
            print(f"  {n} x {reason}")

    failures = verdict(growths, table, lost_reasons, result.idle_problems, server_problems)
    summary = {
        "load_s": result.load_s, "warmup_s": result.warmup_s, "drain_s": result.drain_s,
        "kinds": {k: {**asdict(s), "latencies": None, "p50_s": percentile(s.latencies, 50),
                      "p99_s": percentile(s.latencies, 99)} for k, s in table.items()},
        "lost_reasons": dict(lost_reasons), "completed_tokens_per_s": completed_tokens / result.load_s,
        "server_generation_tokens": server_tokens, "rss": [asdict(g) for g in growths],
        "rss_series": result.samples.rss, "kv_at_end": metrics.get("cadence:kv_cache_usage_perc"),
        "idle_problems": result.idle_problems, "failures": failures,
    }
    return failures, summary
