"""Sampling parameters of one request, validated once at the boundary."""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

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
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids")
        if self.logit_bias:
            _check(all(-100 <= b <= 100 for b in self.logit_bias.values()),
                   "logit_bias values must be in [-100, 100]")

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
