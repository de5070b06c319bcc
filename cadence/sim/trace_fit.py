"""Calibration from a scheduling trace: the cost model of the steps a served run took
(``cadence simulate calibrate --from-trace FILE``).

A trace (``core/scheduling_trace.py``) holds, for every step, when it was scheduled (its events'
time), when it ended (its ``end`` event) and what each request got in it (its ``scheduled``
events: tokens from a position, and whether a token came out), and opens with what the steps ran
on, the quantized kernel's row limit among it. That is a step's shape and its cycle, the time from
its start to the next one's, as the calibration's timed plan gives them (``sim/calibrate.py``): a
served run is then its own calibration, on the machine, at the hour, and under the load it had.
Steps apart by an idle moment (nothing to run until an arrival) are left out as a calibration
leaves them out. A trace with speculative decoding is refused: its ``scheduled`` events do not say
which tokens were drafts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from cadence.core.cost_model import CostModel, FitQuality, step_shape
from cadence.sim.calibrate import TimedStep, fit_steps


def trace_steps(path: str | Path, phase: int = 1) -> tuple[dict[str, Any], list[TimedStep]]:
    """A trace's description of its engine (its ``engine`` event, less the event's own keys) and its
    steps in order, timed from their start to their end, as ``phase``.

    :raises ValueError: if the file is no scheduling trace of this version, or one with speculation.
    """
    decode = msgspec.json.Decoder().decode
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    chunks: dict[int, list[tuple[int, int, bool, int]]] = defaultdict(list)
    description: dict[str, Any] | None = None
    with open(path, "rb") as file:
        for line in file:
            try:
                event = decode(line)
                kind = event["event"]
                if description is None:
                    if kind != "engine":
                        raise ValueError(f"{path} does not open with the engine it ran on (an 'engine' event): "
                                         "record it again with this version of cadence")
                    description = {k: v for k, v in event.items() if k not in ("event", "step", "t")}
                elif kind == "scheduled":
                    step, tokens, start = event["step"], event["tokens"], event["start"]
                    starts.setdefault(step, event["t"])
                    chunks[step].append((tokens, start + tokens, event["samples"], 0))
                elif kind == "end":
                    ends[event["step"]] = event["t"]
            except (msgspec.DecodeError, KeyError, TypeError):  # not JSON, or an event missing its fields
                raise ValueError(f"{path} is not a scheduling trace (--trace-scheduling): {line[:80]!r}") from None
    if description is None:
        raise ValueError(f"{path} is empty")
    if description.get("speculative"):
        raise ValueError(f"{path} was recorded with speculative decoding ({description['speculative']}): its steps "
                         "do not say which tokens were drafts, so their shapes cannot be rebuilt")
    limit = description.get("kernel_row_limit")
    steps = [TimedStep(phase, starts[step], ends[step], step_shape(chunks[step], limit))
             for step in sorted(chunks) if step in ends]
    return description, steps


def fit_traces(paths: Sequence[str | Path]) -> tuple[CostModel, FitQuality]:
    """The cost model of the steps in the traces of ``paths`` (one engine's runs, or a fleet's
    engines on one machine: they must describe the same engine), with its description.

    :raises ValueError: for a file :func:`trace_steps` refuses, traces of different engines, or too
        few back-to-back steps to fit.
    """
    if not paths:
        raise ValueError("no trace to fit")
    steps: list[TimedStep] = []
    description: dict[str, Any] = {}
    for phase, path in enumerate(paths, 1):  # a phase each: no cycle spans two files
        described, traced = trace_steps(path, phase)
        if description and described != description:
            raise ValueError(f"{path} was recorded on another engine than {paths[0]}: "
                             f"{_difference(description, described)}")
        description = described
        steps.extend(traced)
    source = {"source": "scheduling trace", "traces": [str(p) for p in paths]}
    return fit_steps(steps, {**description, **source}, skip_phases=())


def _difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    differ = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)!r} against {b.get(k)!r}" for k in differ)
