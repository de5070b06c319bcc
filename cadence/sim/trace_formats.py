"""Public production traces as workloads: the Azure LLM inference traces, BurstGPT and Mooncake, beside
cadence's own JSONL (``workload.py``), with time scaling, sampling and a time window.

- **Azure** (Azure LLM inference traces 2023/2024): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  the timestamp a date and time (``2023-11-16 18:15:46.6805900``).
- **BurstGPT**: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``, the
  timestamp in seconds. A row with no response tokens (a request that failed there) still sends its
  prompt: it becomes a one-token request. ``Model`` and ``Log Type`` go to the request's
  ``extra_args`` (``model``, ``log_type``), where a policy can read them.
- **Mooncake**: JSONL ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``:
  each hash id stands for a 512-token block of the prompt, and equal ids are equal blocks, so the
  prompts get token ids (the same ids for the same block) and share prefixes as the trace says.

Times become seconds from the trace's first request. ``time_scale`` multiplies them (0.5: twice as
fast), ``window`` keeps the requests that arrived in ``[start, end)`` seconds of the original trace,
and ``sample`` keeps each request with that probability (seeded).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cadence.sim.workload import FIRST_ORDINARY_ID, SYNTHETIC_VOCAB, RequestSpec, load_trace

FORMATS = ("auto", "cadence", "azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class TraceOptions:
    """How to read a trace file: its format (``auto``: by suffix and header), time scale, window, sample."""

    format: str = "auto"
    time_scale: float = 1.0
    window: tuple[float, float] | None = None
    sample: float = 1.0
    seed: int = 0
    vocab_size: int = SYNTHETIC_VOCAB  # Mooncake's blocks get token ids below it

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown trace format {self.format!r}; known: {', '.join(FORMATS)}")
        if not self.time_scale > 0:
            raise ValueError(f"the trace's time scale must be > 0, got {self.time_scale}")
        if not 0 < self.sample <= 1:
            raise ValueError(f"the trace sample must be in (0, 1], got {self.sample}")
        if self.window is not None and not 0 <= self.window[0] < self.window[1]:
            raise ValueError(f"the trace window must be START:END seconds with 0 <= START < END, got {self.window}")

    @classmethod
    def from_args(cls, ns: argparse.Namespace, vocab_size: int = SYNTHETIC_VOCAB) -> TraceOptions:
        window = None
        if ns.trace_window:
            try:
                start, end = (float(bound) for bound in ns.trace_window.split(":"))
            except ValueError:
                raise ValueError(f"--trace-window takes START:END in seconds, got {ns.trace_window!r}") from None
            window = (start, end)
        return cls(ns.trace_format, ns.trace_time_scale, window, ns.trace_sample, ns.seed, vocab_size)


def add_trace_args(group: argparse._ArgumentGroup) -> None:
    """The options of :class:`TraceOptions`, as ``simulate`` and ``bench serve`` take them."""
    group.add_argument("--trace-format", default="auto", choices=FORMATS,
                       help="the trace file's format (auto: by suffix and header; docs/research.md)")
    group.add_argument("--trace-time-scale", type=float, default=1.0,
                       help="multiply the trace's arrival times by this (0.5 replays twice as fast)")
    group.add_argument("--trace-window", default=None, metavar="START:END",
                       help="keep the requests that arrived in [START, END) seconds of the trace")
    group.add_argument("--trace-sample", type=float, default=1.0,
                       help="keep each request of the trace with this probability (seeded by --seed)")


def load_workload(path: str | Path, options: TraceOptions = TraceOptions()) -> list[RequestSpec]:
    """The trace at ``path`` as a workload sorted by arrival, its first arrival at 0.

    :raises ValueError: for a file in none of the formats, or a malformed row (named).
    """
    path = Path(path)
    kind = options.format if options.format != "auto" else _detect(path)
    if kind == "cadence":
        specs = load_trace(path)
    elif kind == "mooncake":
        specs = sorted(_read_mooncake(path, options.vocab_size), key=lambda s: s.arrival_time)
    else:
        specs = sorted(_CSV_READERS[kind](path), key=lambda s: s.arrival_time)
    if not specs:
        raise ValueError(f"{path} holds no requests")
    origin = specs[0].arrival_time
    rng = random.Random(options.seed)
    kept = []
    for spec in specs:
        offset = spec.arrival_time - origin
        if options.window is not None and not options.window[0] <= offset < options.window[1]:
            continue
        if options.sample < 1 and rng.random() >= options.sample:
            continue
        kept.append(spec)
    if not kept:
        raise ValueError(f"no request of {path} is left after the window and the sample")
    start = kept[0].arrival_time
    return [replace(spec, arrival_time=(spec.arrival_time - start) * options.time_scale) for spec in kept]


def _detect(path: Path) -> str:
    with open(path) as f:
        first = f.readline()
    if path.suffix == ".csv":
        header = next(csv.reader([first]), [])
        for kind, columns in (("azure", _AZURE_COLUMNS), ("burstgpt", _BURSTGPT_COLUMNS)):
            if set(columns) <= {c.strip() for c in header}:
                return kind
        raise ValueError(f"{path}: a CSV trace needs Azure's columns {list(_AZURE_COLUMNS)} or BurstGPT's "
                         f"{list(_BURSTGPT_COLUMNS)}; its header is {header}")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        row = None
    return "mooncake" if isinstance(row, dict) and "input_length" in row else "cadence"


def _rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, newline="") as f:
        for number, row in enumerate(csv.DictReader(f, skipinitialspace=True), 2):
            yield number, {k.strip(): v for k, v in row.items() if k is not None}


def _read_azure(path: Path) -> Iterator[RequestSpec]:
    for number, row in _rows(path):
        yield _parsed(path, number, _azure_spec, row, str(number - 2))


def _azure_spec(row: dict[str, str], request_id: str) -> RequestSpec:
    return RequestSpec(_azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"])),
                       request_id=request_id)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any number of fraction digits)."""
    whole, _, fraction = text.strip().partition(".")
    moment = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def _read_burstgpt(path: Path) -> Iterator[RequestSpec]:
    for number, row in _rows(path):
        yield _parsed(path, number, _burstgpt_spec, row, str(number - 2))


def _burstgpt_spec(row: dict[str, str], request_id: str) -> RequestSpec:
    extra = {"model": row["Model"], **({"log_type": row["Log Type"]} if row.get("Log Type") else {})}
    return RequestSpec(float(row["Timestamp"]), int(row["Request tokens"]), max(1, int(row["Response tokens"])),
                       request_id=request_id, extra_args=extra)


def _read_mooncake(path: Path, vocab_size: int) -> Iterator[RequestSpec]:
    blocks: dict[int, list[int]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _parsed(path, number, _mooncake_spec, line, str(number - 1), blocks, vocab_size)


def _mooncake_spec(line: str, request_id: str, blocks: dict[int, list[int]], vocab_size: int) -> RequestSpec:
    row: dict[str, Any] = json.loads(line)
    length = int(row["input_length"])
    ids: list[int] = []
    for hash_id in row.get("hash_ids") or ():
        if hash_id not in blocks:  # the same block wherever it appears: seeded by its id
            block_rng = random.Random(int(hash_id))
            blocks[hash_id] = [block_rng.randrange(FIRST_ORDINARY_ID, vocab_size)
                               for _ in range(MOONCAKE_BLOCK_TOKENS)]
        ids += blocks[hash_id]
    if len(ids) < length:  # fewer blocks than the prompt: the rest is its own
        tail_rng = random.Random(f"{request_id}-tail")
        ids += [tail_rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(length - len(ids))]
    return RequestSpec(float(row["timestamp"]) / 1000.0, length, max(1, int(row["output_length"])),
                       request_id=request_id, prompt_token_ids=tuple(ids[:length]))


def _parsed(path: Path, number: int, parse: Callable[..., RequestSpec], *args: Any) -> RequestSpec:
    """``parse(*args)``, a malformed row named by its file and line."""
    try:
        return parse(*args)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}:{number}: {type(exc).__name__}: {exc}") from None


_CSV_READERS = {"azure": _read_azure, "burstgpt": _read_burstgpt}
