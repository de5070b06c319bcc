"""A request's JSON body, read at the edge: its media type, its size, the time it may take to
arrive, its encoding and its nesting depth are checked before it is decoded and type-checked in one
pass, so that no body, however hostile, reaches the handlers as anything but a 4xx or a request.

In order, each failure in OpenAI's error shape:

- 415 ``unsupported_content_type``: a ``Content-Type`` other than ``application/json`` (a
  ``charset`` parameter is allowed if it is UTF-8);
- 413 ``request_too_large``: a ``Content-Length`` over the limit (refused before reading), or a
  body that grows past it while read (chunked);
- 408 ``request_timeout``: a body that has not all arrived within the read timeout (one shorter than
  its ``Content-Length``, or trickled); the connection is closed after the answer;
- 400: invalid UTF-8, nesting deeper than :data:`MAX_JSON_DEPTH`, malformed JSON, or a field of the
  wrong type or out of range (``param`` names it).
"""

from __future__ import annotations

import gc
import logging
import uuid
from typing import Any, TypeVar

import anyio
import msgspec
import numpy as np
from aiohttp import web

from cadence.api.errors import APIError, bad_request, from_validation_error
from cadence.api.limits import MAX_JSON_DEPTH

JSON_MEDIA_TYPE = "application/json"
# Above this size the collector is paused while a body is decoded: a body of a million small lists
# otherwise triggers a collection every 700 of them (4 MiB took 2 s instead of 0.3 s).
_PAUSE_GC_BYTES = 64 * 2**10

T = TypeVar("T")
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])
logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256
_REQUEST_ID = web.RequestKey("cadence_request_id", str)  # where request_id_of keeps it on the request


def request_id_of(request: web.BaseRequest) -> str:
    """The request's id, as vLLM takes it: its ``X-Request-Id`` header, else one made here (also for
    a header over :data:`MAX_REQUEST_ID_CHARS` characters, with a warning). The response echoes it
    in the same header, and logs about the request name it."""
    known = request.get(_REQUEST_ID)
    if known is None:
        known = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        if len(known) > MAX_REQUEST_ID_CHARS:
            known = uuid.uuid4().hex
            logger.warning("request %s: its %s header is over %d characters; this id replaces it", known,
                           REQUEST_ID_HEADER, MAX_REQUEST_ID_CHARS)
        request[_REQUEST_ID] = known
    return str(known)


async def read_json(request: web.Request, kind: type[T], *, max_bytes: int, timeout_s: float) -> T:
    """The request's body as a ``kind``, after every check above.

    :raises APIError: 415, 413, 408 or 400 (see the module's docstring).
    """
    check_content_type(request)
    raw = await read_body(request, max_bytes=max_bytes, timeout_s=timeout_s)
    result = decode_request(raw, kind)
    ignored = unknown_fields(raw, kind)
    if ignored:  # as vLLM: said once, so that a client can learn what had no effect
        logger.warning("request %s: ignored unknown fields %s", request_id_of(request), ", ".join(ignored))
    return result


def unknown_fields(raw: bytes, kind: type[Any]) -> list[str]:
    """The top-level fields of a body (decoded as ``kind`` already) that ``kind`` does not have."""
    known = getattr(kind, "__struct_fields__", None)
    if known is None:
        return []
    return sorted(set(_top_level.decode(raw)) - set(known))


def check_content_type(request: web.BaseRequest) -> None:
    """:raises APIError: 415 unless the body is declared JSON (in UTF-8, if a charset is given)."""
    given = request.headers.get("Content-Type")
    charset = request.charset
    if given is not None and request.content_type == JSON_MEDIA_TYPE and (
            charset is None or charset.lower() in ("utf-8", "utf8")):
        return
    stated = f"the header 'Content-Type: {given}'" if given is not None else "no Content-Type header"
    raise APIError(415, f"Unsupported content type: this endpoint only accepts '{JSON_MEDIA_TYPE}' bodies (in "
                        f"UTF-8), but the request has {stated}; send 'Content-Type: {JSON_MEDIA_TYPE}'",
                   code="unsupported_content_type")


async def read_body(request: web.BaseRequest, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, within ``max_bytes`` and ``timeout_s``.

    :raises APIError: 413 over ``max_bytes`` (by ``Content-Length`` before reading, else while
        reading); 408 when it has not all arrived within ``timeout_s``, with the connection marked
        to close (a body that stops short leaves the stream mid-request).
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes, f"its Content-Length is {declared} bytes")  # refused unread
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(max_bytes, f"it grew past {max_bytes} bytes while read")
    except TimeoutError:
        of = f" of the {declared} bytes announced" if declared is not None else ""
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (--request-read-timeout): "
                            f"{len(body)} bytes came{of}; send the whole body at once", code="request_timeout",
                       close=True) from None
    return bytes(body)


def _too_large(max_bytes: int, why: str) -> APIError:
    return APIError(413, f"the request body is too large: {why}; this server's limit is {max_bytes} bytes "
                         "(--max-request-body-bytes)", code="request_too_large")


def decode_request(raw: bytes, kind: type[T]) -> T:
    """Check the body's encoding and nesting, then decode and type-check it in one pass.

    :raises APIError: 400 for invalid UTF-8, nesting deeper than :data:`MAX_JSON_DEPTH`, malformed
        JSON, or a missing, mistyped or out-of-range field (``param`` names it).
    """
    try:
        raw.decode()  # msgspec does not check the strings it skips (unknown fields)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8: {exc}") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests arrays and objects {depth} deep; the limit is {MAX_JSON_DEPTH}",
                          code="json_too_deep")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    pause = len(raw) > _PAUSE_GC_BYTES and gc.isenabled()
    if pause:
        gc.disable()
    try:
        result: T = decoder.decode(raw)
        return result
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # not reachable below MAX_JSON_DEPTH; never a 500 if it were
        raise bad_request("the request body nests too deeply", code="json_too_deep") from None
    finally:
        if pause:
            gc.enable()


# Bytes that matter to nesting: string quotes and brackets (escapes are removed before).
_DROP = bytes(b for b in range(256) if b not in b'"[]{}')


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, brackets inside strings not counted.

    Linear and without recursion (a few passes of C and numpy over the bytes: about 20 ms per MiB of
    brackets here); for a text that is not JSON it is some number, and the decoder then says why.
    """
    # Escaped backslashes first, so that what remains of ``\\"`` is a real quote; then escaped quotes.
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    if not text:
        return 0
    chars = np.frombuffer(text, dtype=np.uint8)
    outside = (np.cumsum(chars == ord('"'), dtype=np.int64) & 1) == 0
    steps = ((chars == ord("[")) | (chars == ord("{"))).astype(np.int8)
    steps -= ((chars == ord("]")) | (chars == ord("}"))).astype(np.int8)
    steps *= outside
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))
