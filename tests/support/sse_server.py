"""A scripted OpenAI-style completions server for the load generator's tests: every reply streams
``TOKENS_PER_REPLY`` text chunks ``GAP_S`` apart, then usage; the prompt ``"fail"`` gets a 400."""

from __future__ import annotations

import asyncio
import json

import aiohttp.web

TOKENS_PER_REPLY = 5
GAP_S = 0.02


async def _completions(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "fail":
        return aiohttp.web.json_response({"error": {"message": "no", "type": "x", "param": None, "code": None}},
                                         status=400)
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(TOKENS_PER_REPLY):
        await asyncio.sleep(GAP_S)
        chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": TOKENS_PER_REPLY, "total_tokens": 12}}
    await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return response


def completions_app() -> aiohttp.web.Application:
    app = aiohttp.web.Application()
    app.router.add_post("/v1/completions", _completions)
    return app
