"""Replays a simulator workload against the real in-process engine, in real time.

Each request is submitted when its arrival time comes (``anyio.sleep_until``) and read back as a
stream; the time of every delta that carries tokens is recorded, so the result is the same
:class:`~cadence.bench.metrics.RequestRecord` list the simulator produces. Calibration and the
fidelity benchmark both use it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import numpy as np

from cadence.bench.metrics import RequestRecord
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.llm import LLM
from cadence.engine.request_manager import RequestHandle
from cadence.sampling_params import SamplingParams
from cadence.sim.workload import FIRST_ORDINARY_ID, RequestSpec


def replay(engine: LLM, specs: Sequence[RequestSpec], seed: int = 0) -> list[RequestRecord]:
    """Run ``specs`` through ``engine`` at their arrival times; records in ``specs``' order.

    Arrival and chunk times are seconds from the first arrival. Prompts without token ids get
    random ones (seeded) above the special-token range of the model's vocabulary.
    """
    return anyio.run(replay_async, engine, specs, seed)


async def replay_async(engine: LLM, specs: Sequence[RequestSpec], seed: int = 0) -> list[RequestRecord]:
    prompts = _prompts(specs, engine.limits.vocab_size, seed)
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_time)
    arrivals = [0.0] * len(specs)
    chunks: list[list[float]] = [[] for _ in specs]
    counts = [0] * len(specs)
    origin = time.perf_counter()
    first = specs[order[0]].arrival_time if specs else 0.0

    async def follow(i: int, handle: RequestHandle) -> None:
        async for delta in handle.deltas():
            n = sum(len(seq.token_ids) for seq in delta.outputs)
            if n:
                chunks[i].append(time.perf_counter() - origin)
                counts[i] += n

    async with engine.running() as running, anyio.create_task_group() as group:
        start = anyio.current_time()
        for i in order:
            await anyio.sleep_until(start + specs[i].arrival_time - first)
            arrivals[i] = time.perf_counter() - origin
            handle = await _submit(running, f"replay-{i}", prompts[i], specs[i])
            group.start_soon(follow, i, handle)
    return [
        RequestRecord(arrival_time=arrivals[i], chunk_times=chunks[i], prompt_tokens=spec.prompt_tokens,
                      output_tokens=counts[i], request_id=spec.request_id or str(i), user=spec.user,
                      priority=spec.priority)
        for i, spec in enumerate(specs)
    ]


async def _submit(engine: AsyncEngine, request_id: str, prompt: list[int], spec: RequestSpec) -> RequestHandle:
    params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True,
                            extra_args=None if spec.extra_args is None else dict(spec.extra_args))
    return await engine.submit(engine.prepare(prompt, params), request_id, priority=spec.priority, user=spec.user)


def _prompts(specs: Sequence[RequestSpec], vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(s.prompt_token_ids) if s.prompt_token_ids is not None
            else rng.integers(FIRST_ORDINARY_ID, vocab_size, size=s.prompt_tokens).tolist() for s in specs]
