"""Whether an output constraint (JSON schema, regex, choice, grammar) compiles, checked once per
distinct constraint, off the event loop and within a deadline.

Each distinct constraint (by :attr:`StructuredOutputsParams.key`) is checked by
:func:`cadence.core.structured_output.check_constraint` in a thread of its own, whose outcome is
kept (the last :data:`CACHE_SIZE` constraints): a repeat is answered from it at once, and a repeat
that comes while the check runs waits for that same check instead of starting another. A request
waits at most ``timeout_s`` for it (``--grammar-compile-timeout``), then gets a 400 that says so;
the check runs on to its end in its own thread, blocking nothing else.

A constraint whose check took longer than ``timeout_s`` stays refused (while it is remembered),
even once the check has passed: the engine core would compile it again, against the vocabulary,
which costs more still (a 1.1 MB JSON schema checked here in 5.6 s then took 90 s in the engine
core, holding its one grammar thread). ``check_constraint`` keeps its own cache of the constraints
that passed, so the engine's admission check of a request that passed here costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict

import anyio

from cadence.api.errors import bad_request
from cadence.core.structured_output import ConstraintKey, check_constraint
from cadence.sampling_params import StructuredOutputsParams

# As many as check_constraint's own cache holds.
CACHE_SIZE = 256


class _Check:
    """One constraint's check: a thread of its own, and its outcome once done."""

    __slots__ = ("_loop", "done", "elapsed_s", "error")

    def __init__(self, constraint: StructuredOutputsParams) -> None:
        self._loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.error: Exception | None = None
        self.elapsed_s = 0.0
        threading.Thread(target=self._run, args=(constraint,), name="cadence-constraint-check", daemon=True).start()

    def _run(self, constraint: StructuredOutputsParams) -> None:
        start = time.monotonic()
        try:
            check_constraint(constraint)
        except Exception as exc:
            self.error = exc
        finally:
            self.elapsed_s = time.monotonic() - start
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                self._loop.call_soon_threadsafe(self.done.set)


class ConstraintChecks:
    """The checks of one server's constraints; see the module's docstring."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._checks: OrderedDict[ConstraintKey, _Check] = OrderedDict()

    @property
    def num_running(self) -> int:
        return sum(not check.done.is_set() for check in self._checks.values())

    async def check(self, constraint: StructuredOutputsParams, param: str) -> None:
        """:raises APIError: 400 naming ``param`` when the constraint does not compile (the message
            says why), nests too deeply, or has not compiled within ``timeout_s``
            (``grammar_compile_timeout``)."""
        key = constraint.key
        check = self._checks.get(key)
        if check is None:
            check = self._checks[key] = _Check(constraint)
            if len(self._checks) > CACHE_SIZE:
                self._checks.popitem(last=False)
        else:
            self._checks.move_to_end(key)
        with anyio.move_on_after(self.timeout_s):
            await check.done.wait()
        error = check.error
        if not check.done.is_set() or (error is None and check.elapsed_s > self.timeout_s):
            raise bad_request(f"{param}: the constraint did not compile within {self.timeout_s:g} s "
                              "(--grammar-compile-timeout); simplify it", param=param,
                              code="grammar_compile_timeout")
        if isinstance(error, ValueError):
            raise bad_request(f"{param}: {error}", param=param) from None
        if isinstance(error, RecursionError):
            raise bad_request(f"{param}: the constraint nests too deeply to compile", param=param) from None
        if error is not None:
            raise error
