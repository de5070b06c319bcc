"""The actor that joins a receiving channel to local mailboxes, routing each message by type."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import anyio

from cadence.runtime.actor import Actor, Mailbox
from cadence.runtime.channel import ReceiveChannel

logger = logging.getLogger(__name__)


class Forwarder(Actor[Any]):
    """Reads ``channel`` until it closes; sends each message to the mailbox routed for its type."""

    def __init__(self, channel: ReceiveChannel[Any], routes: Mapping[type, Mailbox[Any]], name: str) -> None:
        super().__init__()
        self.channel = channel
        self.routes = dict(routes)
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def run(self) -> None:
        while True:
            try:
                message = await self.channel.receive()
            except anyio.EndOfStream:
                return
            target = self.routes.get(type(message))
            if target is None:
                logger.warning("%s dropped an unexpected %s", self._name, type(message).__name__)
                continue
            await target.send(message)
