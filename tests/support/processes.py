"""A server's processes, found from /proc by the names cadence gives them (``cadence-core-<rank>``,
``cadence-tp-<core>-<rank>``). Engine cores are grandchildren of ``cadence serve``: they are forked
from its fork server (cadence/runtime/fork_server.py)."""

from __future__ import annotations

from cadence.bench.soak.probe import process_tree


def descendants(pid: int) -> dict[str, int]:
    """Process name (``/proc/PID/comm``) -> pid of every process below ``pid``."""
    return {name: child for child, name in process_tree(pid).items() if child != pid}


def engine_core_pids(server_pid: int) -> dict[int, int]:
    """rank -> pid of the server's engine-core processes."""
    return {int(name.rsplit("-", 1)[1]): pid for name, pid in descendants(server_pid).items()
            if name.startswith("cadence-core-")}
