"""A scripted OpenAI-style completions server for the load generator's tests: every reply streams
``TOKENS_PER_REPLY`` token chunks ``GAP_S`` apart (chunk ``HELD_BACK``'s text empty, as a server
sends a token whose text it holds back), then usage; the prompt ``"fail"`` gets a 400. Its chat
endpoint streams a role-only opening first, then the same chunks as deltas.
``/metrics`` exports vLLM's prefix-cache counters: each reply adds its ``PROMPT_TOKENS`` to the
queries, and every reply after the first ``HITS_PER_REPLY`` to the hits (the first finds nothing
cached)."""

from __future__ import annotations

import asyncio
import json

import aiohttp.web

TOKENS_PER_REPLY = 5
HELD_BACK = 2
GAP_S = 0.02
PROMPT_TOKENS = 7
HITS_PER_REPLY = 3
_REPLIES = aiohttp.web.AppKey("replies", list[int])


async def _completions(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    body = await request.json()
    chat = "messages" in body
    if (body["messages"][0]["content"] if chat else body["prompt"]) == "fail":
        return aiohttp.web.json_response({"error": {"message": "no", "type": "x", "param": None, "code": None}},
                                         status=400)
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if chat:
        opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(opening)}\n\n".encode())
    for i in range(TOKENS_PER_REPLY):
        await asyncio.sleep(GAP_S)
        text = "" if i == HELD_BACK else f"t{i}"
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        chunk = {"choices": [{**choice, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": TOKENS_PER_REPLY,
                                      "total_tokens": PROMPT_TOKENS + TOKENS_PER_REPLY}}
    await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    request.app[_REPLIES][0] += 1
    return response


async def _metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
    replies = request.app[_REPLIES][0]
    lines = []
    for name, value in (("queries", PROMPT_TOKENS * replies), ("hits", HITS_PER_REPLY * max(0, replies - 1))):
        lines += [f"# TYPE vllm:prefix_cache_{name}_total counter",
                  f'vllm:prefix_cache_{name}_total{{engine="0",model_name="m"}} {float(value)}']
    return aiohttp.web.Response(text="\n".join(lines) + "\n")


def completions_app() -> aiohttp.web.Application:
    app = aiohttp.web.Application()
    app[_REPLIES] = [0]
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/metrics", _metrics)
    return app
