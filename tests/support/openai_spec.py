"""Validation of bodies against OpenAI's published OpenAPI spec, vendored in ``tests/data/``.

The spec is OpenAPI 3.1 with OpenAPI 3.0's ``nullable: true`` mixed in, which JSON Schema
validators ignore: :class:`OpenAISpec` rewrites each such schema as ``anyOf: [schema, {type: null}]``
before validating (Draft 2020-12).
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path
from typing import Any

# The whole document (every path, for fuzzing the API from it), gzipped; tests/data/README.md says
# where it comes from and how to refresh it.
SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "openai-openapi.json.gz"
_SPEC_URI = "urn:openai-openapi"


@functools.cache
def load_document(path: Path = SPEC_PATH) -> dict[str, Any]:
    """The spec as published (gzipped or plain JSON), parsed once per process; do not modify it."""
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        document: dict[str, Any] = json.load(f)
    return document


class OpenAISpec:
    """Validates bodies against the spec's ``components.schemas``."""

    def __init__(self, path: Path = SPEC_PATH) -> None:
        from jsonschema import Draft202012Validator
        from referencing import Registry
        from referencing.jsonschema import DRAFT202012

        self.document = _nullable_as_any_of(load_document(path))
        self._registry: Registry[Any] = Registry().with_resource(_SPEC_URI, DRAFT202012.create_resource(self.document))
        self._validator_class = Draft202012Validator
        self._validators: dict[str, Any] = {}

    def schema(self, name: str) -> dict[str, Any]:
        schemas: dict[str, dict[str, Any]] = self.document["components"]["schemas"]
        return schemas[name]

    def validate(self, body: Any, name: str) -> None:
        """:raises jsonschema.ValidationError: if ``body`` does not match schema ``name``."""
        validator = self._validators.get(name)
        if validator is None:
            validator = self._validators[name] = self._validator_class(
                {"$ref": f"{_SPEC_URI}#/components/schemas/{name}"}, registry=self._registry)
        validator.validate(body)

    def validate_completion_chunk(self, body: Any) -> None:
        """A streamed completion chunk: ``CreateCompletionResponse``, except that a choice still
        running has ``finish_reason: null`` (the spec says the two share a shape, but only the chat
        chunk's schema has the nullable finish reason every implementation sends)."""
        patched = copy.deepcopy(body)
        for choice in patched.get("choices", []):
            if choice.get("finish_reason", "") is None:
                choice["finish_reason"] = "length"
        self.validate(patched, "CreateCompletionResponse")


def check_fuzzed_reply(spec: OpenAISpec, status_code: int, content_type: str, content: bytes, context: str) -> None:
    """What the fuzz tests ask of any reply: no 5xx; OpenAI's error shape on a 4xx; a 200's stream
    ended by ``[DONE]``, or by one error event if it failed once started."""
    assert status_code < 500, context
    if status_code >= 400:
        _check_client_error(spec, json.loads(content), context)
        return
    assert status_code == 200, context
    if not content_type.startswith("text/event-stream"):
        json.loads(content)
        return
    events = [line.removeprefix(b"data: ") for line in content.split(b"\n\n") if line.strip()]
    assert events, context
    for event in events[:-1]:
        assert "error" not in json.loads(event), context
    if events[-1] != b"[DONE]":
        _check_client_error(spec, json.loads(events[-1]), context)


def _check_client_error(spec: OpenAISpec, body: Any, context: str) -> None:
    spec.validate(body, "ErrorResponse")
    assert body["error"]["type"] == "invalid_request_error", context


def _nullable_as_any_of(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_as_any_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten = {key: _nullable_as_any_of(value) for key, value in node.items()}
    if rewritten.pop("nullable", None) is True:
        return {"anyOf": [rewritten, {"type": "null"}]}
    return rewritten
