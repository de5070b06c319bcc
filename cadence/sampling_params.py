"""Sampling parameters of one request, validated once at the boundary."""

from __future__ import annotations

import json as _json
import math
import struct
from collections.abc import Callable
from typing import Any

import msgspec

# The values a request's extra_args may hold (what JSON and msgpack both carry as scalars).
ExtraArg = str | int | float | bool

# Sampler treats these as "off"; named so the checks below read as intent.
_GREEDY_EPS = 1e-5


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A constraint the output must match, named as vLLM names it: set exactly one field.

    ``json`` is a JSON schema (text or parsed), ``regex`` a regular expression the whole output
    matches, ``choice`` the strings the output may be, ``grammar`` an EBNF grammar (xgrammar's
    dialect, llama.cpp's GBNF), and ``json_object`` any JSON object or array (OpenAI's JSON mode).
    Construction checks the shape; whether a schema, regex or grammar compiles is checked by
    :func:`cadence.core.structured_output.check_constraint` when the request is validated.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs takes exactly one of json, regex, choice, grammar or "
                                f"json_object, got {', '.join(given) or 'none'}")
        _check(self.choice is None or len(self.choice) > 0, "structured_outputs.choice must list at least one option")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif self.json is not None:
            # Decoded from msgpack, a schema may hold what JSON cannot (bytes, arrays): refuse it
            # here, where a frame is still dropped, not when the engine core compiles its key.
            try:
                _json.dumps(self.json)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ValueError(f"structured_outputs.json is not a JSON value: {exc}") from None

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, spec)``: equal for constraints that compile to the same grammar.

        A schema's key is its compact JSON (key order kept: it fixes the order of the output's
        properties), so schemas that differ only in whitespace share one compiled grammar.
        """
        if self.json is not None:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice, ensure_ascii=False)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How to pick tokens and when to stop, mirroring vLLM's names and defaults.

    Construction validates every field and raises ``ValueError`` that says what to change.
    ``top_k`` of 0 or -1 disables top-k; ``temperature`` 0 means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (from the second on) with this many top tokens each; the
    # request then skips the prefix cache, as in vLLM: a cached prefix computes no logits.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # A request's own fields for scheduling policies and plugins (a deadline, an SLO class), as
    # vLLM's ``extra_args``; the HTTP API takes them as ``vllm_xargs``. Nothing built in reads them.
    extra_args: dict[str, ExtraArg] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check_float("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check(self.top_k >= -1, f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_float("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
               f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids")
        for bias in (self.logit_bias or {}).values():
            _check_float("logit_bias values", bias, lambda v: -100 <= v <= 100, "in [-100, 100]", show=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_float(name: str, value: float, ok: Callable[[float], bool], rule: str, *, show: bool = True) -> None:
    """``value`` must be finite and satisfy ``ok``, and so must its float32 rounding (what the
    sampler computes with): a top_p of 1e-50 is in (0, 1] but float32 makes it 0.

    The message starts with ``name`` (the API names the field from it); it says ``rule`` alone
    for a finite value outside it, as it always did.
    """
    got = f", got {value}" if show else ""
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    _check(finite, f"{name} must be {rule} and finite{got}")
    _check(ok(value), f"{name} must be {rule}{got}")
    single = _float32(value)
    if not (math.isfinite(single) and ok(single)):
        raise ValueError(f"{name} must be {rule} and representable in float32{got} (float32 rounds it to {single})")


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (inf when it overflows)."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)
