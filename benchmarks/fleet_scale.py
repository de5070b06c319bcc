"""How fast the simulator runs a big fleet: a million requests over 64 engines (issue 20's goal: ten minutes).

Offers ``--load`` of the fleet's simulated capacity (ShareGPT-like lengths, Gamma arrivals; requests
longer than the context dropped, as vLLM's ShareGPT sampling drops them), first runs the workload's
first ``--baseline-requests`` step by step and with the fast-forward (``cadence/sim/decode_run.py``),
checks that both report the same, and prints the speed-up; then simulates the whole workload with the
fast-forward and prints its wall time, steps and peak memory. Run it on a quiet machine; a benchmark,
never a test:

    python benchmarks/fleet_scale.py [--engines 64 --num-requests 1000000 --router least-loaded --target-itl-ms 100
                                      --prefix-caching-hash-algo xxhash]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from fleet_fidelity import workload_of
from sim_fidelity import load_average, log

from cadence.config import HASH_ALGOS
from cadence.core.cost_model import CostModel
from cadence.engine_args import EngineArgs
from cadence.sim.simulator import EngineLimits, SimResult, simulate
from cadence.sim.workload import RequestSpec, describe

GOAL_S = 600.0
GOAL_REQUESTS, GOAL_ENGINES = 999_000, 64  # a million, less the few dropped for their length


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=1_000_000)
    parser.add_argument("--baseline-requests", type=int, default=9_600,
                        help="simulated step by step as well, for the speed-up and the equality check")
    parser.add_argument("--router", default="least-loaded",
                        help="the data-parallel router (any: prefix-aware is told what runs evict)")
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--burstiness", type=float, default=0.5)
    parser.add_argument("--input-len", default="lognormal:240:1")
    parser.add_argument("--output-len", default="lognormal:190:0.8")
    parser.add_argument("--cost-model", default=None, help="a fit (simulate calibrate); default: the built-in")
    parser.add_argument("--target-itl-ms", type=float, default=EngineArgs.target_itl_ms,
                        help="the engines' inter-token latency target (default: the engine's, off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching-hash-algo", default="xxhash", choices=HASH_ALGOS,
                        help="the blocks' prefix-cache keys: the figures are the same under either, xxhash is faster")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    cost_model = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
    config = EngineArgs(target_itl_ms=args.target_itl_ms,
                        prefix_caching_hash_algo=args.prefix_caching_hash_algo).create_config()
    limits = EngineLimits.from_engine_config(config)

    def run(workload: list[RequestSpec], engines: int, fast_forward: bool = True) -> SimResult:
        return simulate(workload, limits, "fcfs", cost_model, args.seed, engines=engines, router=args.router,
                        fast_forward=fast_forward)

    capacity = run(_workload(args, limits, 300, None), 2).metrics().request_throughput
    rate = args.load * capacity * args.engines / 2
    workload = _workload(args, limits, args.num_requests, rate)
    log(f"{args.engines} engines at {args.load:.0%} load: {rate:.1f} req/s; {describe(workload)}; "
        f"{args.prefix_caching_hash_algo} block keys")

    slice_ = workload[:args.baseline_requests]
    log(f"baseline: the first {len(slice_)} requests step by step, then fast-forwarded ({load_average()})")
    step_by_step, fast = run(slice_, args.engines, fast_forward=False), run(slice_, args.engines)
    same = step_by_step.summary() | {"wall_time_s": 0} == fast.summary() | {"wall_time_s": 0}
    speedup = step_by_step.wall_time_s / fast.wall_time_s
    print(f"\n{len(slice_)} requests: step by step {step_by_step.wall_time_s:.1f} s, fast-forwarded "
          f"{fast.wall_time_s:.1f} s: {speedup:.2f}x; the same figures: {'yes' if same else 'NO'}")

    log(f"the whole workload ({load_average()})")
    started = time.perf_counter()
    whole = run(workload, args.engines)
    summary = whole.summary(percentiles=(50, 99))
    total_s = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    per_step_us, per_request_ms = 1e6 * whole.wall_time_s / whole.num_steps, 1e3 * whole.wall_time_s / len(workload)
    print(f"{len(workload)} requests over {args.engines} engines: simulated in {whole.wall_time_s:.0f} s "
          f"({total_s:.0f} s with the metrics), {whole.num_steps} steps ({per_step_us:.1f} µs a step, "
          f"{per_request_ms:.2f} ms a request), peak memory {peak_gib:.1f} GiB")
    print(f"simulated {summary['simulated_time_s']:.0f} s: {summary['output_throughput']:.0f} out tok/s, TTFT p50 "
          f"{summary['median_ttft_ms']:.0f} ms, p99 {summary['p99_ttft_ms']:.0f} ms")
    # The goal is a million requests over 64 engines; a smaller run says what its rate projects.
    whole_goal = len(workload) >= GOAL_REQUESTS and args.engines >= GOAL_ENGINES
    projected_s = total_s * GOAL_REQUESTS / len(workload)
    met = whole_goal and total_s <= GOAL_S
    verdict = ("met" if met else "NOT met") if whole_goal else (
        f"not run whole; the projection is {'under' if projected_s <= GOAL_S else 'over'} it")
    print(f"goal (a million requests over {GOAL_ENGINES} engines in {GOAL_S:.0f} s): "
          f"{verdict} ({'measured' if whole_goal else 'projected'} {projected_s:.0f} s)")
    if args.json:
        figures: dict[str, Any] = {"args": vars(args), "rate": rate, "speedup": speedup, "same": same,
                                   "wall_time_s": whole.wall_time_s, "total_s": total_s, "projected_s": projected_s,
                                   "num_steps": whole.num_steps, "peak_gib": peak_gib, "summary": summary}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if same and met else 1


def _workload(args: argparse.Namespace, limits: EngineLimits, count: int, rate: float | None) -> list[RequestSpec]:
    return [s for s in workload_of(args, count, rate) if s.prompt_tokens + s.output_tokens <= limits.max_model_len]


if __name__ == "__main__":
    sys.exit(main())
