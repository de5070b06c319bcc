"""The ``cadence simulate`` verb (and ``cadence simulate calibrate``).

``cadence simulate`` runs a workload (a JSONL trace, or synthetic Poisson/Gamma arrivals) through
the real scheduler under one or more policies on a virtual clock, prints the serving metrics per
policy, and writes them as JSON with PNG plots. ``cadence simulate calibrate`` times the real
engine and writes the cost model the simulator uses. Engine flags are the same as ``generate``'s;
for ``calibrate`` give them after the sub-verb. A simulation models a server: options left out
take ``cadence serve``'s defaults (a 512-token step budget, the 100 ms inter-token latency target),
and it models one engine core on one rank.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from cadence.engine_args import add_engine_args, engine_args_from


def register(verbs: argparse._SubParsersAction[Any]) -> None:
    sim = verbs.add_parser(
        "simulate", help="simulate serving a workload under scheduling policies (no model runs)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_engine_args(sim)
    _add_workload_args(sim)
    _add_report_args(sim)
    sim.set_defaults(run=run_simulate)
    sub = sim.add_subparsers(dest="simulate_verb", metavar="{calibrate}")
    cal = sub.add_parser("calibrate", help="time the real engine and fit the simulator's cost model",
                         allow_abbrev=False,
                         description="Runs a fixed plan of workloads (about a minute on SmolLM2 bf16, 2 cores) "
                                     "through the real engine and writes the fitted cost model.")
    add_engine_args(cal)
    cal.add_argument("--output", required=True, help="where to write the cost model (JSON)")
    cal.add_argument("--quick", action="store_true", help="a plan of a few seconds (small models, smoke tests)")
    cal.set_defaults(run=run_calibrate)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload (a trace, or synthetic arrivals; --seed seeds it)")
    g.add_argument("--trace", default=None, help="JSONL trace: arrival_time, prompt_tokens, output_tokens, "
                                                  "priority, user per line")
    g.add_argument("--num-requests", type=int, default=1000, help="synthetic: how many requests")
    g.add_argument("--request-rate", type=float, default=math.inf, help="synthetic: requests/s (inf: all at 0)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="synthetic: Gamma shape of the gaps; 1 is Poisson, < 1 burstier")
    g.add_argument("--input-len", default="uniform:128:512",
                   help="prompt lengths: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEAN:SIGMA, exponential:MEAN")
    g.add_argument("--output-len", default="uniform:32:256", help="output lengths, same forms as --input-len")
    g.add_argument("--tenants", default=None, help="users: a count (3) or NAME=WEIGHT,... (a=3,b=1)")
    g.add_argument("--priority-levels", type=int, default=1, help="priorities drawn uniformly from 0..N-1")
    g.add_argument("--save-trace", default=None, help="also write the workload as a JSONL trace")


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("policies and report")
    g.add_argument("--compare", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="also run this policy (with these options); repeatable")
    g.add_argument("--cost-model", default=None,
                   help="cost model from `cadence simulate calibrate` (default: built-in SmolLM2 figures)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft, tpot, e2el in milliseconds, e.g. ttft:500 tpot:50")
    g.add_argument("--metric-percentiles", default="50,99", help="comma-separated percentiles to report")
    g.add_argument("--output-dir", default="sim-results", help="folder for results.json and plots")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _policy_specs(ns: argparse.Namespace) -> list[tuple[str, str, dict[str, str]]]:
    """(label, name, options) per policy to run: ``--policy`` first, then each ``--compare``."""
    specs = [(ns.policy, ns.policy, engine_args_from(ns).policy_options)]
    for item in ns.compare:
        name, _, rest = item.partition(":")
        options = {}
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"--compare {item!r}: options are KEY=VALUE pairs separated by commas")
            options[key] = value
        specs.append((item, name, options))
    return specs


def run_simulate(ns: argparse.Namespace) -> int:
    from cadence.bench.metrics import parse_goodput
    from cadence.core.cost_model import CostModel
    from cadence.sim import report
    from cadence.sim.simulator import EngineLimits, simulate
    from cadence.sim.workload import describe, load_trace, save_trace, synthetic_workload

    slos = parse_goodput(ns.goodput)
    percentiles = _percentiles(ns.metric_percentiles)
    args = replace(engine_args_from(ns), usage_context="serving")
    if args.data_parallel_size != 1 or args.tensor_parallel_size != 1:
        raise ValueError("cadence simulate models one engine core on one rank; drop --data-parallel-size and "
                         "--tensor-parallel-size (calibrate the cost model on the engine you want to model)")
    config = args.create_config()
    limits = EngineLimits.from_engine_config(config)
    cost_model = CostModel.load(ns.cost_model) if ns.cost_model else CostModel.default()
    _warn_on_mismatch(cost_model, config.model.path, config.model.dtype, bool(ns.cost_model))
    if ns.trace:
        workload = load_trace(ns.trace)
    else:
        workload = synthetic_workload(ns.num_requests, request_rate=ns.request_rate, burstiness=ns.burstiness,
                                      input_len=ns.input_len, output_len=ns.output_len, tenants=ns.tenants,
                                      priority_levels=ns.priority_levels, seed=ns.seed)
    if ns.save_trace:
        save_trace(workload, ns.save_trace)
    print(f"workload: {describe(workload)}", file=sys.stderr)
    results = []
    for label, name, options in _policy_specs(ns):
        result = simulate(workload, limits, name, cost_model, ns.seed, policy_options=options, label=label)
        print(f"{label}: {result.num_steps} steps, {result.end_time:.1f} s simulated in "
              f"{result.wall_time_s:.2f} s", file=sys.stderr)
        results.append(result)
    rows = report.summaries(results, slos, percentiles)
    print(report.format_table(rows, percentiles))
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(rows, out / "results.json", extra={
        "workload": describe(workload), "limits": vars(limits), "cost_model": cost_model.to_json()})
    written = [out / "results.json"]
    if not ns.no_plots:
        written += report.plot(results, out)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def run_calibrate(ns: argparse.Namespace) -> int:
    from cadence.engine.llm import LLM
    from cadence.sim.calibrate import calibrate

    engine = LLM(**vars(engine_args_from(ns)))
    model, quality = calibrate(engine, seed=ns.seed, quick=ns.quick,
                               progress=lambda line: print(line, file=sys.stderr))
    model.save(ns.output)
    print(model.describe())
    print(f"fit over {quality.num_samples} steps: median relative error {100 * quality.median_rel_error:.1f}%, "
          f"p90 {100 * quality.p90_rel_error:.1f}%, total time ratio {quality.total_time_ratio:.3f}")
    print(f"wrote {ns.output}", file=sys.stderr)
    return 0


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles takes numbers in [0, 100] separated by commas, got {text!r}")
    return values


def _warn_on_mismatch(cost_model: Any, model_path: str, dtype: str, from_file: bool) -> None:
    meta = cost_model.metadata
    if not from_file:
        print("using the built-in cost model (SmolLM2-135M bf16 on 2 CPU cores); for your machine and model run "
              "`cadence simulate calibrate --output costs.json` and pass --cost-model costs.json", file=sys.stderr)
        return
    model = Path(model_path.rstrip("/")).name
    for key, want in (("model", model), ("dtype", dtype)):
        have = meta.get(key)
        if have is not None and have != want:
            print(f"warning: the cost model was calibrated with {key}={have}, this simulation has {want}",
                  file=sys.stderr)
