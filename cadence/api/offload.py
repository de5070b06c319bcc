"""Request preparation too slow for the event loop (tokenizing prompts, rendering chat templates,
decoding token ids) runs in a worker thread with a deadline, so that ``/health`` and every other
request keep being answered meanwhile: the tokenizer's Rust code and Jinja's Python both let the
event loop run while they work (measured: 2.4 MB of text took 1.5 s to tokenize in a thread while
the loop's longest wait was 46 ms).

A thread cannot be stopped: one past its deadline is abandoned (the request gets its 400 at once;
the thread runs to its end and its result is dropped). What bounds the work it may still do is the
body size limit and the prompt pre-check in ``params.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from cadence.api.errors import bad_request

T = TypeVar("T")


async def in_thread(work: Callable[[], T], *, timeout_s: float, what: str, param: str | None) -> T:
    """``work()`` in a worker thread; what it raises (an ``APIError`` of its own) propagates.

    :raises APIError: 400 ``preprocessing_timeout`` when it takes longer than ``timeout_s``.
    """
    try:
        with anyio.fail_after(timeout_s):
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except TimeoutError:
        raise bad_request(f"{what} took longer than {timeout_s:g} s (--preprocess-timeout); send a shorter "
                          "or simpler input", param=param, code="preprocessing_timeout") from None
