"""An incremental ordered queue for policies whose order of waiting requests is a key fixed at entry.

Sorting every waiting request every step costs ``O(n log n)`` Python calls a step: thousands of
waiting requests in an overloaded engine (or simulation) make the sort the step's largest cost. A
:class:`WaitingQueue` keeps the order as requests come and go (``O(log n)`` each) and
:meth:`SchedulingPolicy.order_waiting` returns it; the scheduler reads it lazily, only as far as it
admits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

from sortedcontainers import SortedKeyList

from cadence.request import RequestView


class WaitingQueue:
    """Requests ordered by ``key(request)`` (smallest first), ties by the order they were added.

    Add a request when it arrives and when it is preempted (:meth:`add` ignores one already in), and
    discard it when it is admitted or finishes. The key is computed once, at :meth:`add`: it must
    not change while the request waits (a score that all waiting requests share a change of, such as
    aging by a global count, can be kept relative: see ``sjf``).
    """

    def __init__(self, key: Callable[[RequestView], Any]) -> None:
        self._key = key
        self._entries: dict[str, tuple[Any, int, RequestView]] = {}
        self._order: SortedKeyList = SortedKeyList(key=lambda entry: entry[:2])
        self._sequence = count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[RequestView]:
        """The requests in order; do not add or discard while iterating."""
        return (entry[2] for entry in self._order)

    def add(self, request: RequestView) -> None:
        if request.request_id in self._entries:
            return
        entry = (self._key(request), next(self._sequence), request)
        self._entries[request.request_id] = entry
        self._order.add(entry)

    def discard(self, request_id: str) -> bool:
        """Remove the request if it is queued; whether it was."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self._order.remove(entry)
        return True
