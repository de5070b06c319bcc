"""The OpenAI-compatible HTTP API (aiohttp) over an :class:`~cadence.engine.async_engine.AsyncEngine`.

``server`` (the ``cadence serve`` verb and the server's lifecycle) · ``app`` (routes, middlewares)
· ``completions`` / ``chat`` (the generation endpoints) · ``serving`` (shared state, admission,
one request's generation) · ``params`` (bodies to prompts and sampling parameters) · ``protocol``
(msgspec bodies) · ``logprobs`` · ``streaming`` (SSE) · ``metrics`` (Prometheus) · ``errors`` ·
``testing`` (a server subprocess, for tests and benchmarks).
"""
