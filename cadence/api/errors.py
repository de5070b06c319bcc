"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with their status.

Handlers raise :class:`APIError`; the middleware in ``app.py`` renders it (and turns aiohttp's own
HTTP errors and unexpected exceptions into the same shape).
"""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec
from aiohttp import web

from cadence.api.limits import RETRY_AFTER_S
from cadence.api.protocol import ErrorInfo, ErrorResponse, encode

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error to answer with: HTTP ``status`` and OpenAI's error body (and ``headers``); with
    ``close``, the connection closes once it is sent."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
        self.headers = headers
        self.close = close

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> web.Response:
        response = web.Response(status=self.status, body=encode(self.body()), content_type="application/json",
                                headers=self.headers)
        if self.close:
            response.force_close()
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str) -> APIError:
    """A 503 ``engine_overloaded`` that says when to retry."""
    return APIError(503, message, code="engine_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


# msgspec ends its message with where the value failed, as a JSON path: "... - at `$.messages[0]`"
# (or "... - at `key` in `$.logit_bias`").
_AT_PATH = re.compile(r"`\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    """A 400 naming the offending field (``param``) from a msgspec decode error."""
    message = str(exc)
    param: str | None = None
    if match := _AT_PATH.search(message):
        # A dict's value is "at `$.logit_bias[...]`": the field is what names it.
        param = match.group(1).removesuffix("[...]") or None
    missing = _MISSING.search(message)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return bad_request(message, param=param)


# SamplingParams' messages start with the field they are about ("top_p must be in (0, 1] ...").
_LEADING_FIELD = re.compile(r"^([a-z_]+) ")


def from_value_error(exc: ValueError, fields: frozenset[str], code: str | None = None) -> APIError:
    """A 400 for an out-of-range or inconsistent value; ``param`` when the message names a field."""
    message = str(exc)
    match = _LEADING_FIELD.match(message)
    param = match.group(1) if match and match.group(1) in fields else None
    return bad_request(message, param=param, code=code)
