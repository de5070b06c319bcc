"""Fuzzing ``/v1/completions`` and ``/v1/chat/completions`` from OpenAI's published spec
(``tests/data/openai-openapi.json.gz``) with schemathesis, against a real ``cadence serve`` of the
tiny random model: bodies the spec allows (positive) and bodies it does not (negative).

Whatever is sent, the server answers within :data:`HANG_S` (a hang guard, not a performance
bound), never with a 5xx (nor a stream's error event of type ``server_error``), every error in
OpenAI's ``ErrorResponse`` shape, and ``/health`` is 200 afterwards.

Most bodies name the served model (:func:`served`), so that they reach the engine; the rest keep the
random name schemathesis drew (a 404 is fine). The context is short (``--max-model-len``), so that a
huge ``max_tokens`` is refused or finishes fast. Streams are read to their end (a stream cut short
by the hang guard fails the test).

CI runs :data:`CI_EXAMPLES` derandomized examples per operation and mode; ``-m stress`` runs
:data:`STRESS_EXAMPLES`, randomly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from support.openai_spec import OpenAISpec, check_fuzzed_reply, load_document

from cadence.api.testing import ServerProcess

MODEL = "tiny"
HANG_S = 30.0
MAX_MODEL_LEN = 128
CI_EXAMPLES = 30
STRESS_EXAMPLES = 500
# Out of 10 bodies, how many name the served model.
SERVED_OUT_OF_10 = 8
OPERATIONS = ["/completions", "/chat/completions"]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def server(serve_tiny: Callable[..., ContextManager[ServerProcess]]) -> Iterator[ServerProcess]:
    with serve_tiny("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)) as process:
        yield process
        assert process.health() == 200, process.log()


@pytest.fixture(scope="module")
def schema() -> schemathesis.BaseSchema:
    # Streams are read to their end (schemathesis stops after 20 events by default), within HANG_S in
    # all; a timeout is a failure, never retried.
    config = schemathesis.Config.from_dict({"max-stream-events": 1_000_000, "request-timeout": HANG_S,
                                            "request-retries": 0})
    return schemathesis.openapi.from_dict(load_document(), config=config)


def served(case: schemathesis.Case, draw: int) -> schemathesis.Case:
    """``case`` naming the served model, for ``draw`` (in 0..9) below :data:`SERVED_OUT_OF_10`.

    Such a completion's ``prompt: null`` (a third of the spec's bodies) becomes the spec's default for
    it, ``<|endoftext|>``: cadence refuses a null prompt (a 400), which would keep them from the engine.
    """
    if draw < SERVED_OUT_OF_10 and isinstance(case.body, dict):
        case.body["model"] = MODEL
        if "prompt" in case.body and case.body["prompt"] is None:
            case.body["prompt"] = "<|endoftext|>"
    return case


def check_response(spec: OpenAISpec, response: schemathesis.Response, context: str) -> None:
    assert response.elapsed < HANG_S, f"{response.elapsed:.1f} s: {context}"
    assert not response.stream_cut_short, f"the stream did not end within {HANG_S} s: {context}"
    check_fuzzed_reply(spec, response.status_code, response.headers.get("content-type", [""])[0], response.content,
                       context)


def fuzz(server: ServerProcess, spec: OpenAISpec, schema: schemathesis.BaseSchema, path: str,
         mode: GenerationMode, max_examples: int, derandomize: bool) -> None:
    strategy = schema[path]["POST"].as_strategy(mode)
    base_url = f"{server.url}/v1"  # the spec's paths are relative to https://api.openai.com/v1
    session = requests.Session()

    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None, print_blob=True,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(case=strategy, draw=st.integers(0, 9))
    def run(case: schemathesis.Case, draw: int) -> None:
        case = served(case, draw)
        response = case.call(base_url=base_url, session=session)
        context = (f"{response.status_code} for POST {path} {case.body!r:.2000}: {response.content[:2000]!r}\n"
                   f"reproduce: {case.as_curl_command()}")
        check_response(spec, response, context)

    with session:
        run()
    assert server.health() == 200, server.log()


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("path", OPERATIONS)
def test_spec_bodies_get_no_5xx(server: ServerProcess, spec: OpenAISpec, schema: schemathesis.BaseSchema, path: str,
                                mode: GenerationMode) -> None:
    fuzz(server, spec, schema, path, mode, CI_EXAMPLES, derandomize=True)


@pytest.mark.stress
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("path", OPERATIONS)
def test_spec_bodies_get_no_5xx_stress(server: ServerProcess, spec: OpenAISpec, schema: schemathesis.BaseSchema,
                                       path: str, mode: GenerationMode) -> None:
    fuzz(server, spec, schema, path, mode, STRESS_EXAMPLES, derandomize=False)
