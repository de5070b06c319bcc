"""Fleet simulation fidelity: a real data-parallel server and ``cadence simulate --engines N``, on one trace.

Calibrates a cost model for one engine core as the server runs each (``--num-threads`` threads;
``cadence simulate calibrate``, unless ``--cost-model`` is given), writes a timed trace (ShareGPT-like
lengths, Gamma arrivals at ``--load`` times the simulated fleet's capacity), replays it with
``cadence bench serve --dataset-name trace`` against ``cadence serve --data-parallel-size N``, and
simulates the same trace on N engines behind the same router. Prints both with the simulator's
relative difference (the target: throughput and median TTFT within 15%), then what the simulator
predicts for bigger fleets (``--predict 8,64``) offered the same load per engine. The server, its
client and the engines share this machine's cores, the simulated engines nothing: run it on a quiet
machine. A benchmark, never a test:

    python benchmarks/fleet_fidelity.py [--data-parallel-size 2 --num-threads 1 --load 0.7 --num-requests 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from sim_fidelity import CHECKED, TOLERANCE, load_average, log

from cadence.core.cost_model import CostModel
from cadence.engine_args import EngineArgs
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.workload import RequestSpec, describe, save_trace, synthetic_workload

_ROWS = [
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("median TTFT (ms)", "median_ttft_ms"),
    ("p99 TTFT (ms)", "p99_ttft_ms"),
    ("median TPOT (ms)", "median_tpot_ms"),
    ("median ITL (ms)", "median_itl_ms"),
    ("duration (s)", "duration"),
]
CADENCE = [sys.executable, "-m", "cadence"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1, help="each engine core's threads")
    parser.add_argument("--router", default="prefix-aware")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--load", type=float, default=0.7, help="the fraction of the fleet's capacity to offer")
    parser.add_argument("--burstiness", type=float, default=0.5)
    parser.add_argument("--input-len", default="lognormal:240:1")
    parser.add_argument("--output-len", default="lognormal:190:0.8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", default=None, help="use this cost model instead of calibrating first")
    parser.add_argument("--predict", default="8,64", help="fleet sizes to predict (empty: none)")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-fidelity-"))
    engine_flags = ["--dtype", args.dtype, "--num-threads", str(args.num_threads)]

    cost_path = args.cost_model or str(work / "costs.json")
    if args.cost_model is None:
        log(f"calibrating one engine core ({load_average()})")
        subprocess.run([*CADENCE, "simulate", "calibrate", *engine_flags, "--output", cost_path], check=True)
    cost_model = CostModel.load(cost_path)
    log(f"cost model {cost_path}: {cost_model.describe()}")
    # The server's engine cores, as the simulator models each (serve's step budget and latency target).
    config = EngineArgs(dtype=args.dtype, num_threads=args.num_threads).create_config()
    limits = EngineLimits.from_engine_config(config)
    policy, options = config.scheduler.policy, config.scheduler.policy_options
    fleet = args.data_parallel_size

    def run_sim(workload: list[RequestSpec], engines: int) -> Any:
        return simulate(workload, limits, policy, cost_model, args.seed, policy_options=options, engines=engines,
                        router=args.router)

    burst = workload_of(args, args.num_requests, None)
    capacity = run_sim(burst, fleet).metrics().request_throughput
    rate = args.load * capacity
    log(f"simulated capacity of {fleet} engines: {capacity:.2f} req/s; offering {args.load:.0%}: {rate:.2f} req/s")
    workload = workload_of(args, args.num_requests, rate)
    trace = work / "trace.jsonl"
    save_trace(workload, trace)
    log(f"workload: {describe(workload)}")

    real = _serve_and_replay(args, engine_flags, trace, work)
    simulated = run_sim(workload, fleet)
    sim = simulated.metrics(percentiles=(50, 99)).to_dict()
    print(f"\n{fleet} engine cores, {args.num_threads} thread(s) each, router {args.router}; "
          f"{len(workload)} requests at {rate:.2f} req/s ({args.load:.0%} load)")
    print(f"{'metric':30} {'real':>10} {'simulated':>10} {'diff':>8}")
    for label, key in _ROWS:
        print(f"{label:30} {real[key]:10.2f} {sim[key]:10.2f} {_diff(sim[key], real[key]):>8}")
    within = all(abs(sim[k] - real[k]) <= TOLERANCE * abs(real[k]) for k in CHECKED)
    print(f"throughput and median TTFT within {TOLERANCE:.0%}: {'yes' if within else 'NO'}")

    predictions = {}
    for size in [int(n) for n in args.predict.split(",") if n.strip()]:
        # The same load per engine: as many requests per engine, arriving size/fleet times as fast.
        bigger = workload_of(args, args.num_requests * size // fleet, rate * size / fleet)
        result = run_sim(bigger, size)
        predictions[size] = {**result.metrics(percentiles=(50, 99)).to_dict(), "num_steps": result.num_steps,
                             "wall_time_s": result.wall_time_s}
    if predictions:
        print(f"\npredicted, the same load per engine ({args.load:.0%})")
        print(f"{'engines':>8} {'requests':>9} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'sim wall s':>10}")
        for size, p in predictions.items():
            print(f"{size:8d} {args.num_requests * size // fleet:9d} {p['output_throughput']:10.1f} "
                  f"{p['median_ttft_ms']:9.0f} {p['p99_ttft_ms']:9.0f} {p['median_tpot_ms']:9.1f} "
                  f"{p['wall_time_s']:10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rate": rate, "real": real, "simulated": sim,
                                               "predictions": predictions, "cost_model": cost_model.to_json()},
                                              indent=2))
    return 0 if within else 1


def workload_of(args: argparse.Namespace, count: int, rate: float | None) -> list[RequestSpec]:
    """``count`` requests of ``args``' lengths and burstiness at ``rate`` (None: all at once), seeded."""
    return synthetic_workload(count, request_rate=rate or float("inf"), burstiness=args.burstiness,
                              input_len=args.input_len, output_len=args.output_len, seed=args.seed)


def _serve_and_replay(args: argparse.Namespace, engine_flags: list[str], trace: Path, work: Path) -> dict[str, Any]:
    """``bench serve``'s figures for the trace, replayed against a server of ``--data-parallel-size`` cores."""
    base_url = f"http://127.0.0.1:{args.port}"
    log = (work / "server.log").open("w")
    server = subprocess.Popen([*CADENCE, "serve", *engine_flags, "--data-parallel-size", str(args.data_parallel_size),
                               "--router", args.router, "--port", str(args.port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(base_url, server)
        log(f"server ready; replaying the trace ({load_average()})")
        out = work / "real.json"
        subprocess.run([*CADENCE, "bench", "serve", "--base-url", base_url, "--dataset-name", "trace",
                        "--dataset-path", str(trace), "--ignore-eos", "--disable-tqdm", "--output-json", str(out),
                        "--metric-percentiles", "50,99", "--seed", str(args.seed)], check=True)
        log(f"replayed ({load_average()})")
        return dict(json.loads(out.read_text()))
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait_ready(base_url: str, server: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s")


def _diff(sim: float, real: float) -> str:
    return f"{100 * (sim - real) / real:+.1f}%" if real else "-"


if __name__ == "__main__":
    sys.exit(main())
