"""The ``cadence simulate`` verb (and ``cadence simulate calibrate``).

``cadence simulate`` runs a workload (a JSONL trace, or synthetic Poisson/Gamma arrivals) through
the real scheduler under one or more policies on a virtual clock, prints the serving metrics per
policy, and writes them as JSON with PNG plots. Step times come from a cost model fitted on this
machine for the model, dtype, quantization and thread count given (``cost_store.py``): ``cadence
simulate calibrate`` times the real engine and stores one, and ``cadence simulate`` calibrates
first when none is stored yet (a minute and a half on the default model, 2 cores), unless ``--cost-model``
names a file or the built-in fallback. Engine flags are the same as ``generate``'s; for
``calibrate`` give them after the sub-verb. A simulation models a server: options left out
take ``cadence serve``'s defaults (a 512-token step budget, the 100 ms inter-token latency target),
and it models one engine core on one rank, or a fleet of them behind a data-parallel router
(``--engines N --router NAME``: the real server's router code).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cadence.core.cost_model import CostModel
from cadence.engine_args import EngineArgs, add_engine_args, engine_args_from
from cadence.sim.cost_store import BUILTIN, FitKey, store_fit, stored_fit
from cadence.sim.trace_formats import TraceOptions, add_trace_args, load_workload

if TYPE_CHECKING:
    from cadence.config import EngineConfig


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
                         description="Runs a fixed plan of workloads (a minute and a half on the default model, "
                                     "2 cores) through the real engine as it serves, and stores the fitted cost "
                                     "model as this machine's for the engine options given.")
    add_engine_args(cal)
    cal.add_argument("--output", default=None,
                     help="also write the cost model here (JSON); it is always stored as this machine's fit")
    cal.add_argument("--quick", action="store_true", help="a plan of a few seconds (small models, smoke tests)")
    cal.add_argument("--from-trace", nargs="+", default=None, metavar="FILE",
                     help="fit the steps of served runs' scheduling traces (--trace-scheduling) instead of timing "
                          "a plan; engine options are then the trace's, and a real engine's fit is stored as this "
                          "machine's (sim/trace_fit.py)")
    cal.set_defaults(run=run_calibrate)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload (a trace, or synthetic arrivals; --seed seeds it)")
    g.add_argument("--trace", default=None,
                   help="a trace: cadence's JSONL (arrival_time, prompt_tokens, output_tokens, priority, user, "
                        "extra_args per line), or Azure's or BurstGPT's CSV, or Mooncake's JSONL (docs/research.md)")
    add_trace_args(g)
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
    g.add_argument("--cost-model", default=None, metavar="FILE|builtin",
                   help="a cost model file, or builtin (SmolLM2-135M Q4_1 on a 2-core machine: a fallback); "
                        "default: this machine's stored fit for the engine options, calibrated first if none is")
    g.add_argument("--quick-calibration", action="store_true",
                   help="when a fit must be calibrated first, time a plan of a few seconds (small models)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft, tpot, e2el in milliseconds, e.g. ttft:500 tpot:50")
    g.add_argument("--metric-percentiles", default="50,99", help="comma-separated percentiles to report")
    g.add_argument("--draft-acceptance", type=float, default=0.7,
                   help="with --speculative-config: the chance that each drafted token is accepted (until the "
                        "first rejection) in the simulated verification")
    g.add_argument("--engines", type=int, default=1,
                   help="simulate a fleet of this many engine cores behind --router (one virtual clock)")
    g.add_argument("--output-dir", default="sim-results", help="folder for results.json and plots")
    g.add_argument("--dashboard", default=None, metavar="FILE",
                   help="also write the run as the live dashboard's page (HTML, a slider over the virtual time; "
                        "with several policies one file each, named as --trace-scheduling's)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--step-time-noise", default="0", metavar="SIGMA|fit",
                   help="scale each step's modelled time by its own lognormal factor of mean 1 and this spread "
                        "of its logarithm; 'fit': the cost model's median relative error / 0.67 (0: exact times)")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --step-time-noise: run each policy N times, the noise seeded --seed, --seed + 1, ... "
                        "(the workload the same); the table gives each figure's median and range, the plots "
                        "the first run")
    g.add_argument("--no-fast-forward", action="store_true",
                   help="take every step one by one, not runs of decode-only steps at once (the same figures, "
                        "slower; docs/research.md)")


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
    from cadence.api.server import default_model_name
    from cadence.bench.metrics import parse_goodput
    from cadence.sim import report
    from cadence.sim.dashboard_report import SimDashboard
    from cadence.sim.simulator import EngineLimits, simulate
    from cadence.sim.workload import describe, save_trace, synthetic_workload

    slos = parse_goodput(ns.goodput)
    percentiles = _percentiles(ns.metric_percentiles)
    args = engine_args_from(ns)
    if args.data_parallel_size != 1 or args.tensor_parallel_size != 1:
        raise ValueError("cadence simulate models engine cores of one rank each: for several, give --engines N "
                         "(and --router NAME), not --data-parallel-size; drop --tensor-parallel-size (calibrate "
                         "the cost model on the engine you want to model)")
    if ns.engines < 1:
        raise ValueError(f"--engines must be at least 1, got {ns.engines}")
    config = args.create_config()
    limits = EngineLimits.from_engine_config(config)
    cost_model = _cost_model(ns, args, config)
    noise = _noise(ns, cost_model, config.scheduler.trace_scheduling)
    if ns.trace:
        workload = load_workload(ns.trace, TraceOptions.from_args(ns))
    else:
        workload = synthetic_workload(ns.num_requests, request_rate=ns.request_rate, burstiness=ns.burstiness,
                                      input_len=ns.input_len, output_len=ns.output_len, tenants=ns.tenants,
                                      priority_levels=ns.priority_levels, seed=ns.seed)
    if ns.save_trace:
        save_trace(workload, ns.save_trace)
    print(f"workload: {describe(workload)}", file=sys.stderr)
    results, rows = [], []
    specs = _policy_specs(ns)
    pages = []
    for label, name, options in specs:
        dashboard = None if ns.dashboard is None else SimDashboard(ns.engines)
        runs = []
        for seed in range(ns.seed, ns.seed + ns.repeat):
            result = simulate(workload, limits, name, cost_model, seed, policy_options=options, label=label,
                              trace_scheduling=_per_policy_path(config.scheduler.trace_scheduling, label, len(specs)),
                              engines=ns.engines, router=config.parallel.router, speculative=config.speculative,
                              draft_acceptance=ns.draft_acceptance, dashboard=dashboard,
                              fast_forward=not ns.no_fast_forward, step_time_noise=noise)
            print(f"{label}{f' (seed {seed})' if ns.repeat > 1 else ''}: {result.num_steps} steps, "
                  f"{result.end_time:.1f} s simulated in {result.wall_time_s:.2f} s", file=sys.stderr)
            runs.append(result)
        results.append(runs[0])
        summaries = report.summaries(runs, slos, percentiles)
        rows.append(summaries[0] if ns.repeat == 1 else report.repeated(summaries))
        if dashboard is not None:
            meta = {"model": f"{default_model_name(ns.model)} (simulated)", "policy": label, "engines": ns.engines}
            pages.append(dashboard.write(_policy_file(ns.dashboard, label, len(specs)), meta))
    print(report.format_table(rows, percentiles))
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(rows, out / "results.json", extra={
        "workload": describe(workload), "limits": vars(limits), "cost_model": cost_model.to_json(),
        "seed": ns.seed, "step_time_noise": noise, "repeat": ns.repeat})
    written = [out / "results.json", *pages]
    if not ns.no_plots:
        written += report.plot(results, out)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def run_calibrate(ns: argparse.Namespace) -> int:
    model = _fit_traces(ns.from_trace) if ns.from_trace else _calibrate(engine_args_from(ns), ns.seed, ns.quick)
    print(model.describe())
    if ns.output:
        model.save(ns.output)
        print(f"wrote {ns.output}", file=sys.stderr)
    return 0


def _calibrate(args: EngineArgs, seed: int, quick: bool) -> CostModel:
    """Time the engine ``args`` describe, store the fit as this machine's for them, and return it."""
    from cadence.engine.llm import LLM
    from cadence.sim.calibrate import calibrate

    engine = LLM(**vars(args))
    model, quality = calibrate(engine, seed=seed, quick=quick, progress=lambda line: print(line, file=sys.stderr))
    print(f"fit over {quality.num_samples} steps: median relative error {100 * quality.median_rel_error:.1f}%, "
          f"p90 {100 * quality.p90_rel_error:.1f}%, total time ratio {quality.total_time_ratio:.3f}", file=sys.stderr)
    key = FitKey.of(engine.config)
    print(f"stored as this machine's fit for {key.describe()}: {store_fit(model, key)}", file=sys.stderr)
    engine.shutdown()
    return model


def _fit_traces(paths: list[str]) -> CostModel:
    """The fit of the traces' steps, stored as this machine's for the engine they describe (a real one)."""
    from cadence.sim.trace_fit import fit_traces

    model, quality = fit_traces(paths)
    print(f"fit over {quality.num_samples} steps: median relative error {100 * quality.median_rel_error:.1f}%, "
          f"p90 {100 * quality.p90_rel_error:.1f}%, total time ratio {quality.total_time_ratio:.3f}", file=sys.stderr)
    meta = model.metadata
    if not meta.get("simulated"):
        key = FitKey(str(meta["model"]), str(meta["dtype"]), str(meta["quantization"]), int(meta["threads"]),
                     str(meta.get("kernels", "none")))  # traces written before the kernels' build was kept
        print(f"stored as this machine's fit for {key.describe()}: {store_fit(model, key)}", file=sys.stderr)
    return model


def _cost_model(ns: argparse.Namespace, args: EngineArgs, config: EngineConfig) -> CostModel:
    """``--cost-model``'s file or the built-in fallback; else the stored fit, calibrated first if none is."""
    key = FitKey.of(config)
    if ns.cost_model == BUILTIN:
        print("using the built-in cost model, a fallback (the default model, SmolLM2-135M Q4_1, on a 2-core "
              "machine): its step times are not this machine's nor this model's", file=sys.stderr)
        return CostModel.default()
    if ns.cost_model:
        model = CostModel.load(ns.cost_model)
        _warn_on_mismatch(model, key)
        return model
    stored = stored_fit(key)
    if stored is not None:
        print(f"cost model: this machine's fit for {key.describe()} ({key.path})", file=sys.stderr)
        return stored
    print(f"no cost model is stored for {key.describe()} on this machine: calibrating first", file=sys.stderr)
    return _calibrate(args, ns.seed, ns.quick_calibration)


def _per_policy_path(path: str | None, label: str, num_policies: int) -> str | None:
    """``--trace-scheduling FILE`` or ``--dashboard FILE`` for one policy's run (None: not asked)."""
    return None if path is None else _policy_file(path, label, num_policies)


def _policy_file(path: str, label: str, num_policies: int) -> str:
    """FILE itself, or with several policies FILE with the policy's label before its suffix
    (``trace.sjf_aging=2.jsonl``)."""
    if num_policies == 1:
        return path
    file = Path(path)
    return str(file.with_name(f"{file.stem}.{re.sub(r'[^A-Za-z0-9._=-]+', '_', label)}{file.suffix}"))


def _noise(ns: argparse.Namespace, cost_model: CostModel, trace_scheduling: str | None) -> float:
    """``--step-time-noise``'s sigma, checked with ``--repeat``."""
    from cadence.sim.step_noise import noise_sigma

    sigma = noise_sigma(ns.step_time_noise, cost_model)
    if ns.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {ns.repeat}")
    if ns.repeat > 1 and not sigma:
        raise ValueError("--repeat runs differ only in their step-time noise: give --step-time-noise too")
    if ns.repeat > 1 and (ns.dashboard or trace_scheduling):
        raise ValueError("--repeat writes one run's figures per policy: drop --dashboard and --trace-scheduling")
    return sigma


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles takes numbers in [0, 100] separated by commas, got {text!r}")
    return values


def _warn_on_mismatch(cost_model: CostModel, key: FitKey) -> None:
    meta = cost_model.metadata
    for name, want in vars(key).items():
        have = meta.get(name)
        if have is not None and have != want:
            print(f"warning: the cost model was calibrated with {name}={have}, this simulation has {want}",
                  file=sys.stderr)
