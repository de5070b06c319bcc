"""The HTTP parser's own errors in OpenAI's shape.

A request aiohttp cannot parse (a header line ending in a bare LF, a header over ``max_field_size``
8190 bytes, a malformed request line ...) never reaches the app or its middlewares: aiohttp's
connection handler, ``web.RequestHandler.handle_error``, answers it with a plain-text 400 and
closes the connection. aiohttp offers no option for that answer, so :class:`APIRunner` (an
``AppRunner`` serving the app the same way) gives its connections a handler whose ``handle_error``
answers in OpenAI's shape instead, status kept, connection still closed. It overrides
``AppRunner._make_server`` and builds the ``web.Server`` from the one aiohttp made: private
surface, whose breakage on an aiohttp upgrade ``tests/api/test_request_limits_server.py`` catches.
"""

from __future__ import annotations

import logging

from aiohttp import web

from cadence.api.errors import APIError

logger = logging.getLogger(__name__)
_MAX_MESSAGE_CHARS = 300


class _RequestHandler(web.RequestHandler):
    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: too late for another response
            raise ConnectionError("a response has been sent already; cannot send an error")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            error = APIError(status, "internal server error", code="internal_error")
        else:
            # aiohttp's messages quote the bytes at fault over several lines: one line, cut short.
            reason = " ".join((message or str(exc) or "malformed request").split())[:_MAX_MESSAGE_CHARS]
            logger.info("malformed HTTP request from %s: %s", request.remote, reason)
            error = APIError(status, f"the HTTP request could not be parsed: {reason}", code="bad_http_request")
        response = error.response()
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class APIRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer what the HTTP parser rejects in OpenAI's shape."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(made.request_handler, request_factory=made.request_factory,
                       handler_cancellation=made.handler_cancellation, **made._kwargs)
