"""``cadence bench`` (``cadence/bench/cli.py``) and its offline sub-verb (``cadence/bench/throughput.py``):
the verbs parse, the workloads load from the random and the file datasets with exact counts and
lengths, and a run on the tiny model reports the requests and tokens it ran.
``tests/bench/test_bench_serve.py`` covers the ``serve`` sub-verb's load generator."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.bench import serve, throughput
from cadence.bench.cli import register
from cadence.bench.datasets import BenchRequest, random_requests
from cadence.bench.throughput import ThroughputResult, load_requests, run_cadence
from cadence.core.step_timing import TimingTotals
from cadence.engine_args import EngineArgs, engine_args_from


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    register(parser.add_subparsers(dest="verb", required=True))
    return parser


@pytest.fixture(scope="module")
def tiny(make_tiny_model: Callable[..., Path]) -> str:
    return str(make_tiny_model("llama"))


def throughput_args(*args: str) -> argparse.Namespace:
    return bench_parser().parse_args(["bench", "throughput", *args])


# ---- the verbs ----------------------------------------------------------------------------------


def test_bench_throughput_parses_its_workload_and_the_engine_flags() -> None:
    ns = throughput_args()
    assert (ns.verb, ns.bench, ns.run) == ("bench", "throughput", throughput.run)
    assert (ns.backend, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.dataset_path,
            ns.hf_batch_size, ns.hf_attn_implementation, ns.output_json, ns.disable_tqdm) == (
        "cadence", 64, 128, 128, 0.0, None, 64, "eager", None, False)
    assert engine_args_from(ns) == EngineArgs()
    ns = throughput_args("--backend", "hf", "--num-prompts", "3", "--input-len", "9", "--output-len", "4",
                         "--range-ratio", "0.5", "--dataset-path", "d.jsonl", "--hf-batch-size", "2",
                         "--hf-attn-implementation", "sdpa", "--output-json", "o.json", "--disable-tqdm",
                         "--model", "m", "--max-num-seqs", "2", "--seed", "7")
    assert (ns.backend, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, ns.dataset_path,
            ns.hf_batch_size, ns.hf_attn_implementation, ns.output_json, ns.disable_tqdm) == (
        "hf", 3, 9, 4, 0.5, "d.jsonl", 2, "sdpa", "o.json", True)
    assert engine_args_from(ns) == EngineArgs(model="m", max_num_seqs=2, seed=7)


def test_bench_serve_parses_its_load() -> None:
    ns = bench_parser().parse_args(["bench", "serve", "--base-url", "http://h:1", "--num-prompts", "5",
                                    "--request-rate", "2.5", "--max-concurrency", "3", "--ignore-eos",
                                    "--goodput", "ttft:100", "tpot:20"])
    assert (ns.bench, ns.run) == ("serve", serve.run)
    assert (ns.base_url, ns.num_prompts, ns.request_rate, ns.max_concurrency, ns.ignore_eos, ns.goodput) == (
        "http://h:1", 5, 2.5, 3, True, ["ttft:100", "tpot:20"])


def test_bench_needs_a_sub_verb_and_a_known_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_parser().parse_args(["bench"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        throughput_args("--backend", "vllm")
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


# ---- workloads ----------------------------------------------------------------------------------


def test_random_requests_have_the_asked_count_and_lengths(tiny: str) -> None:
    requests = load_requests(throughput_args("--model", tiny, "--num-prompts", "5", "--input-len", "12",
                                             "--output-len", "3", "--seed", "4"))
    assert [(r.prompt_len, r.output_len, len(r.prompt)) for r in requests] == [(12, 3, 12)] * 5
    assert all(isinstance(r.prompt, list) and all(100 <= t < 320 for t in r.prompt) for r in requests)
    # The tiny model's vocabulary (320), the engine's seed.
    assert requests == random_requests(5, 12, 3, 0.0, 320, 4)
    varied = load_requests(throughput_args("--model", tiny, "--num-prompts", "40", "--input-len", "20",
                                           "--output-len", "8", "--range-ratio", "0.5"))
    assert len(varied) == 40
    assert all(10 <= r.prompt_len == len(r.prompt) <= 30 and 4 <= r.output_len <= 12 for r in varied)


def test_a_jsonl_dataset_gives_its_prompts_and_output_lengths(tiny: str, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Paris", "output_len": 3}\n\n{"prompt": "Hello world"}\n')
    requests = load_requests(throughput_args("--model", tiny, "--dataset-path", str(path), "--num-prompts", "2",
                                             "--output-len", "9"))
    # "Paris" is 2 tokens of the tiny tokenizer, "Hello world" 5; without output_len: --output-len.
    assert sorted(requests, key=lambda r: r.prompt_len) == [BenchRequest("Paris", 2, 3),
                                                            BenchRequest("Hello world", 5, 9)]
    # More prompts than rows: drawn again.
    more = load_requests(throughput_args("--model", tiny, "--dataset-path", str(path), "--num-prompts", "7"))
    assert len(more) == 7 and {r.prompt for r in more} <= {"Paris", "Hello world"}


def test_a_sharegpt_dataset_takes_first_turns_and_reply_lengths(tiny: str, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Paris"}, {"from": "gpt", "value": "Hello world"}]},
        {"conversations": [{"from": "human", "value": "alone"}]},  # no reply: skipped
        {"conversation": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Paris"}]},
    ]))
    requests = load_requests(throughput_args("--model", tiny, "--dataset-path", str(path), "--num-prompts", "2"))
    assert sorted(requests, key=lambda r: r.output_len) == [BenchRequest("Hello", 2, 2),
                                                            BenchRequest("Paris", 2, 5)]


def test_a_dataset_without_usable_prompts_is_refused(tiny: str, tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps([{"conversations": []}]))
    with pytest.raises(ValueError, match="holds no usable prompts"):
        load_requests(throughput_args("--model", tiny, "--dataset-path", str(path)))


# ---- a run --------------------------------------------------------------------------------------


def test_run_cadence_reports_the_requests_and_tokens_it_ran(tiny: str) -> None:
    ns = throughput_args("--model", tiny, "--dtype", "float32", "--num-prompts", "4", "--input-len", "6",
                         "--output-len", "5", "--disable-tqdm")
    requests = load_requests(ns)
    result = run_cadence(ns, requests)
    assert (result.backend, result.num_requests, result.prompt_tokens, result.output_tokens) == (
        "cadence", 4, 24, 20)
    assert result.overhead_batch_size == 4  # the largest batch this workload reaches
    # Steps that ran all 4 requests: each request runs in 5 steps (one prefill, four decodes), but
    # they are submitted one by one to a running engine, so the first steps may hold fewer of them.
    assert isinstance(result.overhead, TimingTotals) and 0 <= result.overhead.num_steps <= 5
    assert 0.0 <= result.overhead.forward_s <= result.overhead.wall_s
    figures = result.to_json()
    assert (figures["num_requests"], figures["prompt_tokens"], figures["output_tokens"]) == (4, 24, 20)
    assert figures["requests_per_s"] == 4 / result.elapsed_s
    assert figures["total_tokens_per_s"] == 44 / result.elapsed_s
    assert "engine_overhead_fraction" in figures
    assert result.summary().startswith("cadence: ") and "(4 requests in " in result.summary()


def test_throughput_result_figures() -> None:
    result = ThroughputResult("hf", num_requests=4, elapsed_s=2.0, prompt_tokens=30, output_tokens=10)
    assert (result.requests_per_s, result.output_tokens_per_s, result.total_tokens_per_s) == (2.0, 5.0, 20.0)
    assert result.to_json() == {"backend": "hf", "num_requests": 4, "elapsed_s": 2.0, "prompt_tokens": 30,
                                "output_tokens": 10, "overhead": None, "overhead_batch_size": 0,
                                "requests_per_s": 2.0, "output_tokens_per_s": 5.0, "total_tokens_per_s": 20.0}
    assert result.summary() == ("hf: 2.00 requests/s, 20.0 total tokens/s, 5.0 output tokens/s "
                                "(4 requests in 2.0 s)")
