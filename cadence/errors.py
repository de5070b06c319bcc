"""The errors a caller of the engine (``LLM``, ``AsyncEngine``, the HTTP API) can meet.

They live at the bottom floor so that every package (the front end that raises them, the API
that turns them into HTTP statuses) names the same classes.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given; nothing of it was admitted.

    ``param`` names the field to change where one does: ``"prompt"``, ``"max_tokens"``, or a
    :class:`~cadence.sampling_params.SamplingParams` field such as ``"logit_bias"``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine stopped (an actor crashed or the engine-core process died); the request cannot finish."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are pending; the caller should retry later (HTTP 503)."""
