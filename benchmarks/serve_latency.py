"""Streaming latency of ``cadence serve`` under a fixed number of concurrent clients.

Starts a server (SmolLM2-135M-Instruct in bf16 unless told otherwise; or use ``--url`` for one
already running), keeps ``--concurrency`` streaming completions in flight until ``--num-requests``
have finished, and reports TTFT and inter-token latency (p50/p99, per streamed chunk) and output
tokens/s (usage's completion tokens over the wall time). A benchmark, never a test.

    python benchmarks/serve_latency.py [--concurrency 32 --num-requests 128 --max-tokens 128]
    python benchmarks/serve_latency.py --url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

PROMPTS = [
    "Explain how a paged KV cache works in an LLM inference server.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "List some tips for learning a new programming language quickly.",
    "Describe the water cycle to a ten-year-old.",
    "Why is the sky blue? Give a detailed answer.",
    "Summarise the causes of the French Revolution.",
    "How does continuous batching improve the throughput of a language model server?",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
                      ) -> tuple[float, list[float], int]:
    """(TTFT, gaps between chunks, completion tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - sent, gaps, tokens


async def run(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> dict[str, float]:
    queue = list(range(num_requests))
    ttfts: list[float] = []
    itls: list[float] = []
    total_tokens = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal total_tokens
        while queue:
            i = queue.pop()
            ttft, gaps, tokens = await one_request(session, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)
            ttfts.append(ttft)
            itls.extend(gaps)
            total_tokens += tokens

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one_request(session, url, model, PROMPTS[0], 8)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "requests": num_requests, "concurrency": concurrency, "wall_s": wall,
        "output_tokens": total_tokens, "output_tokens_per_s": total_tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * statistics.median(itls), "itl_p99_ms": 1000 * percentile(itls, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model path to serve (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `cadence serve` flag; repeatable")
    ns = parser.parse_args()

    from cadence.api.server import default_model_name
    from cadence.api.testing import ServerProcess

    model = default_model_name(ns.model)
    if ns.url is not None:
        results = asyncio.run(run(ns.url, model, ns.concurrency, ns.num_requests, ns.max_tokens))
    else:
        args = ["--dtype", ns.dtype, *(["--model", ns.model] if ns.model else []), *ns.server_arg]
        log = Path(tempfile.mkdtemp()) / "server.log"
        with ServerProcess(args, log_path=log) as server:
            results = asyncio.run(run(server.url, model, ns.concurrency, ns.num_requests, ns.max_tokens))
    for key, value in results.items():
        print(f"{key:>22}: {value:.1f}" if isinstance(value, float) else f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
