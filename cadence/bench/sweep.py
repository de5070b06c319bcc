"""``cadence bench sweep``: the throughput-latency curve of one or more servers.

For each server (``--server NAME=URL``, repeatable) and each request rate (``--request-rates``), the
same seeded requests run through ``cadence bench serve``'s load generator (Poisson arrivals, or
Gamma with ``--burstiness``). Each point reports throughput, goodput under ``--goodput`` SLOs, and
TTFT and ITL percentiles; the table, a JSON file and a PNG of the curves (matplotlib, the ``sim``
extra) show where each server saturates and what its tails do on the way there. Servers are
measured one after another, rate by rate, so each point sees a machine loaded only by its own run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cadence.bench import serve
from cadence.bench.plotting import pyplot

# (key of BenchmarkMetrics.to_dict(), column title) of each table column after the rate.
_COLUMNS = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("request_goodput", "goodput"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
)
# The three panels of the plot: (key, y label).
_PANELS = (("request_goodput", "goodput (req/s)"), ("p99_ttft_ms", "TTFT p99 (ms)"), ("p99_itl_ms", "ITL p99 (ms)"))

Curve = list[dict[str, Any]]  # one BenchmarkMetrics.to_dict() per rate, with "request_rate" added


def parse_servers(items: Sequence[str], flag: str = "--server") -> dict[str, str]:
    """``["cadence=http://h:8000", ...]`` -> ``{"cadence": "http://h:8000"}``; ``flag`` names the
    option they came from in the errors.

    :raises ValueError: for an item without ``=``, an empty name or URL, or a name given twice.
    """
    servers: dict[str, str] = {}
    for item in items:
        name, sep, url = (part.strip() for part in item.partition("="))
        if not sep or not name or not url:
            raise ValueError(f"{flag} takes NAME=URL, got {item!r}")
        if name in servers:
            raise ValueError(f"{flag} name {name!r} is given twice")
        servers[name] = url.rstrip("/")
    return servers


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,inf"`` -> ``[0.5, 1.0, 2.0, inf]``, in the order given.

    :raises ValueError: for a value that is not a positive number (``inf`` allowed) or no value.
    """
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"--request-rates takes positive numbers (or inf), got {part.strip()!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rates needs at least one rate")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                        help="a server to measure; repeatable (default: cadence=--base-url)")
    parser.add_argument("--request-rates", default="0.5,1,2,4", help="comma-separated requests/s; inf: all at once")
    parser.add_argument("--plot", default=None, help="write the curves to this PNG")


def sweep(ns: argparse.Namespace, servers: Mapping[str, str], rates: Sequence[float]) -> dict[str, Curve]:
    """Every server's figures at every rate, on the same requests."""
    requests, prompts = serve.build_prompts(ns)
    curves: dict[str, Curve] = {}
    for name, url in servers.items():
        curve = curves[name] = []
        for rate in rates:
            point = argparse.Namespace(**{**vars(ns), "base_url": url, "request_rate": rate})
            _, metrics = serve.measure(point, requests, prompts)
            curve.append({"request_rate": rate, **metrics.to_dict()})
            print(f"{name} at {rate:g} req/s: {_row(curve[-1])}", flush=True)
    return curves


def format_table(curves: Mapping[str, Curve]) -> str:
    width = max(len("server"), *(len(name) for name in curves)) + 2
    header = f"{'server':<{width}}{'rate':>8}" + "".join(f"{title:>11}" for _, title in _COLUMNS)
    lines = [header + "   (latencies in ms)"]
    for name, curve in curves.items():
        lines.extend(f"{name:<{width}}{point['request_rate']:>8g}{_row(point)}" for point in curve)
    return "\n".join(lines)


def _row(point: Mapping[str, Any]) -> str:
    return "".join(f"{'-':>11}" if point.get(key) is None else f"{point[key]:>11.2f}" for key, _ in _COLUMNS)


def plot(curves: Mapping[str, Curve], path: str | Path) -> None:
    """Goodput (output tok/s when no SLO was given), TTFT p99 and ITL p99 against the request rate,
    one line per server. An infinite rate is drawn at twice the largest finite one.

    :raises RuntimeError: if matplotlib is missing (install ``cadence[sim]``).
    """
    plt = pyplot()
    finite = [p["request_rate"] for c in curves.values() for p in c if math.isfinite(p["request_rate"])]
    stand_in = 2 * max(finite, default=1.0)
    panels = list(_PANELS)
    if any(p["request_goodput"] is None for c in curves.values() for p in c):
        panels[0] = ("output_throughput", "output throughput (tok/s)")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, curve in curves.items():
            xs = [p["request_rate"] if math.isfinite(p["request_rate"]) else stand_in for p in curve]
            ax.plot(xs, [p[key] for p in curve], marker="o", label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(ns: argparse.Namespace) -> int:
    servers = parse_servers(ns.server) or {"cadence": ns.base_url.rstrip("/")}
    curves = sweep(ns, servers, parse_rates(ns.request_rates))
    print(format_table(curves))
    if ns.output_json:
        num_prompts = ns.num_prompts or serve.DEFAULT_NUM_PROMPTS
        Path(ns.output_json).write_text(json.dumps({"num_prompts": num_prompts, "servers": servers,
                                                    "curves": curves}, indent=2))
    if ns.plot:
        plot(curves, ns.plot)
        print(f"wrote {ns.plot}")
    return 0 if all(point["completed"] for curve in curves.values() for point in curve) else 1
