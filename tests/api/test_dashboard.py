"""``serve --dashboard`` (``api/dashboard.py``): a real server of the tiny model with a KV pool small
enough to preempt, loaded by concurrent requests. Its event stream is checked against what the
requests got and ``/metrics`` says; the page is checked in headless Chromium while a load runs."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.browser import chromium_page
from support.tiny_models import TINY_VOCAB

from cadence.api.dashboard import render_page
from cadence.api.testing import ServerProcess

KEY = "dashboard-test-key"
MAX_TOKENS = 120
# Patience for a server that does its work (not a speed bound): the events come once a second.
PATIENCE_S = 120.0


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., contextlib.AbstractContextManager[Any]]) -> Iterator[ServerProcess]:
    # 24 blocks of 16 tokens: eight of these requests are admitted at once (3 blocks each), two fit at
    # their end (10 blocks each): the rest are preempted.
    with serve_tiny("--dashboard", "--num-kv-blocks", "24", "--api-key", KEY) as process:
        yield process


AUTH = {"Authorization": f"Bearer {KEY}"}


def complete(server: ServerProcess, model: str, seed: int) -> dict[str, Any]:
    prompt = random.Random(seed).choices(range(3, TINY_VOCAB), k=40)
    response = httpx.post(f"{server.url}/v1/completions", timeout=PATIENCE_S, headers=AUTH,
                          json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "ignore_eos": True})
    response.raise_for_status()
    return dict(response.json())


def load(server: ServerProcess, seeds: range) -> Future[list[dict[str, Any]]]:
    """The requests, sent at once from threads; the future of their responses."""
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    responses: Future[list[dict[str, Any]]] = Future()

    def run() -> None:
        try:
            with ThreadPoolExecutor(len(seeds)) as pool:
                responses.set_result(list(pool.map(lambda seed: complete(server, model, seed), seeds)))
        except BaseException as exc:
            responses.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return responses


def events(server: ServerProcess) -> Iterator[tuple[str, Any]]:
    """The dashboard's events (name, data), from the start of the stream (no API key: it is open)."""
    with httpx.stream("GET", f"{server.url}/dashboard/events", timeout=PATIENCE_S) as response:
        assert response.headers["content-type"] == "text/event-stream"
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                yield name or "", json.loads(line.removeprefix("data: "))


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"cadence:{name}{{"))


def test_the_event_stream_tells_each_requests_story(server: ServerProcess) -> None:
    stream = events(server)
    name, history = next(stream)
    assert name == "history" and isinstance(history, list)
    responses = load(server, range(12))
    for name, snap in stream:
        assert name == "snapshot"
        if snap["finished"] == 12 or (responses.done() and responses.exception() is not None):
            break
    done = responses.result()
    assert (snap["requests"], snap["running"], snap["waiting"]) == (12, 0, 0)
    assert snap["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in done) == 12 * MAX_TOKENS
    assert snap["ttft"]["n"] == 12 and snap["ttft"]["p50"] <= snap["ttft"]["p99"]
    rows = snap["timeline"]
    assert len({row["id"] for row in rows}) == 12
    for row in rows:
        phases = [span[0] for span in row["spans"]]
        assert row["reason"] == "length"
        assert phases[:2] == ["waiting", "prefill"] and phases[-1] == "decode", row
        assert row["spans"][0][1] == row["arrival"]
        assert all(a[2] == b[1] for a, b in pairwise(row["spans"]))  # one after another
    # The preemptions /metrics counts are the dashboard's, and each shows in its request's timeline.
    preemptions = metric(server, "num_preemptions_total")
    assert preemptions > 0 and snap["preemptions"] == preemptions
    # A resumed request's own blocks are not prompt tokens found in the cache.
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] <= r["usage"]["prompt_tokens"] for r in done)
    # Each preemption is in its request's row; one span holds those that came before its next token.
    assert sum(row["preemptions"] for row in rows) == preemptions
    assert all(("preempted" in [s[0] for s in row["spans"]]) == (row["preemptions"] > 0) for row in rows)


def test_the_page_updates_while_a_load_runs(server: ServerProcess, tmp_path: Path) -> None:
    with chromium_page() as page:
        page.goto(f"{server.url}/dashboard")  # no API key needed, as for /metrics
        assert page.inner_text("#mode") == "live"
        page.wait_for_function("() => +document.getElementById('updates').textContent >= 2", timeout=PATIENCE_S * 1000)
        before = int(page.inner_text("#requests").split(" / ")[1])
        responses = load(server, range(100, 108))
        # While the load runs, tokens come out and the page shows them.
        page.wait_for_function("() => parseFloat(document.getElementById('tps').textContent) > 0",
                               timeout=PATIENCE_S * 1000)
        assert len(responses.result()) == 8
        total = before + 8
        page.wait_for_function(f"() => document.getElementById('requests').textContent === '{total} / {total}'",
                               timeout=PATIENCE_S * 1000)
        assert page.locator("#chart-tps polyline").count() == 1
        assert page.locator("#chart-latency polyline").count() == 4
        assert page.locator("#timeline rect.phase-decode").count() >= 8
        assert page.inner_text("#running") == "0"
        shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert shot.startswith(b"\x89PNG")


def test_the_dashboard_is_only_served_when_asked(serve_tiny: Callable[..., contextlib.AbstractContextManager[Any]],
                                                 server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the key guards the rest
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '"live": true' in page.text
    with serve_tiny() as plain:
        missing = httpx.get(f"{plain.url}/dashboard")
        assert missing.status_code == 404 and "/dashboard" in missing.json()["error"]["message"]


def test_the_page_data_cannot_end_its_script_early() -> None:
    meta = {"model": "</script><script>alert(1)</script>", "policy": "fcfs", "engines": 1}
    html = render_page({"meta": meta, "live": False, "snapshots": []})
    data = html.split('<script id="dashboard-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["meta"] == meta
