"""The engine cores' fork server: one process that has imported the engine's modules, from which
each engine core is forked ready to build its engine, and each tensor-parallel rank ready to load
its shard (from its engine core's own server: a child of a server is not a client of it).

A spawned engine core is a fresh interpreter that imports torch, transformers and the model code
before it can load a weight: 8-9 s on the 2-core machine, on the critical path of every start, after
the API process had paid the same imports. ``cadence serve`` starts the server (multiprocessing's
``forkserver``, told to import :data:`ENGINE_MODULES`) before it resolves the model, so those
imports run beside the API process's own; every engine core after that (a data-parallel rank, each
engine a test session launches) forks from it with the imports done. docs/architecture.md,
"Processes and actors".

A forked child keeps the server's environment and standard streams, as they were when the server
started; a spawned one has its parent's at the start. So each start sends the parent's environment
and duplicates of its standard output and error, which the child takes before it unpickles anything
else (the engine's config, the entry point's arguments). The server itself runs with SIGINT ignored,
which its children inherit until they set their own handling, as a spawned child inherits the API
process's (``api/server.py`` ignores SIGINT before it launches the engine). And the server must
not initialize CUDA, which a child forked after it could not use (PyTorch supports CUDA in children
of a ``forkserver`` whose server never touched it): it runs with
``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so that an availability check during its imports asks NVML.
On a GPU this path is not yet verified (no device was lent when it was written).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from typing import Any

# What an engine core imports before its first weight (the model code of the default model's family
# among it); a model of another family imports its own module after the fork.
ENGINE_MODULES = ("cadence.core.core_process", "cadence.core.engine_core", "cadence.executor.worker",
                  "cadence.models.llama")
_CONTEXT = multiprocessing.get_context("forkserver")
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def start_fork_server() -> None:
    """Start the server unless it runs; it imports :data:`ENGINE_MODULES` while the caller goes on."""
    _CONTEXT.set_forkserver_preload(list(ENGINE_MODULES))
    with _server_environment(), _sigint_ignored():
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _server_environment() -> Iterator[None]:
    # CUDA cannot be used in a child forked after its parent initialized it: should an import in the
    # server ask torch whether CUDA is available, torch then asks NVML, which initializes nothing.
    # (The children get their parent's environment, not this.)
    previous = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = previous


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    # The server and its children ignore it (only the main thread may set a handler).
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def forked_process(target: Callable[..., object], args: tuple[Any, ...], name: str,
                   daemon: bool) -> multiprocessing.process.BaseProcess:
    """An unstarted process that runs ``target(*args)`` in a child of the server (started here if it
    is not yet) with this process's environment and standard output and error as of its start."""
    start_fork_server()
    return _CONTEXT.Process(target=_run, args=(_Parent(), target, args), name=name, daemon=daemon)


class _Parent:
    """Pickled at the process's start: the parent's environment and standard streams then."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple[Any, ...]]:
        return _adopt, (dict(os.environ), _duplicate(1), _duplicate(2))


def _duplicate(fd: int) -> Any:
    """``fd`` sent along with the start (multiprocessing passes it to the child); None if closed here."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def _adopt(environ: dict[str, str], stdout: Any, stderr: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for fd, duplicate in ((1, stdout), (2, stderr)):
        if duplicate is not None:
            inherited = duplicate.detach()
            os.dup2(inherited, fd)
            os.close(inherited)


def _run(parent: None, target: Callable[..., object], args: tuple[Any, ...]) -> None:
    # ``parent`` was taken in as it was unpickled (``_adopt`` returns None). What the server imported
    # is shared with it until written: frozen, the collector never walks it (a full collection would
    # write to every object's header, copying each page the server shares).
    gc.freeze()
    target(*args)
