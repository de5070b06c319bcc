"""The soak's verdict, as pure functions: each process's RSS growth after the warm-up, whether the
engine is idle after the drain, and the failures that make the run fail."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cadence.bench.soak.outcome import KindStats

MIB = 1024 * 1024


def warmup_seconds(run_s: float) -> float:
    """The warm-up: 20% of the run, at least a minute, but never more than half of it."""
    return max(0.2 * run_s, min(60.0, 0.5 * run_s))


@dataclass(frozen=True)
class Growth:
    """One process's RSS from the end of the warm-up to the end of the load (bytes)."""

    process: str
    baseline: float | None
    final: float | None
    limit: float
    samples: int
    window: int
    judged: bool
    note: str = ""

    @property
    def growth(self) -> float | None:
        return None if self.baseline is None or self.final is None else self.final - self.baseline

    @property
    def ok(self) -> bool:
        return not self.judged or (self.growth is not None and self.growth <= self.limit)


def judge_rss_growth(series: Sequence[tuple[float, float]], warmup_end: float, end: float, limit: float, *,
                     process: str = "", min_samples: int = 4) -> Growth:
    """Compare the median of the first ``w`` samples in [warmup_end, end] with the median of the last ``w``.

    ``series``: ``(t, rss)`` pairs. ``w`` is 5% of those samples, at least 5 and at most half of them,
    so a spike (or two) at either end moves neither median. Fewer than ``min_samples`` samples: not
    judged (``ok``), with a note.
    """
    after = sorted((t, v) for t, v in series if warmup_end <= t <= end)
    if len(after) < min_samples:
        return Growth(process, None, None, limit, len(after), 0, judged=False,
                      note=f"{len(after)} samples after the warm-up: not judged")
    window = min(max(5, round(0.05 * len(after))), len(after) // 2)
    values = [v for _, v in after]
    baseline = statistics.median(values[:window])
    final = statistics.median(values[-window:])
    return Growth(process, baseline, final, limit, len(after), window, judged=True)


def theil_sen_slope(series: Sequence[tuple[float, float]], max_points: int = 400) -> float | None:
    """The median of pairwise slopes (units per second): a trend that outliers do not move. Informative."""
    points = sorted(series)
    if len(points) > max_points:
        step = len(points) / max_points
        points = [points[int(i * step)] for i in range(max_points)]
    slopes = [(v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:] if t2 > t1]
    return statistics.median(slopes) if slopes else None


def check_idle(metrics: dict[str, dict[str, float]]) -> list[str]:
    """Why the engine is not idle (empty when it is): for each engine, nothing running, waiting or
    pending, KV usage 0 and every block free (cached-but-free blocks count as free).

    ``metrics``: ``probe.parse_metrics``'s ``{name: {labels: value}}``."""
    usage = metrics.get("cadence:kv_cache_usage_perc")
    if not usage:
        return ["no cadence:kv_cache_usage_perc in /metrics"]
    problems = []
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_pending"):
        for key, value in sorted(metrics.get(f"cadence:{name}", {}).items()):
            if value != 0:
                problems.append(f"{name} = {value:g} ({key})")
    blocks, free = metrics.get("cadence:kv_cache_num_blocks", {}), metrics.get("cadence:kv_cache_free_blocks", {})
    for key, value in sorted(usage.items()):
        if value > 1e-9:
            problems.append(f"kv_cache_usage_perc = {value:.4f} ({key})")
        if key in blocks and key in free and free[key] != blocks[key]:
            problems.append(f"{blocks[key] - free[key]:g} of {blocks[key]:g} KV blocks not free ({key})")
    return problems


def verdict(growths: Sequence[Growth], table: dict[str, KindStats], lost_reasons: Counter[str],
            idle_problems: Sequence[str], server_problems: Sequence[str]) -> list[str]:
    """The failures (empty: the soak passed)."""
    failures = [f"RSS of {g.process} grew {g.growth / MIB:.1f} MiB after the warm-up (bound {g.limit / MIB:.0f} MiB)"
                for g in growths if not g.ok and g.growth is not None]
    total = table.get("all", KindStats())
    if total.lost:
        top = "; ".join(f"{n}x {reason}" for reason, n in lost_reasons.most_common(5))
        failures.append(f"{total.lost} of {total.sent} requests lost: {top}")
    if total.sent == 0:
        failures.append("no request was sent")
    if idle_problems:
        failures.append("engine not idle after the drain (KV pool, queues): " + "; ".join(idle_problems))
    failures.extend(server_problems)
    return failures
