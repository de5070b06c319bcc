"""Serving-benchmark metrics over per-request records, with ``vllm bench serve``'s definitions.

A request's record holds when it was sent, when each streamed chunk that carried tokens arrived,
and how many tokens it produced. From those, as vLLM computes them:

- TTFT: first chunk - sent.
- E2E latency (``e2el``): last chunk - sent (the stream ends with the last chunk).
- TPOT: ``(e2el - ttft) / (output_tokens - 1)``, only for requests with more than one output token
  (goodput counts a single-token request's TPOT as 0).
- ITL: the gaps between consecutive chunks of a request, pooled over all requests.
- Throughputs divide totals by the benchmark's duration: from its start (the first request's
  send time unless given) to the last chunk of any request.
- Goodput: completed requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el``
  in milliseconds, a request is good when each of its metrics is ``<=`` the SLO).

Times are in seconds in the records and in milliseconds in the results (vLLM's ``*_ms`` keys).
Both the simulator and the serving load generator compute their figures here.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cadence.bench.server_counters import SpecDecodeFigures

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (99.0,)


@dataclass(frozen=True)
class RequestRecord:
    """What a client saw of one request. ``chunk_times`` are absolute times (seconds) of each
    streamed chunk that carried output tokens; the first is the first token."""

    arrival_time: float
    chunk_times: Sequence[float]
    prompt_tokens: int
    output_tokens: int
    success: bool = True
    request_id: str = ""
    user: str | None = None
    priority: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.arrival_time

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.arrival_time

    @property
    def finish_time(self) -> float:
        return self.chunk_times[-1]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; ``None`` with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [times[i] - times[i - 1] for i in range(1, len(times))]

    @property
    def completed(self) -> bool:
        return self.success and len(self.chunk_times) > 0


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's and vLLM's); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


@dataclass(frozen=True)
class LatencyStats:
    """mean / median / std and the chosen percentiles of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float] | np.ndarray, percentiles: Iterable[float]) -> LatencyStats:
        # vLLM reports 0 for a metric with no samples (np.mean(xs or 0)).
        values = np.asarray(seconds, dtype=np.float64) * 1000.0 if len(seconds) else np.zeros(1)
        percentiles = tuple(percentiles)
        mean, std = float(values.mean()), float(values.std())  # before the partitions reorder the values
        # ``values`` is this call's own array: partitioned in place, not copied (a simulation's hundred
        # million gaps), and every percentile in one call. Order statistics do not depend on the order.
        median = float(np.median(values, overwrite_input=True))
        ranks = np.percentile(values, percentiles, overwrite_input=True).tolist() if percentiles else []
        return cls(mean=mean, median=median, std=std, percentiles=dict(zip(percentiles, ranks, strict=True)))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    # Prompt tokens found in the server's prefix cache over the timed requests, and its drafts verified,
    # from its /metrics (bench/server_counters.py); None where the server does not export the counters.
    prefix_cache_hit_rate: float | None = None
    spec_decode: SpecDecodeFigures | None = None

    def to_dict(self) -> dict[str, Any]:
        """Flat, with vLLM's result keys (``mean_ttft_ms``, ``p99_itl_ms`` ...)."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "duration": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "request_goodput": self.request_goodput,
        }
        if self.goodput_slos_ms:
            out["goodput_slos_ms"] = dict(self.goodput_slos_ms)
        if self.prefix_cache_hit_rate is not None:
            out["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        if (spec := self.spec_decode) is not None:
            out.update(spec_decode_acceptance_rate=spec.acceptance_rate,
                       spec_decode_acceptance_length=spec.acceptance_length, spec_decode_num_drafts=spec.drafts,
                       spec_decode_num_draft_tokens=spec.draft_tokens,
                       spec_decode_num_accepted_tokens=spec.accepted_tokens)
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            out[f"mean_{name}_ms"] = stats.mean
            out[f"median_{name}_ms"] = stats.median
            out[f"std_{name}_ms"] = stats.std
            for p, value in stats.percentiles.items():
                out[f"p{_percentile_label(p)}_{name}_ms"] = value
        return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    :raises ValueError: for an unknown metric, a missing ``:``, or a negative or non-numeric value.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {item!r}: the value must be a finite number >= 0")
        slos[name] = ms
    return slos


def compute_metrics(
    records: Sequence[RequestRecord],
    *,
    start_time: float | None = None,
    end_time: float | None = None,
    goodput_slos_ms: Mapping[str, float] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """The benchmark's figures over ``records``.

    The duration runs from ``start_time`` (default: the earliest arrival) to ``end_time``
    (default: the last chunk of any completed request).
    """
    percentiles = tuple(percentiles)
    done = [r for r in records if r.completed]
    ttfts = [r.ttft for r in done]
    e2els = [r.e2el for r in done]
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = inter_token_gaps(done)
    if start_time is None:
        start_time = min((r.arrival_time for r in records), default=0.0)
    if end_time is None:
        end_time = max((r.finish_time for r in done), default=start_time)
    duration = end_time - start_time
    rate = 1.0 / duration if duration > 0 else 0.0
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    slos = dict(goodput_slos_ms or {})
    goodput = None
    if slos:
        goodput = sum(1 for r in done if _is_good(r, slos)) * rate
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        duration_s=duration,
        request_throughput=len(done) * rate,
        output_throughput=total_output * rate,
        total_token_throughput=(total_input + total_output) * rate,
        request_goodput=goodput,
        ttft=LatencyStats.of(ttfts, percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of(itls, percentiles),
        e2el=LatencyStats.of(e2els, percentiles),
        goodput_slos_ms=slos,
    )


def inter_token_gaps(records: Iterable[RequestRecord]) -> np.ndarray:
    """Every record's :attr:`RequestRecord.itls`, as one array (a simulation can hold a hundred million).

    The records' times are joined and differenced at once, and the differences that span two records
    dropped (an ``np.diff`` a record cost more than the rest of its metrics)."""
    times = [r.chunk_times for r in records]
    if not times:
        return np.zeros(0)
    doubles = [t for t in times if isinstance(t, array) and t.typecode == "d"]
    if len(doubles) == len(times):  # the simulator's: joined as bytes
        joined = np.frombuffer(b"".join(doubles), dtype=np.float64)
    else:
        joined = np.concatenate([np.asarray(t, dtype=np.float64) for t in times])
    lengths = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
    starts = lengths.cumsum() - lengths
    first = np.zeros(len(joined), dtype=bool)  # each record's first time
    first[starts[lengths > 0]] = True
    return np.diff(joined)[~first[1:]]


def _is_good(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] <= ms / 1000.0 for name, ms in slos_ms.items())


@dataclass(frozen=True)
class TenantShare:
    """One user's part of the served work."""

    user: str
    requests: int
    input_tokens: int
    output_tokens: int
    output_share: float  # of all output tokens served
    mean_ttft_ms: float
    mean_e2el_ms: float


def tenant_shares(records: Sequence[RequestRecord]) -> list[TenantShare]:
    """Per user (``None`` counts as ``"-"``), sorted by name, over completed requests."""
    by_user: dict[str, list[RequestRecord]] = {}
    for record in records:
        if record.completed:
            by_user.setdefault(record.user or "-", []).append(record)
    total_output = sum(r.output_tokens for rs in by_user.values() for r in rs) or 1
    return [
        TenantShare(
            user=user,
            requests=len(rs),
            input_tokens=sum(r.prompt_tokens for r in rs),
            output_tokens=sum(r.output_tokens for r in rs),
            output_share=sum(r.output_tokens for r in rs) / total_output,
            mean_ttft_ms=1000.0 * float(np.mean([r.ttft for r in rs])),
            mean_e2el_ms=1000.0 * float(np.mean([r.e2el for r in rs])),
        )
        for user, rs in sorted(by_user.items())
    ]


def _percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)
