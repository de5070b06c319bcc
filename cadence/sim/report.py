"""Simulation reports: a table and JSON of the serving metrics per policy, and PNG plots.

Plots (matplotlib, the ``sim`` extra): latency CDFs per policy (TTFT, TPOT, ITL, E2E latency) and
queue length and KV usage over simulated time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cadence.bench.metrics import inter_token_gaps
from cadence.bench.plotting import pyplot
from cadence.sim.simulator import SimResult

_ROWS = [
    ("completed", "completed", "{:.0f}"),
    ("duration (s)", "duration", "{:.1f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("total throughput (tok/s)", "total_token_throughput", "{:.1f}"),
    ("goodput (req/s)", "request_goodput", "{:.3f}"),
    ("preemptions", "num_preemptions", "{:.0f}"),
]
_MAX_POINTS = 4000
_LATENCIES = [("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el")]


def summaries(results: Sequence[SimResult], goodput_slos_ms: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = (50.0, 99.0)) -> list[dict[str, Any]]:
    return [r.summary(goodput_slos_ms, percentiles) for r in results]


def repeated(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's summary over runs that differ only in their noise's seed (``simulate --repeat``):
    each figure's median, its range (``spread``: the lowest and the highest) and every run's summary
    (``runs``); what is not a figure (the label, tenants' shares) is the first run's."""
    figures = [key for key, value in runs[0].items() if isinstance(value, int | float) and not isinstance(value, bool)
               and all(isinstance(run.get(key), int | float) for run in runs)]
    row = dict(runs[0])
    row.update({key: float(np.median([run[key] for run in runs])) for key in figures})
    row["spread"] = {key: [min(run[key] for run in runs), max(run[key] for run in runs)] for key in figures}
    row["runs"] = list(runs)
    return row


def format_table(rows: Sequence[Mapping[str, Any]], percentiles: Sequence[float] = (50.0, 99.0)) -> str:
    """One column per policy: throughputs, goodput, preemptions, latency mean and percentiles (ms),
    then each tenant's share of output tokens; a figure over repeated runs is their median, and their
    range in brackets."""
    lines: list[tuple[str, list[str]]] = []
    for title, key, fmt in _ROWS:
        if key == "request_goodput" and all(r.get(key) is None for r in rows):
            continue
        lines.append((title, [_cell(r, key, fmt) for r in rows]))
    for title, name in _LATENCIES:
        lines.append((f"mean {title} (ms)", [_cell(r, f"mean_{name}_ms", "{:.1f}") for r in rows]))
        for p in percentiles:
            label = str(int(p)) if float(p).is_integer() else str(p)
            lines.append((f"p{label} {title} (ms)", [_cell(r, f"p{label}_{name}_ms", "{:.1f}") for r in rows]))
    users = sorted({t["user"] for r in rows for t in r.get("tenants", [])})
    if len(users) > 1:
        for user in users:
            cells = []
            for r in rows:
                share = next((t for t in r["tenants"] if t["user"] == user), None)
                cells.append("-" if share is None else f"{100 * share['output_share']:.1f}%")
            lines.append((f"output share {user}", cells))
    headers = [str(r["policy"]) for r in rows]
    first = max(len(title) for title, _ in lines)
    widths = [max(len(h), *(len(cells[i]) for _, cells in lines)) for i, h in enumerate(headers)]
    out = ["  ".join([" " * first, *(h.rjust(w) for h, w in zip(headers, widths, strict=True))])]
    out += ["  ".join([title.ljust(first), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))])
            for title, cells in lines]
    return "\n".join(out)


def _cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    if row.get(key) is None:
        return "-"
    spread = row.get("spread", {}).get(key)
    if spread is None:
        return fmt.format(row[key])
    return f"{fmt.format(row[key])} [{fmt.format(spread[0])}, {fmt.format(spread[1])}]"


def write_json(rows: Sequence[Mapping[str, Any]], path: str | Path, extra: Mapping[str, Any] | None = None) -> None:
    Path(path).write_text(json.dumps({**(extra or {}), "results": list(rows)}, indent=2) + "\n")


def plot(results: Sequence[SimResult], folder: str | Path) -> list[Path]:
    """Write ``latency_cdf.png`` and ``queue_kv.png`` into ``folder``; returns their paths.

    :raises RuntimeError: if matplotlib is missing (install ``cadence[sim]``).
    """
    plt = pyplot(" (or pass --no-plots)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (title, name) in zip(axes.flat, _LATENCIES, strict=True):
        for result in results:
            values = np.asarray(_latencies(result, name)) * 1000.0
            if len(values):
                # A few thousand quantiles draw the same curve as a million points, much faster.
                fractions = np.linspace(0.0, 1.0, min(len(values), _MAX_POINTS))
                ax.plot(np.quantile(values, fractions), fractions, label=result.policy)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of tokens")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    cdf = folder / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for result in results:
        steps = result.step_arrays()
        if not len(steps["start"]):
            continue
        stride = max(1, len(steps["start"]) // _MAX_POINTS)
        steps = {k: v[::stride] for k, v in steps.items()}
        axes[0].step(steps["start"], steps["num_waiting"], where="post", label=result.policy)
        axes[1].step(steps["start"], steps["num_running"], where="post", label=result.policy)
        axes[2].step(steps["start"], 100 * steps["kv_usage"], where="post", label=result.policy)
    for ax, label in zip(axes, ["waiting requests", "running requests", "KV cache usage (%)"], strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("simulated time (s)")
    fig.tight_layout()
    queue = folder / "queue_kv.png"
    fig.savefig(queue, dpi=100)
    plt.close(fig)
    return [cdf, queue]


def _latencies(result: SimResult, name: str) -> Sequence[float] | np.ndarray:
    done = [r for r in result.records if r.completed]
    if name == "itl":
        return inter_token_gaps(done)
    if name == "tpot":
        return [t for r in done if (t := r.tpot) is not None]
    return [getattr(r, name) for r in done]
