"""The OpenAI-compatible HTTP API (aiohttp) over an :class:`~cadence.engine.async_engine.AsyncEngine`.

``server`` (the ``cadence serve`` verb and the server's lifecycle) · ``app`` (routes, middlewares)
· ``completions`` / ``chat`` (the generation endpoints) · ``serving`` (shared state, admission,
one request's generation) · ``request_body`` (reading and decoding a body at the edge) · ``params``
(bodies to prompts and sampling parameters) · ``offload`` (slow preparation in worker threads) ·
``constraints`` (structured-output checks, cached, with a deadline) · ``limits`` (the limits'
defaults) · ``connection`` (the HTTP parser's errors in OpenAI's shape) · ``protocol`` (msgspec
bodies) · ``logprobs`` · ``streaming`` (SSE) · ``metrics`` (Prometheus) · ``errors`` · ``testing``
(a server subprocess, for tests and benchmarks).
"""
