"""A server's own counters over a benchmark run, from its Prometheus ``/metrics``: the prefix-cache
hit rate and speculative decoding's acceptance.

cadence exports ``cadence:prefix_cache_queries`` and ``cadence:prefix_cache_hits`` (prompt tokens
looked up, and found) and ``cadence:spec_decode_num_drafts``, ``..._num_draft_tokens`` and
``..._num_accepted_tokens``; vLLM the same counters under ``vllm:``. The probe reads both names,
summed over engines, before the timed requests and after them. A server without them reports none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ServerCounts:
    """The counters since the server started (0 where it does not export one)."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    spec_decode_num_drafts: float = 0.0
    spec_decode_num_draft_tokens: float = 0.0
    spec_decode_num_accepted_tokens: float = 0.0


@dataclass(frozen=True)
class SpecDecodeFigures:
    """Speculative decoding over the timed requests, as vLLM's benchmark reports it."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens."""
        return self.accepted_tokens / self.draft_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens a verification emits on average: its accepted drafts and the one it samples."""
        return 1 + self.accepted_tokens / self.drafts


_NAMES = [f.name for f in fields(ServerCounts)]  # in field order


def parse_counts(text: str) -> ServerCounts | None:
    """The counters in a ``/metrics`` page (any ``prefix:`` namespace), or None where it has none."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.rpartition(":")[2]
        if family.type == "counter" and name in _NAMES:
            totals[name] = totals.get(name, 0.0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
    return ServerCounts(**totals) if totals else None


class ServerCountersProbe:
    """Reads the counters at :meth:`start`, and again at :meth:`finish`."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self._url = base_url.rstrip("/") + "/metrics"
        self._headers = headers
        self._before: ServerCounts | None = None
        self._after: ServerCounts | None = None

    async def _read(self) -> ServerCounts | None:
        try:
            async with aiohttp.ClientSession() as session, session.get(self._url, headers=self._headers) as r:
                return parse_counts(await r.text()) if r.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def start(self) -> None:
        self._before = await self._read()

    async def finish(self) -> None:
        self._after = await self._read()

    def _delta(self) -> ServerCounts | None:
        """What each counter rose by between :meth:`start` and :meth:`finish`; None without counters."""
        before, after = self._before, self._after
        if before is None or after is None:
            return None
        return ServerCounts(*(getattr(after, name) - getattr(before, name) for name in _NAMES))

    def hit_rate(self) -> float | None:
        """Hits over queries between :meth:`start` and :meth:`finish`; None without counters or lookups."""
        delta = self._delta()
        if delta is None or delta.prefix_cache_queries <= 0:
            return None
        return delta.prefix_cache_hits / delta.prefix_cache_queries

    def spec_decode(self) -> SpecDecodeFigures | None:
        """Drafts verified between :meth:`start` and :meth:`finish`; None where none were."""
        delta = self._delta()
        if delta is None or delta.spec_decode_num_draft_tokens <= 0:
            return None
        return SpecDecodeFigures(int(delta.spec_decode_num_drafts), int(delta.spec_decode_num_draft_tokens),
                                 int(delta.spec_decode_num_accepted_tokens))
