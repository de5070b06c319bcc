"""Helpers for tests and load scripts: a real ``cadence serve`` process on a free port, and any other
HTTP server started from its command line (the peers a benchmark compares against).

(Validation against OpenAI's OpenAPI spec is test-only: ``tests/support/openai_spec.py``.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar


def reserve_port() -> socket.socket:
    """A socket bound (not listening) to a free port of 127.0.0.1, with SO_REUSEADDR.

    While it is open, the kernel gives that port to no other ``bind(0)`` (another test's in-process
    server, a client's outgoing connection), yet a server that also sets SO_REUSEADDR (aiohttp,
    uvicorn, llama.cpp's server all do) may bind and listen on it. A port merely found free and
    released would stay free only by luck while the server starts: CI once saw another test's
    in-process server take it, answer ``/health``, and receive this server's tests.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


_Server = TypeVar("_Server", bound="HTTPServerProcess")


class HTTPServerProcess:
    """A server run from ``command(port)`` in a subprocess on a free port, ready once ``/health`` says 200.

    Use as a context manager; leaving it sends SIGTERM and waits for the exit (SIGKILL after
    :meth:`stop`'s ``timeout_s``). Its output goes to ``log_path`` (read it when a test fails).
    ``ready_after_s`` is how long the last :meth:`start` took, from launch to healthy. The port is
    reserved (:func:`reserve_port`) from construction until the first start ends, so the server that
    answers ``/health`` is this one.
    """

    def __init__(self, command: Callable[[int], Sequence[str]], *, log_path: Path, startup_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self._reservation: socket.socket | None = reserve_port()
        self.port = int(self._reservation.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._args = list(command(self.port))
        self._startup_timeout_s = startup_timeout_s
        self._env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_after_s: float | None = None

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start()
        finally:
            if self._reservation is not None:  # the server listens now (or failed): it holds the port
                self._reservation.close()
                self._reservation = None

    def _start(self) -> None:
        launched = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT, env=self._env)
        deadline = launched + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} while starting:\n{self.log()}")
            if self.health() == 200:
                self.ready_after_s = time.monotonic() - launched
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


class ServerProcess(HTTPServerProcess):
    """``python -m cadence serve ARGS --port P``, as :class:`HTTPServerProcess` runs it."""

    def __init__(self, args: Sequence[str], *, log_path: Path, startup_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(lambda port: [sys.executable, "-m", "cadence", "serve", *args, "--host", "127.0.0.1",
                                       "--port", str(port)],
                         log_path=log_path, startup_timeout_s=startup_timeout_s, env=env)
