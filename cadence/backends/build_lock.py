"""The lock processes take turns under in a kernel build folder (``cpu_kernels.py``): an advisory lock on
``cadence.lock``, which the OS frees when its holder dies, waited for at most
``$CADENCE_KERNEL_LOCK_TIMEOUT_S`` (default 300 s), saying so; and, holding it, a torch ``lock`` file
that a killed build left there (on which torch would wait forever) removed with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

from cadence.startup_log import startup

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not POSIX: the torch lock's age alone tells a killed build
    fcntl = None

logger = logging.getLogger(__name__)

# The longest wait for another process's build (a build takes about 50 s on 2 cores, 90 s on one),
# and the age beyond which a torch lock file is a killed build's.
LOCK_TIMEOUT_ENV = "CADENCE_KERNEL_LOCK_TIMEOUT_S"
LOCK_TIMEOUT_S = 300.0
# A wait or build longer than this is announced (a load of a built library takes about 0.1 s).
UNFORESEEN_BUILD_S = 2.0
_LOCK_POLL_S = 0.1


def lock_timeout_s() -> float:
    """``$CADENCE_KERNELLOCK_TIMEOUT_S``, or 300 s."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else LOCK_TIMEOUT_S
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; waiting at most %d s for a kernel build lock",
                       LOCK_TIMEOUT_ENV, raw, LOCK_TIMEOUT_S)
        return LOCK_TIMEOUT_S


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds ``build_dir/cadence.lock`` while torch builds and loads the kernels there, waiting at most
    the bound for a process that holds it; then clears a torch ``lock`` file no process holds."""
    build_dir.mkdir(parents=True, exist_ok=True)
    bound = lock_timeout_s()
    with open(build_dir / "cadence.lock", "a+") as handle:
        held = _acquire(handle, build_dir, bound)
        try:
            _clear_torch_lock(build_dir / "lock", bound, held)
            yield
        finally:
            if held and fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(handle: IO[str], build_dir: Path, bound: float) -> bool:
    """Takes ``handle``'s advisory lock (the OS frees it when its holder dies), waiting at most
    ``bound`` for the process holding it; False where there is none to take or it was not freed."""
    if fcntl is None:
        return False
    start = time.monotonic()
    said = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        except OSError as exc:  # no advisory locks on this file system: the torch lock's age decides
            logger.info("cannot lock %s (%s)", handle.name, exc)
            return False
        waited = time.monotonic() - start
        holder = _holder(handle)
        if waited >= bound:
            logger.warning("process %s has been building the CPU kernels in %s for over %d s (%s=%g); "
                           "building alongside it", holder, build_dir, bound, LOCK_TIMEOUT_ENV, bound)
            return False
        if not said and waited >= UNFORESEEN_BUILD_S:
            said = True
            startup.info("waiting for process %s, which is building the CPU kernels in %s (at most %d s) ...",
                         holder, build_dir, bound)
        time.sleep(_LOCK_POLL_S)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return True


def _holder(handle: IO[str]) -> str:
    """The process id the lock's holder wrote, or "?"."""
    handle.seek(0)
    return handle.read().strip() or "?"


def _clear_torch_lock(lock: Path, bound: float, held: bool) -> None:
    """Removes a torch ``lock`` file that would make ``load`` wait forever: at once while we hold
    ``cadence.lock`` (every build here runs under it, so the file outlived a killed one), otherwise
    once it is ``bound`` old, waiting for it to go until then."""
    try:
        created = lock.stat().st_mtime
    except FileNotFoundError:
        return
    if held:
        why = "no process holds cadence.lock, under which every build runs, so a killed build left it"
    else:
        deadline = min(time.time(), created) + bound
        if time.time() < deadline:
            startup.info("waiting for the CPU kernel build that holds %s (at most %d s more) ...", lock,
                         deadline - time.time())
        while time.time() < deadline:
            if not lock.exists():
                return
            time.sleep(_LOCK_POLL_S)
        why = (f"still there {time.time() - created:.0f} s after it was made, longer than any build "
               f"({LOCK_TIMEOUT_ENV}={bound:g})")
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
        logger.warning("removed the stale kernel build lock %s: %s", lock, why)
