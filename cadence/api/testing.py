"""Helpers for tests and load scripts: a real ``cadence serve`` process, and validation of bodies
against OpenAI's published OpenAPI spec.

The spec (``openai-openapi.json``) is found through ``$CADENCE_OPENAI_SPEC``, else in
``../shared/reference/`` next to the repository. It is OpenAPI 3.1 with OpenAPI 3.0's
``nullable: true`` mixed in, which JSON Schema validators ignore: :class:`OpenAISpec` rewrites each
such schema as ``anyOf: [schema, {type: null}]`` before validating (Draft 2020-12).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
SPEC_ENV = "CADENCE_OPENAI_SPEC"
_SPEC_URI = "urn:openai-openapi"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``python -m cadence serve ARGS --port P`` in a subprocess, ready once ``/health`` says 200.

    Use as a context manager; leaving it sends SIGTERM and waits for the exit (SIGKILL after
    ``stop_timeout_s``). Its output goes to ``log_path`` (read it when a test fails).
    """

    def __init__(self, args: Sequence[str], *, log_path: Path, startup_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._args = [sys.executable, "-m", "cadence", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._startup_timeout_s = startup_timeout_s
        self._env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT, env=self._env)
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} while starting:\n{self.log()}")
            if self.health() == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy within {self._startup_timeout_s} s:\n{self.log()}")

    def health(self) -> int | None:
        """``/health``'s status, or None if nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def default_spec_path() -> Path:
    return Path(os.environ.get(SPEC_ENV) or _REPO.parent / "shared" / "reference" / "openai-openapi.json")


class OpenAISpec:
    """Validates bodies against the spec's ``components.schemas``."""

    def __init__(self, path: Path | None = None) -> None:
        from jsonschema import Draft202012Validator
        from referencing import Registry
        from referencing.jsonschema import DRAFT202012

        path = path or default_spec_path()
        if not path.is_file():
            raise FileNotFoundError(f"OpenAI's OpenAPI spec is not at {path}; set ${SPEC_ENV}")
        self.document = _nullable_as_any_of(json.loads(path.read_text()))
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


def _nullable_as_any_of(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_as_any_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten = {key: _nullable_as_any_of(value) for key, value in node.items()}
    if rewritten.pop("nullable", None) is True:
        return {"anyOf": [rewritten, {"type": "null"}]}
    return rewritten
