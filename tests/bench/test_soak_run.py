"""The soak end to end, without a model: ``cadence bench soak --base-url`` against a scripted
OpenAI-style server (every request kind, streams, /metrics), its verdict and exit status; the report
on synthetic RSS series; and ``benchmarks/soak.py`` as the same command.

``tests/bench/test_soak.py`` covers the judging functions one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import pytest

from cadence.bench.cli import register
from cadence.bench.soak import cli as soak_cli
from cadence.bench.soak.outcome import COMPLETED, Outcome
from cadence.bench.soak.probe import Samples, parse_metrics
from cadence.bench.soak.report import report
from cadence.bench.soak.run import Result

MIB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]
_PERSON = '{"name": "Ann", "age": 3, "city": "Oslo"}'


def _metrics_text(running: int, generated: int) -> str:
    gauges = {"num_requests_running": running, "num_requests_waiting": 0, "num_requests_pending": 0,
              "kv_cache_usage_perc": 0.25 * running, "kv_cache_num_blocks": 100, "kv_cache_free_blocks": 100 - running}
    lines = [f'cadence:{name}{{engine="0",model_name="m"}} {value}' for name, value in gauges.items()]
    return "\n".join([*lines, "# TYPE cadence:generation_tokens counter",
                      f'cadence:generation_tokens_total{{model_name="m"}} {generated}', ""])


def scripted_server(*, fail_seeded: bool = False, busy: bool = False) -> aiohttp.web.Application:
    """Valid answers to every kind the soak sends (JSON where a schema is asked for, logprobs where
    asked, up to 6 tokens a choice); with ``fail_seeded``, HTTP 500 to requests with a ``seed``; with
    ``busy``, /metrics never idle. Requests with ``ignore_eos`` (the soak's cancels) take 3 s."""
    generated = 0

    async def generate(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        nonlocal generated
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        if fail_seeded and "seed" in body:
            error = {"message": "scripted", "type": "server_error", "param": None, "code": "internal_error"}
            return aiohttp.web.json_response({"error": error}, status=500)
        for _ in range(60 if body.get("ignore_eos") else 0):  # until the client gives up
            if request.transport is None or request.transport.is_closing():
                return aiohttp.web.Response()
            await asyncio.sleep(0.05)
        n, max_tokens = body.get("n", 1), body["max_tokens"]
        if "response_format" in body:
            pieces, reason = [_PERSON[:12], _PERSON[12:]], "stop"
        else:
            pieces = [f"t{i} " for i in range(min(max_tokens, 6))]
            reason = "length" if len(pieces) == max_tokens else "stop"
        generated += n * len(pieces)
        asked = body.get("logprobs", False) is not False  # a completion's logprobs=0 asks too
        logprobs: dict[str, Any] | None = {"content": []} if asked else None
        usage = {"prompt_tokens": 3, "completion_tokens": n * len(pieces), "total_tokens": 3 + n * len(pieces)}

        def choice(i: int, text: str, finish: str | None, streamed: bool) -> dict[str, Any]:
            part = {"content": text} if streamed else {"role": "assistant", "content": text}
            return {"index": i, "finish_reason": finish, "logprobs": logprobs,
                    **({"delta" if streamed else "message": part} if chat else {"text": text})}

        if not body.get("stream"):
            choices = [choice(i, "".join(pieces), reason, False) for i in range(n)]
            return aiohttp.web.json_response({"choices": choices, "usage": usage})
        events: list[dict[str, Any]] = [{"choices": [choice(i, piece, None, True) for i in range(n)]}
                                        for piece in pieces]
        events.append({"choices": [choice(i, "", reason, True) for i in range(n)]})
        if body.get("stream_options", {}).get("include_usage"):
            events.append({"choices": [], "usage": usage})
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for event in [*map(json.dumps, events), "[DONE]"]:
                await response.write(f"data: {event}\n\n".encode())
                await asyncio.sleep(0.002)
        except ConnectionResetError:  # the soak's disconnects
            pass
        return response

    async def models(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 2048}]})

    async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=_metrics_text(1 if busy else 0, generated))

    app = aiohttp.web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


def soak_args(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test")
    register(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(["bench", "soak", *args])


def _soak(url: str, *extra: str) -> int:
    ns = soak_args("--base-url", url + "/", "--minutes", "0.03", "--concurrency", "4", "--sample-interval-s",
                   "0.1", "--report-every-s", "0.5", *extra)
    return int(ns.run(ns))


def test_the_verb_takes_the_scripts_flags() -> None:
    ns = soak_args("--minutes", "0.5", "--mix", "cancel=0", "--server-arg=--max-num-seqs 4", "--server-arg=-q")
    assert (ns.bench, ns.run) == ("soak", soak_cli.run)
    assert (ns.minutes, ns.mix, ns.server_arg, ns.concurrency, ns.max_rss_growth_mib, ns.warmup_s) == (
        0.5, "cancel=0", ["--max-num-seqs 4", "-q"], 16, 64.0, None)


def test_a_soak_of_a_healthy_server_passes(run_app: Callable[[aiohttp.web.Application], str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    url = run_app(scripted_server())
    assert _soak(url, "--output-json", str(tmp_path / "soak.json")) == 0
    out = capsys.readouterr().out
    assert "RSS is not measured" in out and "] sent " in out and out.rstrip().endswith("PASS")
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["failures"] == [] and summary["lost_reasons"] == {}
    kinds = summary["kinds"]
    assert kinds["all"]["sent"] == kinds["all"]["completed"] + kinds["all"]["abandoned"] > 10
    assert kinds["all"]["lost"] == 0 and kinds["all"]["p50_s"] is not None
    assert summary["server_generation_tokens"] > 0 and summary["kv_at_end"] == {"engine=0": 0.0}


def test_lost_requests_and_a_busy_engine_fail(run_app: Callable[[aiohttp.web.Application], str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    url = run_app(scripted_server(fail_seeded=True, busy=True))
    assert _soak(url, "--drain-timeout-s", "0.3", "--mix", "cancel=0,disconnect=0") == 1
    out = capsys.readouterr().out
    assert "HTTP 500 (internal_error)" in out and "FAIL:" in out
    assert "requests lost: " in out and "num_requests_running = 1 (engine=0)" in out


def test_the_report_judges_each_process_rss(capsys: pytest.CaptureFixture[str]) -> None:
    samples = Samples(rss={"api (1)": [(t, 300.0 * MIB) for t in range(100)],
                           "core (2)": [(t, (300.0 + t) * MIB) for t in range(100)]})
    idle = parse_metrics(_metrics_text(0, 10))
    result = Result(load_s=100.0, sending_s=99.0, warmup_s=20.0, outcomes=[Outcome("chat", COMPLETED, "", 4, 1.0)],
                    samples=samples, before=parse_metrics(_metrics_text(0, 0)), end_of_load=idle, drained=idle,
                    drain_s=0.5, idle_problems=[], after_drain_rss={"api (1)": 300 * MIB})
    failures, summary = report("http://x", result, [], concurrency=2, max_rss_growth_mib=64, local=True)
    assert len(failures) == 1 and failures[0].startswith("RSS of core (2) grew 75.0 MiB")
    assert [g["process"] for g in summary["rss"]] == ["api (1)", "core (2)"]
    assert summary["server_generation_tokens"] == 10
    out = capsys.readouterr().out
    assert "+60.00" in out  # core's trend, MiB per minute
    assert "0.1 (server's generation_tokens_total" in out


def test_the_script_is_the_same_command() -> None:
    done = subprocess.run([sys.executable, "benchmarks/soak.py", "--mix", "nope=1"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--mix: 'nope=1' is not KIND=WEIGHT" in done.stderr
