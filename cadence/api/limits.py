"""The HTTP server's limits on what a client may send, with their defaults and why (what each
failure looks like to a client: ``docs/operations.md``). Imports nothing, so that the CLI can show
them without loading the server.
"""

from __future__ import annotations

# ``--max-request-body-bytes``. A full 128K-token context fits with room to spare in any common
# form: as token ids about 0.8 MB, as ASCII text about 0.5 MB, as CJK text \u-escaped (json.dumps'
# default) about 1.2 MB. The limit also bounds the event loop's one synchronous pass over a body
# (checking and decoding it): measured on 2 shared cores, at most ~0.1 s per MiB of the most
# expensive JSON (a million small lists). aiohttp's default of 1 MiB is short of a long context;
# vLLM sets none.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20

# ``--request-read-timeout``: a whole body must arrive within it, from the end of the headers; 4 MiB
# in 10 s is 400 KB/s, slower than any client that is not stalled.
DEFAULT_REQUEST_READ_TIMEOUT_S = 10.0

# How long a connection may sit without a request: idle between requests, or still sending the
# headers of its first (aiohttp times both from the connection's start or last response, and closes
# it at the end). nginx's default; aiohttp's own is 3630 s, which let a client that trickles its
# headers hold a connection for an hour. Clients' pools close idle connections sooner (httpx 5 s).
KEEPALIVE_TIMEOUT_S = 75.0

# ``--preprocess-timeout``: tokenizing a request's prompts (and rendering its chat template). A 4 MiB
# body of text tokenizes in ~2.5 s here (2.4 MB in 1.5 s): 10 s leaves room for a busy machine.
DEFAULT_PREPROCESS_TIMEOUT_S = 10.0

# ``--grammar-compile-timeout``: checking that a structured-output constraint compiles. Common
# schemas and regexes take milliseconds (the first constrained request also imports xgrammar, ~0.2 s);
# a 1 MB JSON schema took 5.6 s, which is not a schema a server should compile on demand.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 5.0

# Arrays and objects inside one another, the body's own object counting as 1. A chat request needs
# 4, a JSON schema about 2 per level of its own nesting: 64 leaves room for schemas 30 levels deep,
# while what recurses over a body later (msgspec, json, jsonschema, xgrammar, Jinja) stays far below
# Python's recursion limit of 1000 frames.
MAX_JSON_DEPTH = 64

# Seconds an overloaded server asks a client to wait before retrying (``Retry-After`` on the 503
# ``engine_overloaded``): the queue moves by whole requests, so a second is the shortest wait likely
# to find room; clients back off from there.
RETRY_AFTER_S = 1
