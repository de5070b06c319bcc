"""A server's processes, found from /proc by the names cadence gives them (``cadence-core-<rank>``,
``cadence-tp-<core>-<rank>``). Engine cores are grandchildren of ``cadence serve``: they are forked
from its fork server (cadence/runtime/fork_server.py)."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> dict[str, int]:
    """Process name (``/proc/PID/comm``) -> pid of every process below ``pid``."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            names[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    below: dict[str, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child in names:
                below[names[child]] = child
                frontier.append(child)
    return below


def engine_core_pids(server_pid: int) -> dict[int, int]:
    """rank -> pid of the server's engine-core processes."""
    return {int(name.rsplit("-", 1)[1]): pid for name, pid in descendants(server_pid).items()
            if name.startswith("cadence-core-")}
