"""Reading a scheduling trace (``core/scheduling_trace.py``): why one request was slow, and two runs of
the same workload compared request by request (``cadence trace explain`` / ``cadence trace diff``).

The engine and the simulator write the same events, so any two traces compare: two policies in the
simulator, a simulated policy against the real engine on the same trace (requests match by id: the
simulator's are the workload's ``request_id``; the engine's are its own sequence ids, with the
caller's request id as ``client_id``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from itertools import groupby
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

Event = dict[str, Any]


@dataclass
class Story:
    """One request's own events, and what kept it waiting."""

    request: str
    arrival: Event
    events: list[Event] = field(default_factory=list)  # scheduled, skipped, preempted, grammar, adapter, finished
    # [first step, step it left) of each time it waited: from its arrival or preemption to its
    # admission or finish (None: still waiting when the trace ends).
    spans: list[list[int | None]] = field(default_factory=list)
    step_ends: dict[int, float] = field(default_factory=dict)
    blocked: dict[int, Event] = field(default_factory=dict)  # the trace's, by step

    @cached_property
    def waits(self) -> list[tuple[int, str]]:
        """(step, why) for each step it waited in which admission stopped: at the head of the queue,
        or behind the head, for the head's reason. Read from the spans, so a trace's reader does
        work in proportion to the waits it is asked about, not to every request times every step."""
        last = max(self.blocked, default=0) + 1
        waits = []
        for start, end in self.spans:
            assert start is not None
            for step in range(start, last if end is None else end):
                event = self.blocked.get(step)
                if event is not None:
                    where = "at the head of the queue" if event["head"] == self.request else "behind the head"
                    waits.append((step, f"{where}: {event['reason']}"))
        return waits

    @property
    def arrival_time(self) -> float:
        return float(self.arrival["t"])

    def first(self, name: str, **match: Any) -> Event | None:
        return next((e for e in self.events if e["event"] == name and all(e.get(k) == v for k, v in match.items())),
                    None)

    @property
    def first_token_time(self) -> float | None:
        event = self.first("scheduled", samples=True)
        return None if event is None else self.step_ends.get(event["step"], event["t"])

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.arrival_time

    @property
    def e2e(self) -> float | None:
        finished = self.first("finished")
        return None if finished is None else finished["t"] - self.arrival_time

    @property
    def num_preemptions(self) -> int:
        return sum(e["event"] == "preempted" for e in self.events)


class TraceFile:
    """Every request's story in one trace file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        decoder = msgspec.json.Decoder()
        try:
            events: list[Event] = [decoder.decode(line) for line in self.path.read_bytes().splitlines() if line]
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"cannot read scheduling trace {path}: {exc}") from None
        self.stories: dict[str, Story] = {}
        self.step_ends = {e["step"]: e["t"] for e in events if e["event"] == "end"}
        # A step's ``blocked`` event is written before its admissions: a request admitted (or
        # finished) in step s was not waiting behind it, so its wait ends at s, exclusive.
        self.blocked = {e["step"]: e for e in events if e["event"] == "blocked"}
        for event in events:
            kind = event["event"]
            if kind == "arrival":
                story = Story(event["request"], event, spans=[[event["step"], None]], step_ends=self.step_ends,
                              blocked=self.blocked)
                self.stories[story.request] = story
            elif kind != "blocked" and event.get("request") in self.stories:
                story = self.stories[event["request"]]
                story.events.append(event)
                waiting = story.spans[-1][1] is None
                if waiting and ((kind == "scheduled" and event.get("admitted")) or kind == "finished"):
                    story.spans[-1][1] = event["step"]
                elif kind == "preempted" and not waiting:
                    story.spans.append([event["step"], None])

    def find(self, request: str) -> list[Story]:
        """The request with this id, or every sequence of the caller's request with this id.

        :raises ValueError: when no request matches.
        """
        if request in self.stories:
            return [self.stories[request]]
        found = [s for s in self.stories.values() if s.arrival.get("client_id") == request]
        if not found:
            raise ValueError(f"no request {request!r} in {self.path} ({len(self.stories)} requests)")
        return found


def explain(story: Story) -> str:
    """The story of one request, a line per phase: waits (and why), admission, prefill chunks, first
    token, decoding, preemptions, finish."""
    a = story.arrival
    origin = story.arrival_time
    client = f" (client id {a['client_id']})" if a.get("client_id") else ""
    lines = [f"request {story.request}{client}: {a['prompt_tokens']} prompt tokens, max_tokens {a['max_tokens']}, "
             f"priority {a['priority']}, user {a['user'] or '-'}" + (f", extra_args {a['extra_args']}"
                                                                     if a.get("extra_args") else "")]

    def at(event: Event) -> str:
        return f"+{event['t'] - origin:8.3f} s  step {event['step']:>6}"

    lines.append(f"{at(a)}  arrived")
    used = 0  # story.waits told so far
    for kind, group in groupby(story.events, key=_phase):
        run = list(group)
        spell = used
        while used < len(story.waits) and story.waits[used][0] < run[0]["step"]:
            used += 1
        if used > spell:
            lines.append(_waited(story.waits[spell:used]))
        lines.append(f"{at(run[0])}  {_describe(kind, run, story)}")
    if used < len(story.waits):  # still waiting when the trace ends
        lines.append(_waited(story.waits[used:]))
    lines.append(f"TTFT {_seconds(story.ttft)}, end to end {_seconds(story.e2e)}, "
                 f"{story.num_preemptions} preemption(s), waited {len(story.waits)} steps")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _waited(spell: list[tuple[int, str]]) -> str:
    reasons = Counter(why for _, why in spell)
    return (f"{'':>24}  waited {len(spell)} steps ({spell[0][0]}-{spell[-1][0]}): "
            + ", ".join(f"{n} {why}" for why, n in reasons.most_common()))


def _phase(event: Event) -> str:
    kind = event["event"]
    if kind != "scheduled":
        return f"{kind}:{event['step']}"
    if event.get("admitted"):
        return f"admitted:{event['step']}"
    return "decode" if event["tokens"] == 1 and event["samples"] else "prefill"


def _describe(kind: str, run: list[Event], story: Story) -> str:
    first = run[0]
    name = kind.split(":")[0]
    if name == "admitted":
        chunk = f"first chunk {first['tokens']} tokens" + (", first token" if first["samples"] else "")
        return f"admitted: {first['cached']} prompt tokens from the prefix cache; {chunk}"
    if name == "prefill":
        last = run[-1]
        tail = "; first token at its end" if last["samples"] and last is story.first("scheduled", samples=True) else ""
        return f"prefill chunks {', '.join(str(e['tokens']) for e in run)} (steps {first['step']}-{last['step']}){tail}"
    if name == "decode":
        return f"decoded {len(run)} tokens in steps {first['step']}-{run[-1]['step']}"
    if name == "preempted":
        why = "yielded" if first["by"] == story.request else f"preempted for request {first['by']}"
        return f"{why} ({first['reason']}): its KV blocks freed, back to waiting"
    if name == "skipped":
        return f"skipped: nothing this step ({first['reason']})"
    if name == "grammar":
        return "passed over: its grammar was compiling"
    if name == "adapter":
        return "passed over: --max-loras other LoRA adapters were running"
    return f"finished: {first['reason']}"


def diff(a: TraceFile, b: TraceFile, top: int = 20) -> str:
    """Two runs of the same workload, request by request: each run's TTFT and end-to-end latency
    percentiles, then the ``top`` requests whose TTFT moved most."""
    common = sorted(set(a.stories) & set(b.stories))
    if not common:
        raise ValueError(f"{a.path} and {b.path} share no request id (are they runs of the same workload?)")
    lines = [f"{len(common)} requests in both ({len(a.stories)} in A: {a.path}; {len(b.stories)} in B: {b.path})",
             f"{'':24}{'A':>12}{'B':>12}"]
    for title, metric in (("TTFT", "ttft"), ("end to end", "e2e")):
        for q in (50, 99):
            values = [[getattr(t.stories[r], metric) for r in common] for t in (a, b)]
            cells = [np.percentile([v for v in vs if v is not None], q) if any(v is not None for v in vs)
                     else float("nan") for vs in values]
            lines.append(f"{title + f' p{q} (s)':24}{cells[0]:12.3f}{cells[1]:12.3f}")
    for title, count in (("waited steps", lambda s: len(s.waits)), ("preemptions", lambda s: s.num_preemptions)):
        lines.append(f"{title + ' (sum)':24}{sum(count(a.stories[r]) for r in common):12d}"
                     f"{sum(count(b.stories[r]) for r in common):12d}")
    moved = [(r, a.stories[r].ttft, b.stories[r].ttft) for r in common]
    moved = [m for m in moved if m[1] is not None and m[2] is not None]
    moved.sort(key=lambda m: abs(m[2] - m[1]), reverse=True)  # type: ignore[operator]
    lines.append(f"\nrequests whose TTFT moved most (s):\n{'request':>12}{'A':>10}{'B':>10}{'B - A':>10}"
                 f"{'waited A':>10}{'waited B':>10}")
    for request, ttft_a, ttft_b in moved[:top]:
        lines.append(f"{request:>12}{ttft_a:10.3f}{ttft_b:10.3f}{ttft_b - ttft_a:+10.3f}"  # type: ignore[operator]
                     f"{len(a.stories[request].waits):10d}{len(b.stories[request].waits):10d}")
    return "\n".join(lines)
