"""A server's prefix-cache hit rate over a benchmark run, from its Prometheus ``/metrics``.

cadence exports ``cadence:prefix_cache_queries`` and ``cadence:prefix_cache_hits`` (prompt tokens
looked up, and found), vLLM the same counters under ``vllm:``: the probe reads both names, summed
over engines, before the timed requests and after them. A server without them reports no rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_QUERIES, _HITS = "prefix_cache_queries", "prefix_cache_hits"


@dataclass(frozen=True)
class PrefixCacheCounts:
    """Prompt tokens looked up in the prefix cache, and found there, since the server started."""

    queries: float
    hits: float


def parse_counts(text: str) -> PrefixCacheCounts | None:
    """The counters in a ``/metrics`` page (any ``prefix:`` namespace), or None where it has neither."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.rpartition(":")[2]
        if family.type == "counter" and name in (_QUERIES, _HITS):
            totals[name] = totals.get(name, 0.0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
    if _QUERIES not in totals or _HITS not in totals:
        return None
    return PrefixCacheCounts(totals[_QUERIES], totals[_HITS])


class PrefixCacheProbe:
    """Reads the counters at :meth:`start` and again at :meth:`hit_rate`."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self._url = base_url.rstrip("/") + "/metrics"
        self._headers = headers
        self._before: PrefixCacheCounts | None = None

    async def _read(self) -> PrefixCacheCounts | None:
        try:
            async with aiohttp.ClientSession() as session, session.get(self._url, headers=self._headers) as r:
                return parse_counts(await r.text()) if r.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def start(self) -> None:
        self._before = await self._read()

    async def hit_rate(self) -> float | None:
        """Hits over queries since :meth:`start`; None without counters or without lookups."""
        after = await self._read()
        if self._before is None or after is None or after.queries <= self._before.queries:
            return None
        return (after.hits - self._before.hits) / (after.queries - self._before.queries)
