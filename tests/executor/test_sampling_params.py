"""SamplingParams against what the sampler computes with: every float field finite, and valid once
rounded to float32 (a top_p of 1e-50 is in (0, 1] but float32 makes it 0, which once hung the
sampler). Messages start with the field's name, which the API reports as ``param``."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest

from cadence.sampling_params import SamplingParams, StructuredOutputsParams

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_p": 1e-50}, "top_p must be in (0, 1] and representable in float32, got 1e-50 (float32 rounds it to 0.0)"),
    ({"top_p": 1e-46}, "top_p must be in (0, 1] and representable in float32, got 1e-46 (float32 rounds it to 0.0)"),
    ({"top_p": NAN}, "top_p must be in (0, 1] and finite, got nan"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),  # as before: the API's tests hold these words
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"min_p": NAN}, "min_p must be in [0, 1] and finite, got nan"),
    ({"min_p": -INF}, "min_p must be in [0, 1] and finite, got -inf"),
    ({"temperature": INF}, "temperature must be >= 0 and finite, got inf"),
    ({"temperature": NAN}, "temperature must be >= 0 and finite, got nan"),
    ({"temperature": 1e39},
     "temperature must be >= 0 and representable in float32, got 1e+39 (float32 rounds it to inf)"),
    ({"temperature": 10**400}, f"temperature must be >= 0 and finite, got {10**400}"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"presence_penalty": INF}, "presence_penalty must be in [-2, 2] and finite, got inf"),
    ({"frequency_penalty": -INF}, "frequency_penalty must be in [-2, 2] and finite, got -inf"),
    ({"frequency_penalty": NAN}, "frequency_penalty must be in [-2, 2] and finite, got nan"),
    ({"repetition_penalty": INF}, "repetition_penalty must be > 0 and finite, got inf"),
    ({"repetition_penalty": 1e-50},
     "repetition_penalty must be > 0 and representable in float32, got 1e-50 (float32 rounds it to 0.0)"),
    ({"repetition_penalty": 1e39},
     "repetition_penalty must be > 0 and representable in float32, got 1e+39 (float32 rounds it to inf)"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"logit_bias": {3: NAN}}, "logit_bias values must be in [-100, 100] and finite"),
    ({"logit_bias": {3: 1.0, 4: -INF}}, "logit_bias values must be in [-100, 100] and finite"),
    ({"logit_bias": {3: 100.5}}, "logit_bias values must be in [-100, 100]"),
])
def test_a_float_that_is_not_finite_or_that_float32_makes_invalid_is_refused(kwargs: dict[str, Any],
                                                                             message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value) == message
    assert message.startswith(next(iter(kwargs)))


@pytest.mark.parametrize("kwargs", [
    {"top_p": 1.5e-45},  # float32's smallest positive value
    {"top_p": 1 - 1e-12},  # float32 rounds it to 1: still in (0, 1]
    {"min_p": 1e-50},  # float32 rounds it to 0, which is a valid min_p (off)
    {"temperature": 1e-50},  # greedy
    {"temperature": 3e38},
    {"repetition_penalty": 1e-44},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"logit_bias": {1: -100.0, 2: 100.0, 3: 1e-300}},
])
def test_edge_values_float32_keeps_valid_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_a_decoded_frame_is_checked_the_same() -> None:
    frame = msgspec.msgpack.encode({"top_p": 1e-50})
    with pytest.raises(msgspec.ValidationError, match=r"top_p must be in \(0, 1\] and representable in float32"):
        msgspec.msgpack.decode(frame, type=SamplingParams)


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value", [b"bytes", np.zeros(2, dtype=np.int8), {1.5}, _deep(100_000)],
                         ids=["bytes", "array", "set", "too-deep"])
def test_a_json_schema_holding_what_json_cannot_is_refused(value: Any) -> None:
    """msgpack can carry these where a schema belongs; the engine core would fail making its key."""
    with pytest.raises(ValueError, match=r"^structured_outputs.json is not a JSON value: "):
        StructuredOutputsParams(json={"type": "object", "default": value})
