"""What a child process does for itself: take a name ``ps`` shows, and exit with its parent.

The children are small Python scripts that load ``processes.py`` by its path: it needs only the
standard library, and a child that imported the package would spend seconds importing torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cadence.runtime import processes
from cadence.runtime.processes import exit_with_parent, set_process_name

linux_only = pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs /proc (Linux)")

LOAD = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("processes", {processes.__file__!r})
processes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(processes)
"""


def run_script(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", LOAD + body], capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout


@linux_only
@pytest.mark.parametrize(("name", "shown"), [
    ("cadence-core-0", "cadence-core-0"),
    ("cadence-core-12345", "cadence-core-12"),  # the kernel keeps 15 bytes
    ("w", "w"),
])
def test_the_name_is_what_proc_shows(name: str, shown: str) -> None:
    out = run_script(f"processes.set_process_name({name!r})\nprint(open('/proc/self/comm').read(), end='')")
    assert out == shown + "\n"


@linux_only
def test_the_name_is_set_in_this_process_too() -> None:
    comm = Path("/proc/self/comm")
    before = comm.read_text().rstrip("\n")
    try:
        set_process_name("cadence-test-name-too-long")
        assert comm.read_text() == "cadence-test-na\n"
    finally:
        comm.write_text(before)
    assert comm.read_text().rstrip("\n") == before


def test_a_system_without_proc_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("/proc/self/comm")

    monkeypatch.setattr(processes, "open", no_proc, raising=False)
    set_process_name("anything")  # no error


def test_a_process_that_multiprocessing_did_not_start_has_no_parent_to_watch() -> None:
    before = {t.name for t in threading.enumerate()}
    exit_with_parent()
    assert "cadence-parent-watch" not in before
    assert "cadence-parent-watch" not in {t.name for t in threading.enumerate()}


ORPHAN = """
import multiprocessing, os, sys, threading, time

def child(ready):
    processes.exit_with_parent()
    names = [t.name for t in threading.enumerate()]
    ready.send((os.getpid(), names))
    time.sleep(120)  # until its parent is gone (or the hang guard)

if __name__ == "__main__":
    parent_end, child_end = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=child, args=(child_end,))
    proc.start()
    pid, names = parent_end.recv()
    print(pid, "cadence-parent-watch" in names, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie left for a reaper that may never come counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@linux_only
def test_a_child_exits_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", LOAD + ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid_text, watching = parent.stdout.readline().split()
        child = int(pid_text)
        assert watching == "True"
        assert _alive(child)  # its parent is alive: it stays
        parent.send_signal(signal.SIGKILL)
        parent.wait(60)
        deadline = time.monotonic() + 60  # a hang guard only; it exits at once
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(child):
            os.kill(child, signal.SIGKILL)
            pytest.fail("the child outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
