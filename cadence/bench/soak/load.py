"""The soak's load: the kinds of request (MIX), each drawn as a Spec of what to send and what a valid
answer looks like, and the client that sends one and records what it saw (an Attempt)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cadence.bench.serve import sse_data

# Kinds of request and their weights (see build_spec).
MIX: tuple[tuple[str, int], ...] = (
    ("chat", 16), ("chat-stream", 16), ("completion", 12), ("completion-stream", 12),
    ("json", 8), ("shared-prefix", 12), ("disconnect", 14), ("cancel", 10),
)
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["name", "age", "city"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                   "maximum": 120}, "city": {"type": "string", "maxLength": 20}},
}
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment air "
    "teacher force education river garden light stone music paper engine window bridge market winter "
    "summer forest ocean cloud letter table chair bread apple orange silver golden quiet rapid bright "
    "gentle ancient modern simple strange careful happy heavy narrow open early late green blue red "
    "run walk write read build carry follow learn speak listen travel remember explain discover"
)
WORDS = tuple(_WORD_TEXT.split())


def parse_mix(text: str | None) -> tuple[tuple[str, int], ...]:
    """``kind=weight,...`` over MIX (kinds not named keep their weight; weight 0 drops one)."""
    weights = dict(MIX)
    for item in (text or "").split(","):
        if item.strip():
            kind, _, weight = item.partition("=")
            if kind.strip() not in weights or not weight.strip().isdigit():
                raise ValueError(f"--mix: {item!r} is not KIND=WEIGHT with KIND one of {', '.join(weights)}")
            weights[kind.strip()] = int(weight)
    if not any(weights.values()):
        raise ValueError("--mix: every weight is 0")
    return tuple((kind, w) for kind, w in weights.items() if w)


@dataclass
class Spec:
    """One request to send: what it is and what a valid answer to it looks like."""

    kind: str
    endpoint: str  # "chat" or "completion"
    body: dict[str, Any]
    n: int = 1
    logprobs: bool = False
    json_schema: dict[str, Any] | None = None
    disconnect_after: int | None = None  # close the stream after this many content chunks
    cancel_after_s: float | None = None  # client-side timeout, on purpose

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Attempt:
    """What the client saw of one request."""

    status: int | None = None  # the HTTP status, None when no response came
    body: Any = None  # a non-streamed response's JSON
    events: list[Any] = field(default_factory=list)  # a stream's data payloads; "[DONE]" as the string
    error: str | None = None  # a transport error, or the response was not JSON
    abandoned: str | None = None  # why the client ended it on purpose
    hung: bool = False  # the hang guard fired
    latency_s: float = 0.0
    ttft_s: float | None = None


def text_of(choice: dict[str, Any], endpoint: str, streamed: bool) -> Any:
    """A choice's text: a completion's ``text``, a chat message's (or streamed delta's) ``content``."""
    if endpoint == "completion":
        return choice.get("text")
    part = choice.get("delta" if streamed else "message")
    return part.get("content") if isinstance(part, dict) else None


# ---- request specs ----------------------------------------------------------------------------


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _num_words(rng: random.Random) -> int:
    roll = rng.random()
    return rng.randint(3, 30) if roll < 0.5 else rng.randint(50, 300) if roll < 0.85 else rng.randint(400, 1200)


def _max_tokens(rng: random.Random, long_max: int) -> int:
    return rng.randint(1, 32) if rng.random() < 0.5 else rng.randint(min(64, long_max), long_max)


def max_prompt_words(max_model_len: int | None, long_max: int) -> int:
    """The longest prompt (in WORDS, up to ~1.5 tokens each with a chat template's) that leaves room for
    ``long_max`` tokens of output."""
    return 4000 if max_model_len is None else max(8, min(4000, int((max_model_len - long_max - 64) / 1.5)))


def build_spec(kind: str, rng: random.Random, *, model: str | None, prefixes: Sequence[str], long_max: int,
               cancel_window: tuple[float, float], max_words: int = 4000) -> Spec:
    """A request of ``kind`` (one of MIX's) with its options drawn from ``rng``.

    ``cancel_window``: about when a ``long_max``-token request now gets its first token and when it
    ends (a cancel times out between them). ``max_words``: the longest prompt (the context's bound)."""
    chat = rng.random() < 0.5
    if kind in ("chat", "chat-stream", "json"):
        chat = True
    elif kind in ("completion", "completion-stream"):
        chat = False
    stream = kind.endswith("-stream") or kind == "disconnect" or (kind in ("json", "shared-prefix")
                                                                   and rng.random() < 0.5)
    text = random_text(rng, min(_num_words(rng), max_words))
    if kind == "shared-prefix":
        text = f"{rng.choice(prefixes)}\n\nQuestion {rng.randint(0, 10**6)}: {random_text(rng, rng.randint(3, 20))}"
    body: dict[str, Any] = {"max_tokens": _max_tokens(rng, long_max), "temperature": round(rng.uniform(0, 1), 2)}
    if model:
        body["model"] = model
    if chat:
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": random_text(rng, rng.randint(3, 15))})
        body["messages"] = messages
    else:
        body["prompt"] = text
    spec = Spec(kind, "chat" if chat else "completion", body)
    if stream:
        body["stream"] = True
        if rng.random() < 0.75:
            body["stream_options"] = {"include_usage": True}
    if kind != "cancel" and rng.random() < 0.3:
        spec.n = rng.choice((2, 2, 3, 4))
        body["n"] = spec.n
    if kind != "json" and rng.random() < 0.25:
        spec.logprobs = True
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["stop"] = rng.choice(([". "], ["\n"], [" the ", "."]))
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 2**31)
    if kind == "json":
        spec.json_schema = PERSON_SCHEMA
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
        body["max_tokens"] = 96
        body.pop("stop", None)
    elif kind == "disconnect":
        spec.disconnect_after = rng.randint(1, 5)
        body["max_tokens"] = rng.randint(min(64, long_max), long_max)
    elif kind == "cancel":
        body["max_tokens"] = long_max
        body["ignore_eos"] = True
        body.pop("stop", None)
        # Mostly part-way through the expected generation; a quarter give up at once, with a long
        # prompt: while the request is tokenized (in a thread), admitted, submitted.
        early = rng.random() < 0.25
        first, last = cancel_window
        after = rng.uniform(0.0, 0.1) if early else first + rng.uniform(0.05, 0.5) * (last - first)
        if early:
            key = "prompt" if "prompt" in body else "messages"
            long_text = random_text(rng, min(rng.randint(2000, 4000), max_words))
            body[key] = long_text if key == "prompt" else [{"role": "user", "content": long_text}]
        spec.cancel_after_s = round(after, 3)
    return spec


# ---- sending ------------------------------------------------------------------------------------


async def _exchange(session: aiohttp.ClientSession, url: str, spec: Spec, attempt: Attempt,
                    headers: dict[str, str]) -> None:
    started = time.monotonic()
    async with session.post(url, json=spec.body, headers=headers) as response:
        attempt.status = response.status
        if response.status != 200 or not spec.stream:
            raw = await response.read()
            try:
                attempt.body = json.loads(raw)
            except ValueError:
                attempt.error = None if response.status != 200 else f"response is not JSON: {raw[:60]!r}"
            return
        chunks = 0
        # Read on after [DONE] and keep what does not parse: the checks judge both (sse_data's framing).
        async for data in sse_data(response):
            try:
                event: Any = "[DONE]" if data == b"[DONE]" else json.loads(data)
            except ValueError:
                event = data.decode(errors="replace")
            attempt.events.append(event)
            if isinstance(event, dict) and "error" in event:
                return
            if isinstance(event, dict) and any(text_of(c, spec.endpoint, True) for c in event.get("choices") or []):
                chunks += 1
                if attempt.ttft_s is None:
                    attempt.ttft_s = time.monotonic() - started
                if spec.disconnect_after is not None and chunks >= spec.disconnect_after:
                    attempt.abandoned = f"disconnected after {chunks} chunks"
                    response.close()  # drop the connection, as a client that goes away does
                    return


async def send(session: aiohttp.ClientSession, base_url: str, spec: Spec, hang_guard_s: float,
               headers: dict[str, str]) -> Attempt:
    url = base_url + ("/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions")
    attempt = Attempt()
    limit = hang_guard_s if spec.cancel_after_s is None else min(spec.cancel_after_s, hang_guard_s)
    started = time.monotonic()
    try:
        await asyncio.wait_for(_exchange(session, url, spec, attempt, headers), limit)
    except asyncio.TimeoutError:
        if spec.cancel_after_s is not None and limit < hang_guard_s:
            attempt.abandoned = f"timed out on purpose after {limit:.2f} s"
        else:
            attempt.hung = True
    except Exception as exc:  # a transport error (aiohttp.ClientError, OSError), or anything else: lost
        attempt.error = f"{type(exc).__name__}: {exc}"
    attempt.latency_s = time.monotonic() - started
    return attempt
