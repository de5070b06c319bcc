"""Simulator workloads: synthetic arrivals (Poisson or Gamma) with length distributions, or a JSONL trace.

A workload is a list of :class:`RequestSpec` sorted by arrival time. A trace line is a JSON object::

    {"arrival_time": 0.25, "prompt_tokens": 512, "output_tokens": 128, "priority": 0, "user": "a"}

``arrival_time`` is in seconds from the start, ``prompt_tokens`` a count or the token ids themselves
(ids let requests share prefixes, so prefix caching shows), ``output_tokens`` how many tokens the
request generates (it ends by length, EOS ignored); ``priority`` (lower first), ``user``,
``request_id`` and ``extra_args`` (an object of strings, numbers and booleans a policy reads as
``request.extra_args``, as the API's ``vllm_xargs``: a deadline, an SLO class) are optional.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cadence.sampling_params import ExtraArg

# Prompts made up of random token ids draw them from FIRST_ORDINARY_ID up (most vocabularies keep
# their special tokens among the first ids), below the model's vocabulary size, or SYNTHETIC_VOCAB
# where no model is at hand (the simulator).
FIRST_ORDINARY_ID = 100
SYNTHETIC_VOCAB = 32000

_TRACE_KEYS = {"arrival_time", "prompt_tokens", "output_tokens", "priority", "user", "request_id", "extra_args"}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it arrives, how long its prompt is, how many tokens it makes."""

    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    user: str | None = None
    request_id: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # from a trace; else the simulator makes unique ids
    extra_args: Mapping[str, ExtraArg] | None = None  # the request's own fields for policies

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"a request needs at least one prompt token, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"a request needs at least one output token, got {self.output_tokens}")
        if not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be a finite number of seconds >= 0, got {self.arrival_time}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_tokens:
            raise ValueError("prompt_token_ids and prompt_tokens disagree")


# ---- arrivals -------------------------------------------------------------------------------


def arrival_times(num: int, rate: float, burstiness: float = 1.0, *,
                  rng: np.random.Generator) -> np.ndarray:
    """``num`` arrival times (seconds): the first at 0, then Gamma-distributed gaps as in vLLM's
    ``bench serve``: shape ``burstiness``, mean ``1 / rate``. ``burstiness`` 1 is a Poisson
    process; below 1 is burstier, above 1 steadier. ``rate`` ``inf`` sends everything at 0.

    :raises ValueError: for a rate or burstiness that is not positive.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf for all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


# ---- lengths --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, written ``N`` (fixed), ``uniform:LO:HI`` (inclusive),
    ``normal:MEAN:STD``, ``lognormal:MEAN:SIGMA`` (MEAN of the lengths, SIGMA of their log) or
    ``exponential:MEAN``. Samples are rounded and clipped to at least 1."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        """:raises ValueError: naming the accepted forms when ``spec`` is not one of them."""
        text = str(spec).strip()
        if text.isdigit():
            return cls("fixed", (float(text),)).validated()
        kind, _, rest = text.partition(":")
        arity = {"uniform": 2, "normal": 2, "lognormal": 2, "exponential": 1}
        try:
            params = tuple(float(x) for x in rest.split(":"))
        except ValueError:
            params = ()
        if arity.get(kind) == len(params):
            return cls(kind, params).validated()
        raise ValueError(f"cannot read length distribution {spec!r}; write N, uniform:LO:HI, normal:MEAN:STD, "
                         "lognormal:MEAN:SIGMA or exponential:MEAN")

    def validated(self) -> LengthDist:
        p = self.params
        ok = {
            "fixed": lambda: p[0] >= 1,
            "uniform": lambda: 1 <= p[0] <= p[1],
            "normal": lambda: p[0] >= 1 and p[1] >= 0,
            "lognormal": lambda: p[0] >= 1 and p[1] >= 0,
            "exponential": lambda: p[0] >= 1,
        }[self.kind]()
        if not ok:
            raise ValueError(f"length distribution {self} has out-of-range parameters (lengths are >= 1)")
        return self

    def sample(self, num: int, rng: np.random.Generator) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            values = np.full(num, p[0])
        elif self.kind == "uniform":
            values = rng.integers(int(p[0]), int(p[1]), size=num, endpoint=True).astype(np.float64)
        elif self.kind == "normal":
            values = rng.normal(p[0], p[1], size=num)
        elif self.kind == "lognormal":
            # Parameterised by the mean of the lengths: mu = log(mean) - sigma^2 / 2.
            values = rng.lognormal(math.log(p[0]) - p[1] ** 2 / 2, p[1], size=num)
        else:
            values = rng.exponential(p[0], size=num)
        return np.maximum(1, np.rint(values)).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        return ":".join([self.kind, *(f"{x:g}" for x in self.params)])


# ---- synthetic workloads --------------------------------------------------------------------


def parse_tenants(spec: str | int | None) -> dict[str, float]:
    """``"3"`` -> three equal tenants ``tenant-0..2``; ``"a=3,b=1"`` -> weights; ``None`` -> none.

    :raises ValueError: for a malformed spec or a weight that is not positive.
    """
    if spec is None or str(spec).strip() in ("", "0"):
        return {}
    text = str(spec).strip()
    if text.isdigit():
        return {f"tenant-{i}": 1.0 for i in range(int(text))}
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            value = -1.0
        if not name.strip() or not value > 0:
            raise ValueError(f"cannot read tenants {spec!r}; write a count (3) or NAME=WEIGHT,... (a=3,b=1)")
        weights[name.strip()] = value
    return weights


def synthetic_workload(
    num_requests: int,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    input_len: LengthDist | str | int = 256,
    output_len: LengthDist | str | int = 128,
    tenants: dict[str, float] | str | int | None = None,
    priority_levels: int = 1,
    seed: int = 0,
) -> list[RequestSpec]:
    """``num_requests`` requests with Gamma arrivals (Poisson at ``burstiness`` 1) and drawn lengths.

    Tenants are drawn by weight and priorities uniformly from ``0 .. priority_levels - 1``; every
    draw comes from one generator seeded with ``seed``, in a fixed order.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if priority_levels < 1:
        raise ValueError(f"priority_levels must be >= 1, got {priority_levels}")
    rng = np.random.default_rng(seed)
    times = arrival_times(num_requests, request_rate, burstiness, rng=rng)
    inputs = _dist(input_len).sample(num_requests, rng)
    outputs = _dist(output_len).sample(num_requests, rng)
    weights = tenants if isinstance(tenants, dict) else parse_tenants(tenants)
    users: list[str | None] = [None] * num_requests
    if weights:
        names = list(weights)
        probs = np.array([weights[n] for n in names])
        users = [names[i] for i in rng.choice(len(names), size=num_requests, p=probs / probs.sum())]
    priorities = rng.integers(0, priority_levels, size=num_requests)
    return [
        RequestSpec(arrival_time=float(times[i]), prompt_tokens=int(inputs[i]), output_tokens=int(outputs[i]),
                    priority=int(priorities[i]), user=users[i], request_id=str(i))
        for i in range(num_requests)
    ]


def _dist(value: LengthDist | str | int) -> LengthDist:
    return value if isinstance(value, LengthDist) else LengthDist.parse(value)


# ---- traces ---------------------------------------------------------------------------------


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace (see the module docstring), sorted by arrival time (stable).

    :raises ValueError: naming the file and line of a malformed entry.
    """
    specs: list[RequestSpec] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                specs.append(_spec_from_json(json.loads(line), default_id=str(len(specs))))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    specs.sort(key=lambda s: s.arrival_time)
    return specs


def _spec_from_json(row: Any, default_id: str) -> RequestSpec:
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    unknown = set(row) - _TRACE_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}; a trace line has {sorted(_TRACE_KEYS)}")
    missing = {"arrival_time", "prompt_tokens", "output_tokens"} - set(row)
    if missing:
        raise ValueError(f"missing key(s) {sorted(missing)}")
    prompt = row["prompt_tokens"]
    ids: tuple[int, ...] | None = None
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError("prompt_tokens as a list must hold token ids (integers >= 0)")
        ids = tuple(prompt)
        prompt = len(ids)
    elif not isinstance(prompt, int) or isinstance(prompt, bool):
        raise ValueError(f"prompt_tokens must be a count or a list of token ids, got {prompt!r}")
    output = row["output_tokens"]
    if not isinstance(output, int) or isinstance(output, bool):
        raise ValueError(f"output_tokens must be an integer, got {output!r}")
    user = row.get("user")
    extra = row.get("extra_args")
    if extra is not None and not (isinstance(extra, dict) and all(
            isinstance(v, str | int | float) for v in extra.values())):
        raise ValueError(f"extra_args must be an object of strings, numbers and booleans, got {extra!r}")
    return RequestSpec(
        arrival_time=float(row["arrival_time"]),
        prompt_tokens=prompt,
        output_tokens=output,
        priority=int(row.get("priority", 0)),
        user=None if user is None else str(user),
        request_id=str(row.get("request_id", default_id)),
        prompt_token_ids=ids,
        extra_args=extra or None,
    )


def save_trace(specs: Iterable[RequestSpec], path: str | Path) -> None:
    """Write a workload as a JSONL trace that :func:`load_trace` reads back to the same specs."""
    with open(path, "w") as f:
        for spec in specs:
            row: dict[str, Any] = {
                "arrival_time": spec.arrival_time,
                "prompt_tokens": list(spec.prompt_token_ids) if spec.prompt_token_ids else spec.prompt_tokens,
                "output_tokens": spec.output_tokens,
            }
            if spec.priority:
                row["priority"] = spec.priority
            if spec.user is not None:
                row["user"] = spec.user
            if spec.request_id is not None:
                row["request_id"] = spec.request_id
            if spec.extra_args:
                row["extra_args"] = dict(spec.extra_args)
            f.write(json.dumps(row) + "\n")


def describe(specs: Sequence[RequestSpec]) -> str:
    """One line: count, span, mean lengths."""
    if not specs:
        return "0 requests"
    span = specs[-1].arrival_time - specs[0].arrival_time
    mean_in = sum(s.prompt_tokens for s in specs) / len(specs)
    mean_out = sum(s.output_tokens for s in specs) / len(specs)
    rate = f"{(len(specs) - 1) / span:.2f} req/s" if span > 0 else "all at once"
    return (f"{len(specs)} requests over {span:.1f} s ({rate}), "
            f"mean prompt {mean_in:.0f} tokens, mean output {mean_out:.0f} tokens")
