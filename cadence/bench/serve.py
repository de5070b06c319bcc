"""``cadence bench serve``: a load generator for any OpenAI-compatible server, like ``vllm bench serve``.

Requests stream from ``/v1/completions`` or ``/v1/chat/completions`` with Poisson (or Gamma, with
``--burstiness``) arrivals at ``--request-rate``, or at the times a trace gives (``--dataset-name
trace``: its token-id prompts sent as ids, its priorities, users and ``extra_args`` with each
request), at most ``--max-concurrency`` in flight. Each
streamed chunk that carries tokens is timed (as vLLM's client does: text or not, but a chat stream's
role-only opening); the figures (TTFT, TPOT, ITL, E2E latency, throughput,
goodput) are computed by :mod:`cadence.bench.metrics` with vLLM's definitions, so they compare
number for number with vLLM's own benchmark against cadence, vLLM or llama.cpp's server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from tqdm import tqdm

from cadence.bench.datasets import (
    SHAREGPT_LIKE,
    BenchRequest,
    file_requests,
    length_mix_requests,
    prefix_repetition_requests,
    random_requests,
    text_of_length,
    trace_requests,
)
from cadence.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics, parse_goodput
from cadence.bench.server_counters import ServerCountersProbe
from cadence.sim.trace_formats import TraceOptions, add_trace_args

DEFAULT_NUM_PROMPTS = 64
_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class ServeTarget:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None
    ignore_eos: bool
    temperature: float = 0.0


def arrival_delays(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between sends: Gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson; inf rate is 0."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def arrival_offsets(requests: Sequence[BenchRequest], request_rate: float, burstiness: float,
                    seed: int) -> list[float]:
    """When to send each request, in seconds from the start: a trace's own times, else the sums of
    :func:`arrival_delays`."""
    if requests and requests[0].arrival_time is not None:
        return [r.arrival_time or 0.0 for r in requests]
    return list(itertools.accumulate(arrival_delays(len(requests), request_rate, burstiness, seed)))


def request_body(target: ServeTarget, request: BenchRequest, prompt: str | list[int]) -> dict[str, Any]:
    """The streaming request's JSON body; a trace's priority, user and extra_args go with it."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": target.temperature}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == _CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if request.priority:
        body["priority"] = request.priority
    if request.user is not None:
        body["user"] = request.user
    if request.extra_args:
        body["vllm_xargs"] = dict(request.extra_args)
    return body


async def _stream_one(session: aiohttp.ClientSession, target: ServeTarget, request: BenchRequest,
                      prompt: str | list[int]) -> RequestRecord:
    body = request_body(target, request, prompt)
    headers = auth_headers(target.api_key)
    sent = time.perf_counter()
    chunks: list[float] = []
    output_tokens = 0
    prompt_tokens = request.prompt_len

    def record(times: list[float], tokens: int, success: bool) -> RequestRecord:
        return RequestRecord(sent, times, prompt_tokens, tokens, success=success, user=request.user,
                             priority=request.priority)

    try:
        async with session.post(target.base_url + target.endpoint, json=body, headers=headers) as response:
            if response.status != 200:
                return record([], 0, False)
            async for event in _sse_events(response):
                if _carries_tokens(event):
                    chunks.append(time.perf_counter())
                usage = event.get("usage")
                if usage:
                    output_tokens = usage.get("completion_tokens", output_tokens)
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return record(chunks, 0, False)
    # Servers that send no usage: count one token per text chunk, as they stream per token.
    return record(chunks, output_tokens or len(chunks), bool(chunks))


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payload of each ``data:`` line of an SSE response, ``[DONE]`` included, until the body ends."""
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for data in sse_data(response):
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _carries_tokens(event: dict[str, Any]) -> bool:
    """Whether a streamed event brings generated tokens, as vLLM's client times them: any completion
    choice, with text or not (a token whose text a server holds back, a partial character, still has
    its chunk), and any chat delta but a role-only opening."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is None or "role" not in delta or delta.get("content"):
            return True
    return False


async def run_load(target: ServeTarget, requests: Sequence[BenchRequest], prompts: Sequence[str | list[int]], *,
                   request_rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                   show_progress: bool, probe: ServerCountersProbe | None = None
                   ) -> tuple[list[RequestRecord], float, float]:
    """Send every request on its schedule; returns the records and the run's start and end times.
    ``probe`` reads the server's counters once the untimed first request is done."""
    offsets = arrival_offsets(requests, request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), desc="Requests", unit="req", disable=not show_progress)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    records: list[RequestRecord] = []

    async def one(request: BenchRequest, prompt: str | list[int]) -> None:
        if limit is None:
            records.append(await _stream_one(session, target, request, prompt))
        else:
            async with limit:
                records.append(await _stream_one(session, target, request, prompt))
        progress.update(1)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # As vllm bench serve does: one untimed request first, so the figures measure a warm server
        # and a server that cannot answer at all fails loudly instead of reporting 100% failures.
        if requests and not (await _stream_one(session, target, requests[0], prompts[0])).success:
            raise RuntimeError(f"the initial test request to {target.base_url + target.endpoint} failed")
        if probe is not None:
            await probe.start()
        start = time.perf_counter()
        tasks = []
        for request, prompt, offset in zip(requests, prompts, offsets, strict=True):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(request, prompt)))
        await asyncio.gather(*tasks)
        end = time.perf_counter()
    progress.close()
    return records, start, end


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def model_card(base_url: str, api_key: str | None) -> dict[str, Any]:
    """The first model ``/v1/models`` lists (cadence's card also holds ``max_model_len``)."""
    async with aiohttp.ClientSession() as session, \
            session.get(base_url + "/v1/models", headers=auth_headers(api_key)) as r:
        r.raise_for_status()
        card: dict[str, Any] = (await r.json())["data"][0]
        return card


async def served_model(base_url: str, api_key: str | None) -> str:
    return str((await model_card(base_url, api_key))["id"])


def format_report(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    d = metrics.to_dict()
    lines = [f"{title:=^60}",
             f"{'Successful requests:':<40}{d['completed']:<10}",
             f"{'Failed requests:':<40}{d['failed']:<10}",
             f"{'Benchmark duration (s):':<40}{d['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{d['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{d['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{d['request_throughput']:<10.2f}",
             f"{'Output token throughput (tok/s):':<40}{d['output_throughput']:<10.2f}",
             f"{'Total token throughput (tok/s):':<40}{d['total_token_throughput']:<10.2f}"]
    if d["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{d['request_goodput']:<10.2f}")
    if metrics.prefix_cache_hit_rate is not None:
        lines.append(f"{'Prefix cache hit rate (%):':<40}{100 * metrics.prefix_cache_hit_rate:<10.2f}")
    if (spec := metrics.spec_decode) is not None:
        lines += [f"{'Speculative Decoding':-^60}",
                  f"{'Acceptance rate (%):':<40}{100 * spec.acceptance_rate:<10.2f}",
                  f"{'Acceptance length:':<40}{spec.acceptance_length:<10.2f}",
                  f"{'Drafts:':<40}{spec.drafts:<10}",
                  f"{'Draft tokens:':<40}{spec.draft_tokens:<10}",
                  f"{'Accepted tokens:':<40}{spec.accepted_tokens:<10}"]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^60}")
        for key, value in d.items():
            if key.endswith(f"_{name}_ms"):
                stat = key.removesuffix(f"_{name}_ms")
                lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{value:<10.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    parser.add_argument("--endpoint", default=_COMPLETIONS, choices=[_COMPLETIONS, _CHAT])
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--tokenizer", default=None,
                        help="model folder or .gguf whose tokenizer builds the prompts (default: SmolLM2)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 64; a trace: all)")
    parser.add_argument("--input-len", type=int, default=128, help="random dataset: mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (default 0: greedy; vLLM 0.32's client sends none, so its "
                             "requests sample at the server's default, 1)")
    parser.add_argument("--dataset-path", default=None,
                        help="ShareGPT .json or .jsonl of {prompt, output_len}; "
                             "with --dataset-name trace, a trace file (any format of --trace-format)")
    parser.add_argument("--dataset-name", default="random",
                        choices=["random", "sharegpt-like", "prefix-repetition", "trace"],
                        help="random (--input-len, --output-len, --range-ratio), "
                             f"sharegpt-like ({SHAREGPT_LIKE.describe()}), prefix-repetition (prompts sharing "
                             "prefixes: --prefix-repetition-*, --output-len), or trace: replay --dataset-path at "
                             "its own times, a cadence simulate trace (arrival_time, prompt_tokens as a count or "
                             "token ids, output_tokens, priority, user, extra_args per line) or Azure's, BurstGPT's "
                             "or Mooncake's (docs/research.md)")
    add_trace_args(parser.add_argument_group("trace (--dataset-name trace)"))
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=1024, help="tokens of each shared prefix")
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=64, help="distinct tokens after it")
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=1, help="prefixes the prompts share")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--metric-percentiles", default="50,99", help="comma-separated percentiles to report")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos so every request runs to max_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="write the figures to this file")
    parser.add_argument("--disable-tqdm", action="store_true")


def build_prompts(ns: argparse.Namespace) -> tuple[list[BenchRequest], list[str | list[int]]]:
    from cadence.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(ns.tokenizer))
    num = DEFAULT_NUM_PROMPTS if ns.num_prompts is None else ns.num_prompts
    if ns.dataset_name == "trace":
        requests = _trace(ns, tokenizer.vocab_size)
        if ns.endpoint == _COMPLETIONS:  # the trace's exact token ids
            return requests, [r.prompt for r in requests]
    elif ns.dataset_path:
        requests = file_requests(ns.dataset_path, tokenizer, num, ns.output_len, ns.seed)
    elif ns.dataset_name == "sharegpt-like":
        requests = length_mix_requests(num, SHAREGPT_LIKE, tokenizer.vocab_size, ns.seed)
    elif ns.dataset_name == "prefix-repetition":
        requests = prefix_repetition_requests(num, ns.prefix_repetition_prefix_len,
                                              ns.prefix_repetition_suffix_len, ns.prefix_repetition_num_prefixes,
                                              ns.output_len, tokenizer.vocab_size, ns.seed)
    else:
        requests = random_requests(num, ns.input_len, ns.output_len, ns.range_ratio, tokenizer.vocab_size, ns.seed)
    rng = random.Random(ns.seed)
    texts: list[str | list[int]] = [r.prompt if isinstance(r.prompt, str) else text_of_length(tokenizer, r.prompt, rng)
                                    for r in requests]
    return requests, texts


def _trace(ns: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """:raises ValueError: without a trace file, or with arrival options a trace's own times replace."""
    if not ns.dataset_path:
        raise ValueError("--dataset-name trace replays the trace file given as --dataset-path")
    if not math.isinf(ns.request_rate) or ns.burstiness != 1.0:
        raise ValueError("a trace's requests arrive at its own times: drop --request-rate and --burstiness "
                         "(--trace-time-scale speeds it up or slows it down)")
    return trace_requests(ns.dataset_path, TraceOptions.from_args(ns, vocab_size), vocab_size, ns.num_prompts)


def measure(ns: argparse.Namespace, requests: Sequence[BenchRequest] | None = None,
            prompts: Sequence[str | list[int]] | None = None) -> tuple[str, BenchmarkMetrics]:
    """Run the load ``ns`` describes against ``ns.base_url`` (``requests`` and their ``prompts`` when
    given, else those ``ns`` describes); returns the model name sent and the figures."""
    slos = parse_goodput(ns.goodput)
    percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
    if requests is None or prompts is None:
        requests, prompts = build_prompts(ns)
    base_url = ns.base_url.rstrip("/")
    model = ns.model or asyncio.run(served_model(base_url, ns.api_key))
    target = ServeTarget(base_url, ns.endpoint, model, ns.api_key, ns.ignore_eos, ns.temperature)
    probe = ServerCountersProbe(base_url, auth_headers(ns.api_key))

    async def load() -> tuple[list[RequestRecord], float, float]:
        records, start, end = await run_load(
            target, requests, prompts, request_rate=ns.request_rate, burstiness=ns.burstiness,
            max_concurrency=ns.max_concurrency, seed=ns.seed, show_progress=not ns.disable_tqdm, probe=probe)
        await probe.finish()
        return records, start, end

    records, start, end = asyncio.run(load())
    metrics = compute_metrics(records, start_time=start, end_time=end, goodput_slos_ms=slos, percentiles=percentiles)
    return model, replace(metrics, prefix_cache_hit_rate=probe.hit_rate(), spec_decode=probe.spec_decode())


def run(ns: argparse.Namespace) -> int:
    model, metrics = measure(ns)
    print(format_report(metrics))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"base_url": ns.base_url, "endpoint": ns.endpoint, "model": model,
                       "num_prompts": metrics.completed + metrics.failed, "request_rate": ns.request_rate,
                       "max_concurrency": ns.max_concurrency, **metrics.to_dict()}, f, indent=2)
    return 0 if metrics.completed else 1
