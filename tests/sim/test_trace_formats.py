"""Public production trace formats (Azure, BurstGPT, Mooncake) read from the synthetic samples in
benchmarks/data/traces/, with time scaling, a window and sampling, in ``simulate`` and ``bench serve``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.bench.cli import register as register_bench
from cadence.bench.serve import arrival_offsets, build_prompts
from cadence.sim.cli import register as register_simulate
from cadence.sim.trace_formats import MOONCAKE_BLOCK_TOKENS, TraceOptions, load_workload

SAMPLES = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"
AZURE, BURSTGPT, MOONCAKE = (SAMPLES / name for name in ("azure_sample.csv", "burstgpt_sample.csv",
                                                         "mooncake_sample.jsonl"))


def test_azure_rows_become_requests_seconds_apart_from_the_first() -> None:
    specs = load_workload(AZURE)
    assert len(specs) == 40
    assert [(s.prompt_tokens, s.output_tokens) for s in specs[:3]] == [(105, 41), (123, 48), (164, 247)]
    # 18:15:46.9414670, 18:15:47.2449440, 18:15:47.2932210 (seven fraction digits).
    assert [s.arrival_time for s in specs[:3]] == pytest.approx([0.0, 0.303477, 0.351754])
    assert specs == load_workload(AZURE, TraceOptions(format="azure"))


def test_burstgpt_keeps_model_and_log_type_for_policies_and_failed_rows_send_their_prompt() -> None:
    specs = load_workload(BURSTGPT)
    assert len(specs) == 40 and specs[0].arrival_time == 0.0
    failed = specs[7]  # "10,ChatGPT,220,0,220,API log": no response tokens
    assert (failed.arrival_time, failed.prompt_tokens, failed.output_tokens) == (5.0, 220, 1)
    assert failed.extra_args == {"model": "ChatGPT", "log_type": "API log"}
    assert {s.extra_args["model"] for s in specs if s.extra_args} == {"ChatGPT", "GPT-4"}


def test_mooncake_hash_ids_become_shared_token_blocks() -> None:
    specs = load_workload(MOONCAKE, TraceOptions(vocab_size=1000))
    assert len(specs) == 30 and specs[1].arrival_time == pytest.approx(0.531)  # 1585 - 1054 ms
    assert all(s.prompt_token_ids is not None and len(s.prompt_token_ids) == s.prompt_tokens for s in specs)
    assert all(100 <= t < 1000 for s in specs for t in s.prompt_token_ids or ())
    first, second, third = (s.prompt_token_ids or () for s in specs[1:4])
    block = MOONCAKE_BLOCK_TOKENS
    assert first[:block] == second[:block]  # both start with block 4
    assert second[block:2 * block] != first[block:2 * block]  # then 5 and 6
    assert third[:block] != first[:block]  # block 8
    assert (specs[0].prompt_tokens, specs[0].output_tokens) == (1678, 154)


def test_time_scale_window_and_sample() -> None:
    full = load_workload(AZURE)
    faster = load_workload(AZURE, TraceOptions(time_scale=0.5))
    assert [s.arrival_time for s in faster] == pytest.approx([s.arrival_time / 2 for s in full])
    window = load_workload(AZURE, TraceOptions(window=(5.0, 10.0)))
    inside = [s for s in full if 5.0 <= s.arrival_time < 10.0]
    assert [s.request_id for s in window] == [s.request_id for s in inside] and window[0].arrival_time == 0.0
    sampled = load_workload(AZURE, TraceOptions(sample=0.5, seed=3))
    assert 10 < len(sampled) < 30 and sampled == load_workload(AZURE, TraceOptions(sample=0.5, seed=3))
    assert [s.request_id for s in sampled] != [s.request_id for s in load_workload(AZURE, TraceOptions(sample=0.5))]
    for bad, message in (({"time_scale": 0}, "time scale"), ({"sample": 0}, "sample"),
                         ({"window": (3.0, 1.0)}, "window"), ({"format": "csv"}, "unknown trace format")):
        with pytest.raises(ValueError, match=message):
            TraceOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no request .* is left"):
        load_workload(AZURE, TraceOptions(window=(1000.0, 2000.0)))


def test_malformed_rows_and_unknown_csvs_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,3\nyesterday,5,1\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: ValueError"):
        load_workload(bad)
    other = tmp_path / "other.csv"
    other.write_text("when,prompt\n1,2\n")
    with pytest.raises(ValueError, match="Azure's columns"):
        load_workload(other)
    moon = tmp_path / "moon.jsonl"
    moon.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"moon\.jsonl:2: JSONDecodeError"):
        load_workload(moon)


def test_simulate_and_bench_serve_read_them(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    verbs = parser.add_subparsers(dest="verb", required=True)
    register_simulate(verbs)
    register_bench(verbs)
    tiny = str(make_tiny_model("llama", max_position_embeddings=4096))
    ns = parser.parse_args(["simulate", "--model", tiny, "--cost-model", "builtin", "--trace", str(BURSTGPT),
                            "--trace-window", "0:20", "--trace-time-scale", "0.5", "--output-dir", str(tmp_path),
                            "--no-plots", "--save-trace", str(tmp_path / "saved.jsonl")])
    assert ns.run(ns) == 0
    saved = load_workload(tmp_path / "saved.jsonl")
    expected = load_workload(BURSTGPT, TraceOptions(window=(0, 20), time_scale=0.5))
    assert [(s.arrival_time, s.extra_args) for s in saved] == [(s.arrival_time, s.extra_args) for s in expected]
    ns = parser.parse_args(["bench", "serve", "--tokenizer", tiny, "--dataset-name", "trace", "--dataset-path",
                            str(MOONCAKE), "--trace-sample", "0.5", "--seed", "1"])
    requests, prompts = build_prompts(ns)
    assert len(requests) == len(load_workload(MOONCAKE, TraceOptions(sample=0.5, seed=1)))
    assert arrival_offsets(requests, float("inf"), 1.0, 0)[0] == 0.0
    assert all(isinstance(p, list) and len(p) == r.prompt_len for p, r in zip(prompts, requests, strict=True))
