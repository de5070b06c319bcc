"""The workers' warm-up: every class of step that serving runs, once, before the engine core is ready.

A step's first run of a kind pays for what later ones find done: a GPU compiles its Triton kernels
on first use, oneDNN builds a primitive for each new matmul shape, the allocators grow their pools
to a big step's activations, the sampler's paths (greedy, top-p/top-k, penalties, logprobs) run
their first kernels. Without a warm-up the first burst after start pays all of that inside its
users' first tokens. So before ready the engine core runs scratch requests through its own workers:
a prefill of up to 512 tokens alone, a step that mixes its decode with several short prompts'
prefills, and decode-only steps, sampled each way.

The scratch requests go through a scheduler and KV allocator of their own over the workers' cache
(empty at start: nothing is overwritten), so the engine's scheduler, policy, prefix cache and step
budget see none of them; the last scratch step tells the workers to drop them. docs/architecture.md,
"Processes and actors" (start-up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from cadence.config import EngineConfig
from cadence.core.cost_model import CostModel
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.executor.base import Executor
from cadence.policies.base import PolicyContext
from cadence.policies.clock import WallClock
from cadence.policies.loader import load_policy
from cadence.request import Request, RequestStatus
from cadence.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The longest scratch prompt. A bigger step's first run only touches more of the same buffers for the
# first time, which is small beside such a step: on a 2-core AVX2 CPU in float32 a 2,048-token
# warm-up prefill took about 4 of the warm-up's 5.6 s, and the first burst of 2,048 tokens after a
# 512-token warm-up ran as fast as the later ones (docs/performance.md, "The first burst after start").
_MAX_PREFILL = 512
_SHORT_PROMPT, _SHORT_OUTPUT = 16, 2  # four of these fit a latency target of 100 ms beside a decode
_MAX_STEPS = 64  # a guard: the scratch requests take three steps
# The short prompts: each way a token is chosen (greedy, top-p and top-k, penalties, logprobs).
_SAMPLING = (
    SamplingParams(max_tokens=_SHORT_OUTPUT, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=_SHORT_OUTPUT, temperature=1.0, top_p=0.9, top_k=50, seed=0, ignore_eos=True),
    SamplingParams(max_tokens=_SHORT_OUTPUT, temperature=0.7, min_p=0.05, presence_penalty=0.5,
                   frequency_penalty=0.5, repetition_penalty=1.1, seed=0, ignore_eos=True),
    SamplingParams(max_tokens=_SHORT_OUTPUT, temperature=0.0, logprobs=2, ignore_eos=True),
)


@dataclass(frozen=True)
class WarmUpStep:
    """One scratch step: how many requests prefilled and decoded in it, and its tokens."""

    prefills: int
    decodes: int
    num_tokens: int


def warm_up(executor: Executor, config: EngineConfig, hf_config: PretrainedConfig,
            windows: Sequence[int | None]) -> list[WarmUpStep]:
    """Run the scratch requests through ``executor`` until they finish; the steps they took.
    ``windows`` are the KV cache groups' sliding windows, as the engine's allocator has them."""
    started = time.perf_counter()
    scheduler = scratch_scheduler(executor, config, windows)
    allocator = scheduler.allocator
    long, *short = _requests(config, hf_config.vocab_size, allocator.capacity_tokens // config.cache.block_size)
    # The long prompt has the first step to itself whatever the budget; the short ones come after it,
    # so that they prefill beside its decode (or its next chunk).
    scheduler.add_request(long)
    steps: list[WarmUpStep] = []
    for _ in range(_MAX_STEPS):  # the last step has nothing to run: it tells the workers what finished
        if not scheduler.has_work:
            break
        step = scheduler.schedule()
        if step.num_scheduled_tokens:
            steps.append(_classify(step.num_scheduled_tokens, scheduler))
        scheduler.update_from_output(executor.execute_model(step))
        for request in short:
            scheduler.add_request(request)
        short = []
    else:  # never on a sound engine: drop what is left rather than start with it
        scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
        executor.execute_model(scheduler.schedule())
    logger.info("warmed up in %.1f s: %d steps", time.perf_counter() - started, len(steps))
    return steps


def scratch_scheduler(executor: Executor, config: EngineConfig, windows: Sequence[int | None],
                      cost_model: CostModel | None = None) -> Scheduler:
    """An FCFS scheduler, with the engine's settings (and ``cost_model`` for its latency target), of
    scratch requests over the workers' cache (empty before the engine core is ready): it shares none
    of the engine's state."""
    sched = config.scheduler
    allocator = KVCacheManager(executor.num_blocks, config.cache.block_size, False, windows=windows)
    return Scheduler(sched, allocator, load_policy("fcfs", PolicyContext.of(sched, WallClock())), cost_model=cost_model)


def _requests(config: EngineConfig, vocab_size: int, free_blocks: int) -> list[Request]:
    """The scratch requests, sized to fit ``free_blocks`` all at once (a small test cache included)."""
    max_len, block_size = config.model.max_model_len, config.cache.block_size
    short_blocks = -(-(_SHORT_PROMPT + _SHORT_OUTPUT) // block_size)
    num_short = min(len(_SAMPLING), config.scheduler.max_num_seqs - 1, free_blocks // (2 * short_blocks))
    room = (free_blocks - num_short * short_blocks) * block_size - 2  # the long prompt's two tokens out
    prefill = max(1, min(_MAX_PREFILL, config.scheduler.max_num_batched_tokens, max_len - 2, room))
    # The long prompt first: alone in a step, then a decode beside the short prompts' prefills; they
    # decode together after.
    prompts = [(prefill, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    prompts += [(min(_SHORT_PROMPT, max_len - _SHORT_OUTPUT), params) for params in _SAMPLING[:num_short]]
    return [Request(f"warm-up-{i}", [(7 * j + i + 1) % vocab_size for j in range(length)], params,
                    eos_token_id=None, arrival_time=0.0, max_model_len=max_len)
            for i, (length, params) in enumerate(prompts)]


def _classify(scheduled: dict[str, int], scheduler: Scheduler) -> WarmUpStep:
    decodes = sum(1 for request_id, num in scheduled.items() if scheduler.requests[request_id].num_output_tokens)
    return WarmUpStep(prefills=len(scheduled) - decodes, decodes=decodes, num_tokens=sum(scheduled.values()))
