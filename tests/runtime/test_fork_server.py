"""The engine cores' fork server: a child forked from it has the engine's modules imported already,
and still runs as a spawned child would, with its parent's environment, working folder and standard
streams as of its start (not the server's, taken when the server started), and SIGINT ignored."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import sys
from pathlib import Path

import pytest

from cadence.runtime.fork_server import ENGINE_MODULES, forked_process, start_fork_server

linux_only = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")


def report(path: str) -> None:
    """The child's side: what it found, as JSON in ``path``; a line on each standard stream."""
    found = {
        "variable": os.environ.get("CADENCE_FORK_SERVER_TEST"),
        "cwd": os.getcwd(),
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "imported": [name for name in ENGINE_MODULES if name in sys.modules],
    }
    Path(path).write_text(json.dumps(found))
    print("the child's stdout", flush=True)
    print("the child's stderr", file=sys.stderr, flush=True)


def test_a_forked_child_has_the_modules_and_its_parents_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    start_fork_server()  # the server is older than what this test changes next
    monkeypatch.setenv("CADENCE_FORK_SERVER_TEST", "set after the server started")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "found.json"
    process = forked_process(report, (str(out),), "fork-server-test", daemon=True)
    process.start()
    process.join(120)  # a hang guard only
    assert process.exitcode == 0
    assert json.loads(out.read_text()) == {
        "variable": "set after the server started",
        "cwd": str(tmp_path),
        "sigint_ignored": True,
        "imported": list(ENGINE_MODULES),  # by the server: the target's module imports none of them
    }
    captured = capfd.readouterr()
    assert "the child's stdout" in captured.out
    assert "the child's stderr" in captured.err


@linux_only
def test_the_server_asks_nvml_about_cuda_and_this_process_is_left_as_it_was() -> None:
    """The server's imports must not initialize CUDA (its children could not use it): torch's
    availability check goes through NVML there. The variable is the server's alone."""
    before = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    start_fork_server()
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == before
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    environ = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
    assert b"PYTORCH_NVML_BASED_CUDA_CHECK=1" in environ


def test_a_parent_with_its_stdout_closed_still_starts_children(tmp_path: Path) -> None:
    """Only open streams go along: with fd 1 closed here, the child runs (and keeps the server's)."""
    out = tmp_path / "found.json"
    process = forked_process(report, (str(out),), "fork-server-test", daemon=True)
    saved = os.dup(1)
    os.close(1)
    try:
        process.start()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    process.join(120)  # a hang guard only
    assert process.exitcode == 0
    assert json.loads(out.read_text())["imported"] == list(ENGINE_MODULES)
