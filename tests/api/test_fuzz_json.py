"""Random JSON shaped like requests, through a real ``cadence serve`` of the tiny random model, to
``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize``.

A body holds the endpoint's own fields (mostly plausible values, some hostile: wrong types, huge
integers, 1e308, -0.0, "NaN" as a string, ``NaN`` and ``1e999`` as JSON, very long strings, lone
surrogates escaped in JSON, invalid UTF-8 bytes, nesting up to the limit and past it, nulls), unknown
fields, and now and then a broken body (truncated, trailing bytes, not an object). Whatever it
is, the server answers within :data:`HANG_S` (a hang guard, not a performance bound), never with a
5xx (nor a stream's error event of type ``server_error``), every error in OpenAI's ``ErrorResponse``
shape with type ``invalid_request_error``, and ``/health`` is 200 afterwards.

CI runs :data:`CI_EXAMPLES` derandomized examples per endpoint; ``-m stress`` runs
:data:`STRESS_EXAMPLES`, randomly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from support.openai_spec import OpenAISpec, check_fuzzed_reply

from cadence.api.limits import MAX_JSON_DEPTH
from cadence.api.testing import ServerProcess

MODEL = "tiny"
VOCAB = 320  # tests/conftest.py: TINY_VOCAB
HANG_S = 30.0
MAX_MODEL_LEN = 128
CI_EXAMPLES = 100
STRESS_EXAMPLES = 1500


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., ContextManager[ServerProcess]]) -> Iterator[ServerProcess]:
    with serve_tiny("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)) as process:
        yield process
        assert process.health() == 200, process.log()


# ---- JSON text, including what json.dumps will not write ------------------------------------


class Raw:
    """JSON text written as it is (``NaN``, ``1e999``, invalid UTF-8 in a string ...)."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:60]!r}{'...' if len(self.text) > 60 else ''})"


def to_json(value: Any, ascii_only: bool) -> bytes:
    """``value`` as JSON text. ``ascii_only`` escapes every non-ASCII character (lone surrogates as
    ``\\udXXX``); otherwise strings are written as UTF-8, and a lone surrogate as the invalid bytes
    ``surrogatepass`` gives."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return b"{" + b",".join(to_json(str(k), ascii_only) + b":" + to_json(v, ascii_only)
                                for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(to_json(v, ascii_only) for v in value) + b"]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()  # None, bool, int (any size), float (nan, inf: NaN, Infinity)


def nest(depth: int, leaf: Any, in_objects: bool) -> Any:
    for _ in range(depth):
        leaf = {"a": leaf} if in_objects else [leaf]
    return leaf


# ---- values ------------------------------------------------------------------------------

EXTREME_INTS = [0, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
                2**64, 10**30, -(10**300)]
EXTREME_FLOATS = [-0.0, 1e308, -1e308, 5e-324, 1e-50, 2.0000000001, 1.0000000001, float("nan"), float("inf"),
                  float("-inf")]
NUMBER_STRINGS = ["NaN", "nan", "Infinity", "-Infinity", "1e308", "-0.0", "1e999", "12", "0x10", ""]
RAW_NUMBERS = [b"1e999", b"-1e999", b"NaN", b"Infinity", b"-0", b"1" + b"0" * 5000, b"0." + b"0" * 400 + b"1",
               b"1E+2", b"01", b"+1", b".5", b"1.", b"-", b"1e", b"2e-400"]
BAD_UTF8 = [b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\xf4\x90\x80\x80"]
# Escapes of lone (or reversed) surrogates, and of NUL.
ODD_ESCAPES = [rb"\ud800", rb"\udfff", rb"\ud83d", rb"\ude00\ud83d", rb"\u0000"]

ints = st.one_of(st.integers(-5, 300), st.sampled_from(EXTREME_INTS), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EXTREME_FLOATS), st.floats())
# Every code point, surrogates included.
any_text = st.text(st.characters(exclude_categories=()), max_size=30)
long_text = st.builds(lambda unit, times: unit * times, st.text(min_size=1, max_size=4),
                      st.sampled_from([3_000, 60_000, 400_000]))
bad_string = st.builds(lambda before, bad, after: Raw(b'"' + before.encode() + bad + after.encode() + b'"'),
                       st.text(max_size=5), st.sampled_from(BAD_UTF8 + ODD_ESCAPES), st.text(max_size=5))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, any_text, st.sampled_from(NUMBER_STRINGS),
                    st.sampled_from(RAW_NUMBERS).map(Raw), bad_string)
any_json = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                        | st.dictionaries(any_text, children, max_size=4), max_leaves=10)
# The body is one level: a field's value may nest MAX_JSON_DEPTH - 1 more. Past it: 400 json_too_deep.
deep = st.builds(nest, st.integers(MAX_JSON_DEPTH - 8, MAX_JSON_DEPTH - 1), scalars, st.booleans())
too_deep = st.builds(nest, st.integers(MAX_JSON_DEPTH, MAX_JSON_DEPTH + 40), scalars, st.booleans())


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], out_of: int) -> st.SearchStrategy[Any]:
    """``common``, but 1 time in ``out_of`` ``rare``. (``st.one_of`` cannot weigh: it drops a repeated branch.)"""
    return st.integers(0, out_of - 1).flatmap(lambda i: rare if i == out_of - 1 else common)


hostile = mostly(any_json, st.one_of(long_text, deep, too_deep), 3)


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Inside a field (a message's role, content ...): mostly a plausible value (9 in 10), else a hostile one."""
    return mostly(plausible, hostile, 10)


text = st.text(max_size=30)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
count = st.integers(0, 40)
temperature = st.floats(0, 2)
probability = st.floats(0, 1)
penalty = st.floats(-2, 2)
constraints = st.one_of(
    st.sampled_from([{"json": {"type": "object"}}, {"json": {"type": "string", "maxLength": 5}},
                     {"json": '{"type": "integer"}'}, {"regex": "[a-z]{1,5}"}, {"choice": ["yes", "no"]},
                     {"grammar": 'root ::= "a" | "b"'}, {"json_object": True}, {}, {"regex": "(", "choice": []}]),
    st.builds(lambda r: {"regex": r}, text),
    st.builds(lambda c: {"choice": c}, st.lists(text, max_size=3)),
    st.integers(1, 25).map(lambda depth: {"json": array_schema(depth)}),
)


def array_schema(depth: int) -> dict[str, Any]:
    """A JSON schema of arrays ``depth`` deep (two levels of JSON each), integers at the bottom."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return schema


response_format = st.sampled_from([
    {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}, {"type": "json_schema"}, {"type": "yaml"}])
role = mostly(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), text, 5)
part = mostly(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
              st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])}, optional={"text": text}), 5)
content = st.one_of(text, st.none(), st.lists(part, max_size=3))
message = st.fixed_dictionaries({"role": field(role), "content": field(content)}, optional={"name": field(text)})
messages = mostly(st.lists(field(message), min_size=1, max_size=4), st.just([]), 10)
prompt = mostly(st.one_of(st.text(min_size=1, max_size=30), st.lists(text, min_size=1, max_size=3), token_ids,
                          st.lists(token_ids, min_size=1, max_size=3)), st.sampled_from(["", []]), 10)

SAMPLING = {
    "n": st.integers(1, 4), "max_tokens": count, "temperature": temperature, "top_p": probability,
    "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.one_of(text, st.lists(text, max_size=4)),
    "presence_penalty": penalty, "frequency_penalty": penalty,
    "logit_bias": st.dictionaries(st.integers(-1, VOCAB + 10).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": text, "response_format": response_format, "top_k": st.integers(-1, 50), "min_p": probability,
    "repetition_penalty": st.floats(0, 3), "stop_token_ids": st.lists(st.integers(0, VOCAB + 10), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": count, "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "priority": st.integers(-10, 10), "structured_outputs": constraints,
}
# endpoint: (its required fields, drawn together; its optional ones)
ENDPOINTS: dict[str, tuple[st.SearchStrategy[dict[str, Any]], dict[str, st.SearchStrategy[Any]]]] = {
    "/v1/completions": (st.fixed_dictionaries({"prompt": prompt}), {
        **SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.sampled_from([None, 1]),
        "suffix": st.sampled_from([None, ""]), "add_special_tokens": st.booleans()}),
    "/v1/chat/completions": (st.fixed_dictionaries({"messages": messages}), {
        **SAMPLING, "max_completion_tokens": count, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "add_generation_prompt": st.booleans()}),
    # Exactly one of prompt and messages.
    "/tokenize": (st.one_of(st.fixed_dictionaries({"prompt": mostly(text, long_text, 4)}),
                            st.fixed_dictionaries({"messages": messages})),
                  {"add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans()}),
    "/detokenize": (st.fixed_dictionaries({"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=20)}), {}),
}
FIELDS = {endpoint: ["model", "prompt", "messages", "tokens", *sorted(optional)]
          for endpoint, (_, optional) in ENDPOINTS.items()}


@st.composite
def request_body(draw: st.DrawFn, endpoint: str) -> bytes:
    """A body for ``endpoint``: plausible values for its fields, then up to 3 fields (known or not)
    given hostile values; 1 in 5 is broken further. (Hypothesis starts from, and shrinks towards,
    the simplest choices: a plausible body.)"""
    required, optional = ENDPOINTS[endpoint]
    body: dict[str, Any] = {}
    # Most name the served model, so that they get past the 404.
    if draw(st.integers(0, 9)) < 8:
        body["model"] = MODEL
    if draw(st.integers(0, 9)) < 9:
        body.update(draw(required))
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=6, unique=True)) if optional else []:
        body[name] = draw(optional[name])
    if "stream_options" in body and draw(st.integers(0, 3)) < 3:
        body["stream"] = True
    name = mostly(st.sampled_from(FIELDS[endpoint]), any_text, 4)  # a known field, or not
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 1, 1, 2, 2, 3]))):
        body[draw(name)] = draw(hostile)
    data = to_json(body, ascii_only=draw(st.booleans()))
    broken = draw(st.integers(0, 19))  # 1 in 20 of each below
    if broken == 16:  # not an object
        return to_json(draw(hostile), ascii_only=True)
    if broken == 17:  # truncated
        return data[:draw(st.integers(0, max(0, len(data) - 1)))]
    if broken == 18:  # trailing bytes
        return data + draw(st.sampled_from([b"}", b",", b" x", b"\x00", b"\xff", b"{}", b"\n\n"]))
    if broken == 19:  # a field twice, the second of another type
        return data[:-1] + (b"," if len(data) > 2 else b"") + b'"model": 1, "model": "' + MODEL.encode() + b'"}'
    return data


# ---- checks ------------------------------------------------------------------------------


def check_response(spec: OpenAISpec, response: httpx.Response, elapsed: float, context: str) -> None:
    assert elapsed < HANG_S, f"{elapsed:.1f} s: {context}"
    check_fuzzed_reply(spec, response.status_code, response.headers.get("content-type", ""), response.content, context)


def fuzz(server: ServerProcess, spec: OpenAISpec, endpoint: str, max_examples: int, derandomize: bool) -> None:
    url = f"{server.url}{endpoint}"
    headers = {"Content-Type": "application/json"}

    with httpx.Client(timeout=HANG_S) as client:

        @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None, print_blob=True,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
        @given(data=request_body(endpoint))
        def run(data: bytes) -> None:
            start = time.monotonic()
            response = client.post(url, content=data, headers=headers)  # a stream too is read to its end
            elapsed = time.monotonic() - start
            context = f"{response.status_code} for POST {endpoint} {data[:2000]!r}: {response.content[:2000]!r}"
            check_response(spec, response, elapsed, context)

        run()
    assert server.health() == 200, server.log()


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_random_json_gets_no_5xx(server: ServerProcess, spec: OpenAISpec, endpoint: str) -> None:
    fuzz(server, spec, endpoint, CI_EXAMPLES, derandomize=True)


@pytest.mark.stress
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_random_json_gets_no_5xx_stress(server: ServerProcess, spec: OpenAISpec, endpoint: str) -> None:
    fuzz(server, spec, endpoint, STRESS_EXAMPLES, derandomize=False)
