"""The OpenAI-compatible HTTP API (aiohttp) over an :class:`~cadence.engine.async_engine.AsyncEngine`.

``server`` (the ``cadence serve`` verb and the server's lifecycle) · ``app`` (routes, middlewares)
· ``completions`` / ``chat`` / ``responses`` (the generation endpoints) · ``conversation`` (a
conversation into a chat-style request's prompt) · ``chat_output`` (a chat choice's text into its
message: reasoning, tool calls) · ``tools`` (tool choice and its constraint) ·
``responses_protocol`` / ``responses_conversation`` / ``responses_output`` / ``responses_events``
(the Responses API's bodies, its request as a chat conversation, its output items, its stream
events) · ``response_store`` (stored responses, for ``previous_response_id``) ·
``tool_parsers`` / ``reasoning_parsers`` (the plugins) · ``serving`` (shared state, admission,
one request's generation) · ``request_body`` (reading and decoding a body at the edge) · ``params``
(bodies to prompts and sampling parameters) · ``offload`` (slow preparation in worker threads) ·
``constraints`` (structured-output checks, cached, with a deadline) · ``limits`` (the limits'
defaults) · ``connection`` (the HTTP parser's errors in OpenAI's shape) · ``protocol`` (msgspec
bodies) · ``logprobs`` · ``streaming`` (SSE) · ``metrics`` (Prometheus) · ``errors`` · ``testing``
(a server subprocess, for tests and benchmarks).
"""
