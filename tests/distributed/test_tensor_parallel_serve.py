"""``cadence serve`` with two engine cores of two tensor-parallel ranks each (-dp 2 -tp 2, mp): a
worker killed while its engine is idle turns ``/health`` to 503 at once, a worker killed while
its engine streams ends the stream with an error event, the server answers throughout, and
stopping it leaves no process or socket file behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.processes import descendants

from cadence.api.testing import ServerProcess

# Hang guards only: each wait ends within a second or so.
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", num_key_value_heads=1, max_position_embeddings=1024)


def serve(model: Path, log_path: Path, data_parallel_size: int) -> ServerProcess:
    args = ["--model", str(model), "--dtype", "float32", "--num-kv-blocks", "80", "--tensor-parallel-size", "2",
            "--data-parallel-size", str(data_parallel_size), "--stay-up-on-engine-death"]
    return ServerProcess(args, log_path=log_path, startup_timeout_s=300)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.05)


def events(lines: Iterator[str]) -> Iterator[Any]:
    """The data of each server-sent event (``"[DONE]"`` as it is)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def assert_stopped_cleanly(server: ServerProcess, processes: dict[str, int]) -> None:
    """Stop ``server``: none of its ``processes`` may outlive it, nor its engine cores' socket files."""
    server.stop()

    def alive() -> list[str]:
        return [name for name, pid in processes.items() if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]

    # Helpers such as multiprocessing's resource tracker ("python") exit once they see their parent
    # gone, a moment after it: wait for that (bounded by the hang guard), then name any survivor.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not alive())
    assert not alive(), f"still running: {alive()}"
    cores = [pid for name, pid in processes.items() if name.startswith("cadence-core-")]
    files = [path for pid in cores for path in Path(tempfile.gettempdir()).glob(f"cadence-*{pid}-*")]
    assert not files, files


def test_a_dead_worker_fails_its_engine_idle_or_streaming(tiny_model: Path, tmp_path: Path) -> None:
    with serve(tiny_model, tmp_path / "server.log", data_parallel_size=2) as server:
        processes = descendants(server.pid)
        workers = {name: pid for name, pid in processes.items() if name.startswith("cadence-tp-")}
        assert sorted(workers) == ["cadence-tp-0-0", "cadence-tp-0-1", "cadence-tp-1-0", "cadence-tp-1-1"]
        body = {"prompt": "Hello world!", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=HANG_GUARD_S) as response:
            assert response.status_code == 200
            stream = events(response.iter_lines())
            assert "error" not in next(stream)  # streaming on engine core 0 (an idle tie goes to the lowest rank)
            # Paused, engine core 0 cannot finish the request; killed below, while it streams.
            os.kill(workers["cadence-tp-0-1"], signal.SIGSTOP)

            os.kill(workers["cadence-tp-1-1"], signal.SIGKILL)  # engine core 1 is idle
            wait_until(lambda: server.health() == 503)
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=HANG_GUARD_S)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            assert "engine core 1 of 2" in refused.json()["error"]["message"]
            assert "worker rank 1" in refused.json()["error"]["message"]

            os.kill(workers["cadence-tp-0-1"], signal.SIGKILL)
            rest = list(stream)
        assert "[DONE]" not in rest and rest[-1]["error"]["code"] == "engine_dead", rest[-3:]
        assert "worker rank 1" in rest[-1]["error"]["message"]
        assert server.health() == 503  # and still answering
        assert_stopped_cleanly(server, processes)


def test_stopping_the_server_stops_the_workers_and_removes_their_files(tiny_model: Path, tmp_path: Path) -> None:
    with serve(tiny_model, tmp_path / "server.log", data_parallel_size=1) as server:
        processes = descendants(server.pid)
        assert {"cadence-core-0", "cadence-tp-0-0", "cadence-tp-0-1"} <= set(processes)
        body = {"prompt": "Hello world!", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
        assert_stopped_cleanly(server, processes)
        assert server.stop() == 0, server.log()
