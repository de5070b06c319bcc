"""One soak run against a server: the clients send until the time is up while a sampler reads RSS and
/metrics (and says how it goes), then the wait for the engine to drain to idle."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from cadence.bench.serve import auth_headers, model_card
from cadence.bench.soak.load import Spec, build_spec, max_prompt_words, parse_mix, random_text, send
from cadence.bench.soak.outcome import ABANDONED, COMPLETED, LOST, Outcome, classify
from cadence.bench.soak.probe import Metrics, Samples, fetch_metrics, gauge, process_tree_rss, sample_once
from cadence.bench.soak.verdict import MIB, check_idle, warmup_seconds


@dataclass
class Result:
    load_s: float  # until the last request ended
    sending_s: float  # until the clients stopped sending new ones
    warmup_s: float
    outcomes: list[Outcome]
    samples: Samples
    before: Metrics | None  # /metrics before the load
    end_of_load: Metrics | None
    drained: Metrics | None  # /metrics after the drain
    drain_s: float
    idle_problems: list[str]
    after_drain_rss: dict[str, int]
    server_died: bool = False


class StreamTiming:
    """Time to first token and per later token of recent completed one-choice streams: when a cancel's
    request would be generating."""

    def __init__(self) -> None:
        self._recent: list[tuple[float, float]] = []

    def add(self, spec: Spec, outcome: Outcome) -> None:
        if spec.stream and spec.n == 1 and outcome.status == COMPLETED and outcome.ttft_s is not None \
                and outcome.tokens >= 8:
            per_token = (outcome.latency_s - outcome.ttft_s) / (outcome.tokens - 1)
            self._recent = [*self._recent[-49:], (outcome.ttft_s, per_token)]

    def window(self, tokens: int, at_most: float) -> tuple[float, float]:
        if not self._recent:
            return 0.5, 5.0
        first = statistics.median(t for t, _ in self._recent)
        return min(first, at_most), min(first + statistics.median(p for _, p in self._recent) * tokens, at_most)


async def _model_info(base_url: str, api_key: str | None) -> tuple[str | None, int | None]:
    """The served model's name and context length (cadence's ``max_model_len``), where /v1/models says."""
    try:
        card = await model_card(base_url, api_key)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None, None
    context = card.get("max_model_len")
    return str(card["id"]), context if isinstance(context, int) else None


async def run_soak(ns: argparse.Namespace, base_url: str, pid: int | None,
                   server_alive: Callable[[], bool]) -> Result:
    headers = auth_headers(ns.api_key)
    samples = Samples()
    outcomes: list[Outcome] = []
    timing = StreamTiming()
    run_s = ns.minutes * 60
    warmup_s = ns.warmup_s if ns.warmup_s is not None else warmup_seconds(run_s)
    master = random.Random(ns.seed)
    kinds, weights = zip(*parse_mix(ns.mix), strict=True)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=ns.concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            aiohttp.ClientSession() as probe:
        model, context = await _model_info(base_url, ns.api_key)
        max_words = max_prompt_words(context, ns.long_max_tokens)
        prefixes = [random_text(master, min(900, max_words // 2)) for _ in range(2)]
        before = await fetch_metrics(probe, base_url)
        start = time.monotonic()
        deadline = start + run_s

        async def client(i: int) -> None:
            rng = random.Random(f"{ns.seed}-{i}")
            while time.monotonic() < deadline and not stop.is_set():
                kind = rng.choices(kinds, weights)[0]
                spec = build_spec(kind, rng, model=model, prefixes=prefixes, long_max=ns.long_max_tokens,
                                  cancel_window=timing.window(ns.long_max_tokens, 0.9 * ns.hang_guard_s),
                                  max_words=max_words)
                outcome = classify(spec, await send(session, base_url, spec, ns.hang_guard_s, headers))
                outcomes.append(outcome)
                timing.add(spec, outcome)

        async def sampler() -> None:
            last_report = time.monotonic()
            while True:
                now = time.monotonic()
                metrics = await sample_once(probe, base_url, pid, now - start, samples)
                if not server_alive():
                    print("the server exited during the run: stopping the load", flush=True)
                    stop.set()
                    return
                if now - last_report >= ns.report_every_s:
                    last_report = now
                    counts = Counter(o.status for o in outcomes)
                    rss = {name: series[-1][1] for name, series in samples.rss.items() if series[-1][0] == now - start}
                    print(f"[{now - start:6.0f} s] sent {len(outcomes)}: {counts[COMPLETED]} completed, "
                          f"{counts[ABANDONED]} abandoned, {counts[LOST]} lost | KV "
                          f"{gauge(metrics, 'kv_cache_usage_perc'):.2f}, running "
                          f"{gauge(metrics, 'num_requests_running'):g}, waiting "
                          f"{gauge(metrics, 'num_requests_waiting'):g} | RSS "
                          + ", ".join(f"{name} {v / MIB:.0f} MiB" for name, v in rss.items()), flush=True)
                await asyncio.sleep(max(0.0, ns.sample_interval_s - (time.monotonic() - now)))

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client(i) for i in range(ns.concurrency)))
        load_s = time.monotonic() - start
        sending_s = min(load_s, run_s)
        end_of_load = await fetch_metrics(probe, base_url)
        print(f"stopped sending at {sending_s:.0f} s; the last request ended at {load_s:.0f} s ({len(outcomes)} "
              "requests); waiting for the drain", flush=True)
        drain_start = time.monotonic()
        drained, idle_problems = None, ["no /metrics answer"]
        while time.monotonic() - drain_start < ns.drain_timeout_s and server_alive():
            drained = await fetch_metrics(probe, base_url)
            idle_problems = check_idle(drained) if drained is not None else ["no /metrics answer"]
            if not idle_problems:
                break
            await asyncio.sleep(0.5)
        drain_s = time.monotonic() - drain_start
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    after_drain = process_tree_rss(pid) if pid is not None else {}
    return Result(load_s, sending_s, warmup_s, outcomes, samples, before, end_of_load, drained, drain_s, idle_problems,
                  after_drain, server_died=stop.is_set())
