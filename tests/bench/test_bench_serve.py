"""The serving load generator against a scripted OpenAI-style SSE server on 127.0.0.1, its
workloads, and the prefix-cache hit rate it reads from a server (the scripted one, and cadence's)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.sse_server import HITS_PER_REPLY, PROMPT_TOKENS, TOKENS_PER_REPLY

from cadence.bench.cli import register
from cadence.bench.datasets import (
    SHAREGPT_LIKE,
    BenchRequest,
    length_mix_requests,
    prefix_repetition_requests,
    random_requests,
    text_of_length,
    trace_requests,
)
from cadence.bench.metrics import compute_metrics
from cadence.bench.serve import (
    ServeTarget,
    arrival_delays,
    arrival_offsets,
    build_prompts,
    format_report,
    measure,
    request_body,
    run_load,
)
from cadence.bench.server_counters import ServerCounts, parse_counts
from cadence.sim.trace_formats import TraceOptions


def _serve_args(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test")
    register(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(["bench", "serve", "--disable-tqdm", *args])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_records_every_streamed_chunk_and_counts_failures(server: str, endpoint: str) -> None:
    """Every token's chunk is timed, the one without text too (vLLM's client times it), but not a
    chat stream's role-only opening."""
    target = ServeTarget(server, endpoint, "m", None, ignore_eos=True)
    requests = [BenchRequest([1, 2], 2, 5)] * 6
    prompts = ["hello"] * 5 + ["fail"]
    records, start, end = asyncio.run(run_load(target, requests, prompts, request_rate=math.inf, burstiness=1.0,
                                               max_concurrency=3, seed=0, show_progress=False))
    metrics = compute_metrics(records, start_time=start, end_time=end, percentiles=[50])
    assert (metrics.completed, metrics.failed) == (5, 1)
    assert metrics.total_output_tokens == 5 * TOKENS_PER_REPLY
    assert metrics.total_input_tokens == 5 * 7  # from the server's usage
    ok = [r for r in records if r.completed]
    assert all(len(r.chunk_times) == TOKENS_PER_REPLY for r in ok)
    assert all(r.arrival_time < r.chunk_times[0] and list(r.chunk_times) == sorted(r.chunk_times) for r in ok)
    assert len(metrics_itls := [gap for r in ok for gap in r.itls]) == 5 * (TOKENS_PER_REPLY - 1)
    assert all(gap > 0 for gap in metrics_itls)


def test_poisson_and_gamma_arrivals_have_the_asked_rate() -> None:
    for burstiness in (1.0, 0.25, 4.0):
        delays = arrival_delays(20000, request_rate=8.0, burstiness=burstiness, seed=1)
        assert statistics.fmean(delays) == pytest.approx(1 / 8.0, rel=0.05)
        # Gamma(k, theta): variance k * theta^2 = mean^2 / k, so the CV is 1 / sqrt(k).
        cv = statistics.pstdev(delays) / statistics.fmean(delays)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_an_initial_untimed_request_must_succeed_first(server: str) -> None:
    target = ServeTarget(server, "/v1/completions", "m", None, ignore_eos=True)
    with pytest.raises(RuntimeError, match="initial test request"):
        asyncio.run(run_load(target, [BenchRequest([1, 2], 2, 5)] * 2, ["fail", "hello"], request_rate=math.inf,
                             burstiness=1.0, max_concurrency=None, seed=0, show_progress=False))


def test_prefix_repetition_prompts_share_their_prefixes_and_differ_after() -> None:
    requests = prefix_repetition_requests(6, prefix_len=20, suffix_len=5, num_prefixes=2, output_len=9,
                                          vocab_size=1000, seed=3)
    prompts = [list(r.prompt) for r in requests]
    assert all(len(p) == 25 for p in prompts)
    assert all(r.prompt_len == 25 and r.output_len == 9 for r in requests)
    assert prompts[0][:20] == prompts[2][:20] == prompts[4][:20] != prompts[1][:20] == prompts[3][:20]
    assert len({tuple(p[20:]) for p in prompts}) == 6
    assert prompts == [list(r.prompt) for r in prefix_repetition_requests(6, 20, 5, 2, 9, 1000, seed=3)]


def test_prompt_texts_encode_to_their_lengths_as_vllms_client_makes_them(smollm2_tokenizer: Any) -> None:
    """Random token ids decoded to text encode back to more tokens (SmolLM2: 128 -> 128-139), which
    spilled a burst of prompts into one prefill step more than vLLM's client sends. Each workload's
    texts now encode to their requests' lengths, and prompts that share a prefix still share its text."""
    tokenizer = smollm2_tokenizer
    vocab = tokenizer.vocab_size
    requests = [*random_requests(24, 128, 8, 0.0, vocab, seed=0), *length_mix_requests(8, SHAREGPT_LIKE, vocab, 1),
                *prefix_repetition_requests(6, prefix_len=200, suffix_len=30, num_prefixes=2, output_len=8,
                                            vocab_size=vocab, seed=2)]

    def length(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert sum(length(tokenizer.decode(r.prompt)) != r.prompt_len for r in requests) > len(requests) // 2
    texts = [text_of_length(tokenizer, list(r.prompt), random.Random(i)) for i, r in enumerate(requests)]
    assert [length(text) for text in texts] == [r.prompt_len for r in requests]
    shared = [texts[-6:][i::2] for i in range(2)]  # prefix_repetition_requests alternates its prefixes
    for group, other in zip(shared, reversed(shared), strict=True):
        head = len(tokenizer.decode(list(requests[-6].prompt)[:190]))
        assert len({text[:head] for text in group}) == 1 and group[0][:head] != other[0][:head]


def test_the_counters_parse_under_either_servers_names() -> None:
    page = """# TYPE cadence:prefix_cache_queries_total counter
cadence:prefix_cache_queries_total{engine="0",model_name="m"} 5.0
cadence:prefix_cache_queries_total{engine="1",model_name="m"} 7.0
# TYPE cadence:prefix_cache_hits_total counter
cadence:prefix_cache_hits_total{engine="0",model_name="m"} 3.0
"""
    assert parse_counts(page) == ServerCounts(prefix_cache_queries=12.0, prefix_cache_hits=3.0)
    assert parse_counts(page.replace("cadence:", "vllm:")) == ServerCounts(12.0, 3.0)
    assert parse_counts("# TYPE other_total counter\nother_total 1.0\n") is None


def test_the_hit_rate_covers_the_timed_requests_only(server: str) -> None:
    """The scripted server's first reply (the untimed one) finds nothing cached, the four timed ones
    find HITS_PER_REPLY tokens each: counting the first would lower the rate."""
    _, metrics = measure(_serve_args("--base-url", server, "--model", "m"), [BenchRequest([1, 2], 2, 5)] * 4,
                         ["hello"] * 4)
    assert metrics.prefix_cache_hit_rate == HITS_PER_REPLY / PROMPT_TOKENS
    assert metrics.to_dict()["prefix_cache_hit_rate"] == HITS_PER_REPLY / PROMPT_TOKENS
    assert "Prefix cache hit rate (%):" in format_report(metrics)


def test_a_cadence_server_reports_its_prefix_cache_hits(
        serve_tiny: Callable[..., contextlib.AbstractContextManager[Any]],
        make_tiny_model: Callable[..., Path]) -> None:
    """Six prompts sharing a 64-token prefix, after an untimed one with the same prefix: most of each
    prompt is found in the cache (its full 16-token blocks of the prefix)."""
    args = ["--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "64",
            "--prefix-repetition-suffix-len", "8", "--num-prompts", "6", "--output-len", "4", "--ignore-eos",
            "--tokenizer", str(make_tiny_model("llama"))]
    with serve_tiny() as process:
        _, metrics = measure(_serve_args("--base-url", process.url, *args))
    assert metrics.completed == 6 and metrics.prefix_cache_hit_rate is not None
    assert 0.5 < metrics.prefix_cache_hit_rate < 1.0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_cadence_server_reports_its_speculative_decoding(
        serve_tiny: Callable[..., contextlib.AbstractContextManager[Any]],
        make_tiny_model: Callable[..., Path], method: str) -> None:
    """``serve --speculative-config``: the tiny model's greedy loops are drafted (by n-gram lookups, or
    by the model itself as its own draft model), and the benchmark reports the drafts the server's
    /metrics counted over the timed requests."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram"
                      else {"method": "draft_model", "model": str(make_tiny_model("llama")),
                            "num_speculative_tokens": 3})
    args = ["--dataset-name", "random", "--input-len", "16", "--output-len", "48", "--num-prompts", "4",
            "--ignore-eos", "--max-concurrency", "1", "--tokenizer", str(make_tiny_model("llama"))]
    with serve_tiny("--speculative-config", spec) as process:
        _, metrics = measure(_serve_args("--base-url", process.url, *args))
        page = urllib.request.urlopen(process.url + "/metrics").read().decode()
    spec_decode = metrics.spec_decode
    assert metrics.completed == 4 and spec_decode is not None
    assert 0 < spec_decode.accepted_tokens <= spec_decode.draft_tokens <= 3 * spec_decode.drafts
    assert metrics.total_output_tokens == 4 * 48  # every emitted token reached the client
    assert "Acceptance rate (%):" in format_report(metrics)
    counts = parse_counts(page)
    assert counts is not None and counts.spec_decode_num_accepted_tokens >= spec_decode.accepted_tokens
    assert 'cadence:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in page


def test_a_trace_replays_at_its_own_times_with_its_token_ids_and_fields(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_time": 12.0, "prompt_tokens": 3, "output_tokens": 2, "priority": 2},
            {"arrival_time": 10.0, "prompt_tokens": [7, 8, 9, 10], "output_tokens": 5, "user": "ann",
             "extra_args": {"deadline_s": 1.5}},
            {"arrival_time": 13.0, "prompt_tokens": 1, "output_tokens": 1}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    requests = trace_requests(path, TraceOptions(time_scale=0.5, seed=1), vocab_size=500)
    assert [r.arrival_time for r in requests] == [0.0, 1.0, 1.5]  # from the first, scaled
    assert arrival_offsets(requests, math.inf, 1.0, 0) == [0.0, 1.0, 1.5]
    first, second, _ = requests
    assert (first.prompt, first.output_len, first.user, first.extra_args) == ([7, 8, 9, 10], 5, "ann",
                                                                               {"deadline_s": 1.5})
    assert len(second.prompt) == 3 and all(100 <= t < 500 for t in second.prompt) and second.priority == 2
    assert [r.prompt for r in trace_requests(path, TraceOptions(seed=1), 500, num=2)] == [
        r.prompt for r in requests[:2]]
    target = ServeTarget("http://h", "/v1/completions", "m", None, ignore_eos=False)
    assert request_body(target, first, first.prompt) == {
        "model": "m", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.0, "prompt": [7, 8, 9, 10], "user": "ann", "vllm_xargs": {"deadline_s": 1.5}}
    assert request_body(target, second, "text")["priority"] == 2
    hot = ServeTarget("http://h", "/v1/completions", "m", None, ignore_eos=False, temperature=1.0)
    assert request_body(hot, second, "text")["temperature"] == 1.0
    # Synthetic arrivals: the running sums of the gaps.
    gaps = arrival_delays(3, 4.0, 1.0, seed=2)
    assert arrival_offsets([BenchRequest([1], 1, 1)] * 3, 4.0, 1.0, 2) == [gaps[0], gaps[0] + gaps[1], sum(gaps)]


def test_a_trace_needs_its_file_and_keeps_its_own_arrivals(tmp_path: Path,
                                                           make_tiny_model: Callable[..., Path]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"arrival_time": 0, "prompt_tokens": [5, 6], "output_tokens": 1}) + "\n")
    tokenizer = str(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="--dataset-path"):
        build_prompts(_serve_args("--dataset-name", "trace", "--tokenizer", tokenizer))
    with pytest.raises(ValueError, match="drop --request-rate"):
        build_prompts(_serve_args("--dataset-name", "trace", "--dataset-path", str(path), "--request-rate", "3",
                                  "--tokenizer", tokenizer))
    _, prompts = build_prompts(_serve_args("--dataset-name", "trace", "--dataset-path", str(path),
                                           "--tokenizer", tokenizer))
    assert prompts == [[5, 6]]  # token ids, as they are, to /v1/completions
    _, prompts = build_prompts(_serve_args("--dataset-name", "trace", "--dataset-path", str(path),
                                           "--tokenizer", tokenizer, "--endpoint", "/v1/chat/completions"))
    assert isinstance(prompts[0], str)  # chat takes text
