"""What the soak samples while it runs: the RSS of the server's processes from /proc, and /metrics."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Metrics = dict[str, dict[str, float]]


def parse_vmrss(status_text: str) -> int | None:
    """Bytes of ``VmRSS`` in a /proc/PID/status text (None: no such line, a kernel thread or a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def parse_stat(stat_text: str) -> tuple[str, int]:
    """``(comm, ppid)`` from a /proc/PID/stat line (comm may hold spaces and parentheses)."""
    comm = stat_text[stat_text.index("(") + 1:stat_text.rindex(")")]
    return comm, int(stat_text[stat_text.rindex(")") + 2:].split()[1])


def process_tree(root: int) -> dict[int, str]:
    """``{pid: name}`` for ``root`` and every process below it, from /proc (root first; "?" where
    its stat could not be read)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                names[int(entry)], ppid = parse_stat(Path(f"/proc/{entry}/stat").read_text())
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        tree[pid] = names.get(pid, "?")
    return tree


def process_tree_rss(root: int) -> dict[str, int]:
    """``{"name (pid)": rss}`` for ``root`` (named ``api``) and every descendant, from /proc."""
    out: dict[str, int] = {}
    for pid, name in process_tree(root).items():
        try:
            rss = parse_vmrss(Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        if rss is not None:
            out[f"{'api' if pid == root else name} ({pid})"] = rss
    return out


def parse_metrics(text: str) -> Metrics:
    """Prometheus text to ``{name: {labels: value}}``; ``labels`` is ``k=v,...`` without ``model_name``
    (``engine=0`` for the engine gauges, ``""`` for the API's counters). Names are the samples'
    (a counter's with its ``_total``).

    :raises ValueError: for text that is not Prometheus' exposition format.
    """
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out.setdefault(sample.name, {})[key] = float(sample.value)
    return out


def gauge(metrics: Metrics | None, name: str) -> float:
    """``cadence:NAME`` summed over its labels (engines); 0 where it is missing."""
    return sum((metrics or {}).get(f"cadence:{name}", {}).values())


@dataclass
class Samples:
    rss: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    metrics: list[tuple[float, Metrics]] = field(default_factory=list)
    metrics_failures: int = 0


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> Metrics | None:
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return parse_metrics(await response.text()) if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def sample_once(session: aiohttp.ClientSession, base_url: str, pid: int | None, t: float,
                      samples: Samples) -> Metrics | None:
    if pid is not None:
        for name, rss in process_tree_rss(pid).items():
            samples.rss.setdefault(name, []).append((t, float(rss)))
    metrics = await fetch_metrics(session, base_url)
    if metrics is None:
        samples.metrics_failures += 1
    else:
        samples.metrics.append((t, metrics))
    return metrics
