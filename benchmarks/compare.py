"""The fixed comparison workload, side by side in one run: cadence against transformers offline, and
``cadence serve`` against any peer OpenAI-compatible server (vLLM, llama.cpp's server, SGLang ...).

Offline: 64 random prompts of 128 tokens, 128 greedy output tokens each with EOS ignored, bf16
(``--quantization none``: the weights its peers run), SmolLM2-135M-Instruct, through
``LLM.generate`` and through transformers' batched ``generate``.
Serving: the same prompts as 64 streaming ``/v1/completions`` requests from 32 concurrent clients,
measured by ``cadence bench serve`` (vLLM's metric definitions) against a ``cadence serve`` this
script starts and then against each ``--peer NAME=BASE_URL`` (started by you, serving the same
model). Prints each side's figures and cadence's ratio to it. A benchmark, never a test.

    python benchmarks/compare.py
    python benchmarks/compare.py --peer vllm=http://127.0.0.1:8001 --peer llama.cpp=http://127.0.0.1:8002
    python benchmarks/compare.py --skip-offline --server-arg=--num-threads=2
    python benchmarks/compare.py --skip-offline --peer vllm=URL --workload-arg=--dataset-name=prefix-repetition

The last is the shared-prefix workload (a 1,024-token prefix, 64 distinct tokens after it; prefix
caching on in both servers): the table then adds each server's prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from cadence.bench import serve, throughput
from cadence.bench.sweep import parse_servers

# Serving figures compared side by side: (key in BenchmarkMetrics.to_dict(), label, higher is better).
_SERVING_FIGURES = (
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("median_e2el_ms", "E2E p50 ms", False),
)


def offline(workload: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    ns = parser.parse_args(["--dtype", "bfloat16", "--quantization", "none", "--disable-tqdm", *workload])
    requests = throughput.load_requests(ns)
    ours = throughput.run_cadence(ns, requests)
    print(ours.summary())
    baseline = throughput.run_hf(ns, requests)
    print(baseline.summary())
    ratio = ours.output_tokens_per_s / baseline.output_tokens_per_s
    print(f"cadence / transformers output tokens/s: {ratio:.2f}x")
    return {"cadence": ours.to_json(), "hf": baseline.to_json(), "ratio": ratio}


def serving(base_url: str, workload: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    ns = parser.parse_args(["--base-url", base_url, "--num-prompts", "64", "--max-concurrency", "32",
                            "--ignore-eos", "--disable-tqdm", *workload])
    model, metrics = serve.measure(ns)
    print(serve.format_report(metrics, title=f" {base_url} ({model}) "))
    return metrics.to_dict()


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per figure, one column per server, then cadence's ratio to each peer (>1: cadence better)."""
    peers = [name for name in results if name != "cadence"]
    header = f"{'':<16}" + "".join(f"{name:>14}" for name in results)
    header += "".join(f"{'vs ' + name:>14}" for name in peers)
    rows = [header]
    for key, label, higher_better in _SERVING_FIGURES:
        ours = results["cadence"][key]
        row = f"{label:<16}" + "".join(f"{results[name][key]:>14.1f}" for name in results)
        for name in peers:
            theirs = results[name][key]
            ratio = ours / theirs if higher_better else theirs / ours
            row += f"{ratio:>13.2f}x"
        rows.append(row)
    if all("prefix_cache_hit_rate" in figures for figures in results.values()):  # servers that export it
        rows.append(f"{'prefix hits %':<16}" + "".join(f"{100 * results[name]['prefix_cache_hit_rate']:>14.1f}"
                                                       for name in results))
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=BASE_URL",
                        help="another OpenAI-compatible server to run the serving workload against; repeatable")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `cadence serve` flag for the server this script starts; repeatable")
    parser.add_argument("--workload-arg", action="append", default=[],
                        help="extra flag for both `bench throughput` and `bench serve`, e.g. --workload-arg=--seed=1")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    try:
        peers = parse_servers(ns.peer, "--peer")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    report: dict[str, Any] = {}
    if not ns.skip_offline:
        report["offline"] = offline(ns.workload_arg)
    if not ns.skip_serve:
        from cadence.api.testing import ServerProcess

        log = Path(tempfile.mkdtemp()) / "server.log"
        serving_results = {}
        with ServerProcess(["--dtype", "bfloat16", "--quantization", "none", *ns.server_arg], log_path=log) as server:
            serving_results["cadence"] = serving(server.url, ns.workload_arg)
        for name, url in peers.items():
            serving_results[name] = serving(url, ns.workload_arg)
        print(comparison_table(serving_results))
        report["serving"] = serving_results
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
