"""Each soak request's outcome: completed (a valid body or stream), abandoned on purpose, or lost
(anything else), and the accounting by kind. Pure functions of what the client saw."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadence.bench.soak.load import Attempt, Spec, text_of

COMPLETED, ABANDONED, LOST = "completed", "abandoned", "lost"
FINISH_REASONS = ("stop", "length")


@dataclass
class Outcome:
    kind: str
    status: str  # COMPLETED, ABANDONED or LOST
    reason: str
    tokens: int
    latency_s: float
    ttft_s: float | None = None


def _check_json(spec: Spec, index: int, text: str) -> str | None:
    assert spec.json_schema is not None
    try:
        value = json.loads(text)
    except ValueError:
        return f"choice {index}: structured output is not JSON: {text[:60]!r}"
    missing = [k for k in spec.json_schema.get("required", []) if not isinstance(value, dict) or k not in value]
    return f"choice {index}: structured output lacks {missing}" if missing else None


def check_body(spec: Spec, body: Any) -> tuple[str | None, int]:
    """``(problem or None, completion tokens)`` for a non-streamed 200 response."""
    if not isinstance(body, dict):
        return "body is not a JSON object", 0
    if "error" in body:
        return f"error body: {body['error']}", 0
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != spec.n:
        return f"{len(choices) if isinstance(choices, list) else 'no'} choices, expected {spec.n}", 0
    if sorted(c.get("index", -1) for c in choices if isinstance(c, dict)) != list(range(spec.n)):
        return f"choice indices {[c.get('index') for c in choices]}, expected 0..{spec.n - 1}", 0
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int):
        return "no usage.completion_tokens", 0
    for choice in choices:
        index, reason = choice["index"], choice.get("finish_reason")
        if reason not in FINISH_REASONS:
            return f"choice {index}: finish_reason {reason!r}", tokens
        text = text_of(choice, spec.endpoint, streamed=False)
        if not isinstance(text, str):
            return f"choice {index}: no text", tokens
        if spec.logprobs and text and choice.get("logprobs") is None:
            return f"choice {index}: logprobs asked for, none returned", tokens
        if spec.json_schema is not None and reason == "stop" and (problem := _check_json(spec, index, text)):
            return problem, tokens
    return None, tokens


def check_stream(spec: Spec, events: Sequence[Any]) -> tuple[str | None, int]:
    """``(problem or None, completion tokens)`` for a whole stream (200): every choice finishes, then
    ``[DONE]``. Tokens: the usage chunk's, else the number of chunks that carried text."""
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    chunks_with_text, usage_tokens, done = 0, None, False
    for event in events:
        if done:
            return "data after [DONE]", chunks_with_text
        if event == "[DONE]":
            done = True
            continue
        if not isinstance(event, dict):
            return f"event is not a JSON object: {str(event)[:60]!r}", chunks_with_text
        if "error" in event:
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            return f"error event ({code}): {str(error)[:120]}", chunks_with_text
        for choice in event.get("choices") or []:
            index = choice.get("index")
            if not isinstance(index, int) or not 0 <= index < spec.n:
                return f"chunk for choice {index!r}, expected 0..{spec.n - 1}", chunks_with_text
            piece = text_of(choice, spec.endpoint, streamed=True)
            if piece:
                if index in finished:
                    return f"choice {index}: text after its finish_reason", chunks_with_text
                chunks_with_text += 1
                texts[index] = texts.get(index, "") + piece
            if choice.get("finish_reason") is not None:
                finished[index] = choice["finish_reason"]
        if isinstance(event.get("usage"), dict):
            usage_tokens = event["usage"].get("completion_tokens")
    tokens = usage_tokens if isinstance(usage_tokens, int) else chunks_with_text
    if not done:
        return "stream ended without [DONE]", tokens
    if sorted(finished) != list(range(spec.n)):
        return f"choices {sorted(set(range(spec.n)) - set(finished))} never got a finish_reason", tokens
    for index, reason in sorted(finished.items()):
        if reason not in FINISH_REASONS:
            return f"choice {index}: finish_reason {reason!r}", tokens
        if spec.json_schema is not None and reason == "stop" and (
                problem := _check_json(spec, index, texts.get(index, ""))):
            return problem, tokens
    if spec.body.get("stream_options", {}).get("include_usage") and usage_tokens is None:
        return "include_usage asked for, no usage chunk", tokens
    return None, tokens


def classify(spec: Spec, attempt: Attempt) -> Outcome:
    """Every request is completed, abandoned on purpose, or lost: nothing else."""

    def outcome(status: str, reason: str, tokens: int = 0) -> Outcome:
        return Outcome(spec.kind, status, reason, tokens, attempt.latency_s, attempt.ttft_s)

    if attempt.abandoned is not None:
        return outcome(ABANDONED, attempt.abandoned, check_stream(spec, attempt.events)[1] if spec.stream else 0)
    if attempt.hung:
        return outcome(LOST, "no end within the hang guard")
    if attempt.status is None or attempt.error is not None:
        return outcome(LOST, f"transport: {attempt.error}")
    if attempt.status != 200:
        error = attempt.body.get("error") if isinstance(attempt.body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        return outcome(LOST, f"HTTP {attempt.status} ({code})")
    problem, tokens = check_stream(spec, attempt.events) if spec.stream else check_body(spec, attempt.body)
    return outcome(LOST, problem, tokens) if problem else outcome(COMPLETED, "", tokens)


@dataclass
class KindStats:
    sent: int = 0
    completed: int = 0
    abandoned: int = 0
    lost: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # completed requests only


def account(outcomes: Iterable[Outcome]) -> dict[str, KindStats]:
    """Counts by kind, and under ``"all"``; ``sent == completed + abandoned + lost`` for each."""
    table: dict[str, KindStats] = {}
    for o in outcomes:
        for key in (o.kind, "all"):
            s = table.setdefault(key, KindStats())
            s.sent += 1
            s.tokens += o.tokens
            if o.status == COMPLETED:
                s.completed += 1
                s.latencies.append(o.latency_s)
            elif o.status == ABANDONED:
                s.abandoned += 1
            else:
                s.lost += 1
    if "all" in table:  # the total row last
        table["all"] = table.pop("all")
    return table
