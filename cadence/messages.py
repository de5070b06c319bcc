"""Every message that crosses an actor or process boundary.

All are msgspec Structs tagged by class name so that one channel can carry a union and one
encoder/decoder per channel serves it. ``array_like`` keeps frames small; ``gc=False`` keeps the
garbage collector off these short-lived objects (none of them form reference cycles).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from cadence.lora_request import LoRARequest
from cadence.sampling_params import SamplingParams


class _Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


# ---- front end -> engine core -------------------------------------------------------------


class EngineCoreRequest(_Message):
    """A new request for the engine core: tokenized, validated, already fanned out for ``n``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    user: str | None = None
    client_id: str | None = None  # the caller's request id (traces name the request by it)
    lora_request: LoRARequest | None = None  # the adapter it runs with (docs/lora.md)


class AbortRequests(_Message):
    """Finish these requests now (client gone, stop string found, shutdown)."""

    request_ids: list[str]


# ---- scheduler -> executor -----------------------------------------------------------------


class NewRequestData(_Message):
    """A request the worker has not seen (or a preempted one coming back): sent whole."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far (non-empty after a preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None  # masked while fewer than min_tokens are out
    block_ids: list[list[int]]  # one table per KV cache group
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


class CachedRequestData(_Message):
    """A request the worker already holds: only what changed."""

    request_id: str
    new_block_ids: list[list[int]]  # appended to each KV cache group's table
    num_computed_tokens: int


class SchedulerOutput(_Message):
    """One engine step. ``num_scheduled_tokens`` fixes the batch order (insertion order)."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # Dropped by the worker before this step runs.
    finished_request_ids: list[str]
    preempted_request_ids: list[str]
    # Only when some request that samples this step has a structured-output constraint.
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: the drafted tokens each request's scheduled tokens end with (after its
    # last sampled token), to be verified in this step (docs/speculative_decoding.md).
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # How many drafts to propose after this step for each request that samples in it (the
    # scheduler's back-off; absent: none, so a draft model is not run for drafts nobody verifies).
    draft_counts: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class GrammarBitmask(_Message):
    """The tokens each constrained request may sample this step (structured output)."""

    request_ids: list[str]  # row i is request_ids[i]'s; each samples this step
    bitmask: torch.Tensor  # xgrammar's packed int32 [rows, ceil(vocab / 32)]: bit set = allowed


# ---- executor -> scheduler -----------------------------------------------------------------


class TokenLogprobs(_Message):
    """Logprobs at one position: the sampled token first, then the top-k in rank order."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


class PromptLogprobs(_Message):
    """A request's prompt logprobs computed in one step: those of prompt tokens ``start`` on."""

    request_id: str
    start: int  # >= 1: the first prompt token has no logprob
    entries: list[TokenLogprobs]


class ModelRunnerOutput(_Message):
    """Tokens sampled this step, only for requests whose scheduled tokens reached the end."""

    step_id: int
    request_ids: list[str]
    # The last token each request sampled; with speculative decoding, it follows the drafts accepted.
    sampled_token_ids: list[int]
    # When any asked: one entry per token each request emits (its accepted drafts', then its sampled one's).
    logprobs: list[TokenLogprobs] | None = None
    # Speculative decoding (aligned with request_ids): how many of the step's drafts each request
    # accepted, and its drafts for the next step.
    num_accepted_drafts: list[int] | None = None
    draft_token_ids: list[list[int]] | None = None
    # For requests that asked for them, whatever prompt positions this step computed.
    prompt_logprobs: list[PromptLogprobs] | None = None
    forward_time_s: float = 0.0  # the model's forward pass, for the engine's step timing
    draft_time_s: float = 0.0  # proposing draft_token_ids (a draft model's forwards), within the step


class ExecutorFailed(_Message):
    """The worker raised while running a step; the engine core fails and reports this."""

    step_id: int
    error: str


# ---- tensor-parallel worker processes -> executor ------------------------------------------


class WorkerReady(_Message):
    """A worker loaded its shard and allocated its KV cache (the same block count on every rank)."""

    rank: int
    num_blocks: int
    kernel_row_limit: int | None = None  # Worker.kernel_row_limit


class WorkerFailed(_Message):
    """A worker raised, while starting or in a step, and is exiting."""

    rank: int
    error: str


# ---- engine core -> front end --------------------------------------------------------------


class EngineCoreOutput(_Message):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    # Set on a request's first output: seconds from arrival in the engine to its first step.
    queue_time_s: float | None = None
    # With finish reason "error": why the request failed (its grammar did not compile ...), for the client.
    error: str | None = None
    # Once, with the first token: the logprobs of the prompt's tokens from the second on.
    prompt_logprobs: list[TokenLogprobs] | None = None


class SchedulerStats(_Message):
    """The engine core's state after a step, for metrics and health (counters are cumulative)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Engine steps, their wall time and the model forward's part of it (see core/step_timing.py).
    num_steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    lora: LoRAStats | None = None  # with --enable-lora


class LoRAStats(_Message):
    """The LoRA adapters of the running and the waiting requests, as vLLM's ``lora_requests_info`` shows them."""

    max_loras: int
    running: list[str]
    waiting: list[str]

    @classmethod
    def total(cls, parts: Sequence[LoRAStats]) -> LoRAStats:
        """Several engines' adapters as one (each engine's limit is the same)."""
        return cls(parts[0].max_loras, sorted({n for p in parts for n in p.running}),
                   sorted({n for p in parts for n in p.waiting}))


class SpecDecodeStats(_Message):
    """Speculative decoding's cumulative counts, as vLLM names its metrics."""

    num_drafts: int = 0  # verifications: a request's drafted tokens checked in one step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts plus the token each verification samples
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)  # accepted at draft position i

    @classmethod
    def total(cls, parts: Sequence[SpecDecodeStats]) -> SpecDecodeStats:
        """Several engines' counts as one (all with the same ``num_speculative_tokens``)."""
        return cls(sum(p.num_drafts for p in parts), sum(p.num_draft_tokens for p in parts),
                   sum(p.num_accepted_tokens for p in parts), sum(p.num_emitted_tokens for p in parts),
                   [sum(column) for column in zip(*(p.accepted_per_pos for p in parts), strict=True)])


class KVCacheDelta(_Message):
    """The net change of an engine core's prefix cache since its previous output batch, as block
    hashes (see ``block_hash.hash_block``): what the data-parallel router needs of the KV events,
    without their token ids. Apply ``cleared``, then ``removed``, then ``stored``."""

    stored: list[int]
    removed: list[int]
    cleared: bool = False


class EngineCoreOutputs(_Message):
    outputs: list[EngineCoreOutput]
    timestamp: float
    stats: SchedulerStats | None = None
    # Only from an engine core behind a data-parallel router with prefix caching on.
    kv_delta: KVCacheDelta | None = None
    # Requests preempted in the steps since the previous batch (the dashboard's timeline).
    preempted: list[str] = msgspec.field(default_factory=list)


class EngineCoreReady(_Message):
    """The engine-core process loaded the model and sized its KV cache; it takes requests now."""

    num_blocks: int
    block_size: int
    policy: str  # the scheduling policy and its options (SchedulingPolicy.describe)


class EngineDead(_Message):
    """The engine core stopped; every request still pending fails with this message."""

    error: str


# ---- front end internal: request manager <-> detokenizer ----------------------------------


class TrackRequest(_Message):
    """Tells the detokenizer about a new request before its first tokens arrive."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # time.time() when the request manager took it


class CompletionOutput(msgspec.Struct, kw_only=True, gc=False):
    """One sequence of a request's result, as the user sees it (cumulative so far)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """A request's state after a step: the user-facing result of ``LLM.generate``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    # Why a sequence failed in the engine (its finish reason is "error"); the latest, if several did.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (as vLLM);
    # in a stream of deltas, only in the delta where they arrive.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class DetokenizedOutputs(_Message):
    """Detokenizer -> request manager: per-sequence deltas after one step."""

    outputs: list[SequenceDelta]


class SequenceDelta(_Message):
    """What one sequence gained in a step: text, tokens, logprobs, and how it ended."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    # With finish reason "error": why this sequence failed in the engine (its grammar did not compile ...).
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # as EngineCoreOutput's


EngineCoreInput = EngineCoreRequest | AbortRequests
WorkerReply = WorkerReady | ModelRunnerOutput | WorkerFailed
SchedulerInbox = EngineCoreRequest | AbortRequests | ModelRunnerOutput | ExecutorFailed
EngineCoreEvent = EngineCoreOutputs | EngineCoreReady | EngineDead
