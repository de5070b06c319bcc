"""What cadence's child processes (engine cores, tensor-parallel workers) do for themselves: take a
name that ``ps`` shows, and exit with their parent."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import threading


def set_process_name(name: str) -> None:
    """Name the process as ``ps``/``top`` show it (Linux; at most 15 bytes), as vLLM names its
    ``EngineCore_DP<rank>`` processes: one can tell them apart, and find them."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def exit_with_parent() -> None:
    """Exit this (multiprocessing) child as soon as its parent is gone, whatever its main thread is
    doing: loading weights, waiting for peers in ``init_process_group``, or stuck in a collective
    with a dead peer. A watch thread, not ``PR_SET_PDEATHSIG``: that signal fires when the parent's
    *thread* that started us ends, which need not be the parent's end."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # no clean-up to wait for: whoever we served is gone

    threading.Thread(target=watch, name="cadence-parent-watch", daemon=True).start()
