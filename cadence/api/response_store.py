"""Stored responses (``store``, true unless a request says false), for ``previous_response_id``: each
kept as the conversation a later request continues (its input and output as chat messages, without
its ``instructions``, which apply to one request only, as OpenAI's do).

In memory and bounded: the last :data:`RESPONSE_STORE_SIZE` responses stored or continued are
kept, the least recently used one leaves first, and a server restart forgets them all. A response
that is not kept is a 404 naming ``previous_response_id``, as vLLM answers for an unknown one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from aiohttp import web

from cadence.api.errors import APIError
from cadence.api.protocol import ChatMessage

RESPONSE_STORE_SIZE = 1024


class ResponseStore:
    """Response id -> the conversation up to and including that response, least recently used out first."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE) -> None:
        self.size = size
        self._conversations: OrderedDict[str, tuple[ChatMessage, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def conversation(self, response_id: str) -> tuple[ChatMessage, ...]:
        """:raises APIError: 404 for a response that was never stored, or has left the store."""
        found = self._conversations.get(response_id)
        if found is None:
            raise APIError(404, f"Previous response with id {response_id!r} not found: this server keeps the last "
                                f"{self.size} responses made with store true, in memory", param="previous_response_id",
                           code="previous_response_not_found")
        self._conversations.move_to_end(response_id)
        return found

    def keep(self, response_id: str, conversation: Sequence[ChatMessage]) -> None:
        self._conversations[response_id] = tuple(conversation)
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.size:
            self._conversations.popitem(last=False)


RESPONSE_STORE = web.AppKey("cadence_response_store", ResponseStore)
