"""The engine-side request: owns its tokens, progress counters, blocks and status."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from cadence.lora_request import LoRARequest
from cadence.messages import NewRequestData, TokenLogprobs
from cadence.sampling_params import ExtraArg, SamplingParams

_NO_EXTRA_ARGS: Mapping[str, ExtraArg] = MappingProxyType({})


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PREEMPTED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason of a finished status; the one place that maps them."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class RequestView(Protocol):
    """What policies and the KV allocator may read of a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def user(self) -> str | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def status(self) -> RequestStatus: ...
    @property
    def extra_args(self) -> Mapping[str, ExtraArg]:
        """The request's own fields for policies (``vllm_xargs`` over HTTP; empty when none)."""
        ...
    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter it runs with (None: the base model); a policy may batch by it."""
        ...


@dataclass
class Drafts:
    """A decoding request's speculative drafts (docs/speculative_decoding.md): the worker's last
    proposal, how many of them the step being run verifies, and how well they have been accepted
    (``core/speculation.py``)."""

    token_ids: list[int] = field(default_factory=list)
    num_scheduled: int = 0
    # Drafts accepted and judged, exponentially weighted: their ratio estimates the chance that a
    # draft is accepted (starting from 2 of 3).
    accepted: float = 2.0
    tried: float = 3.0
    paused_steps: int = 0
    # How long the last pause between probes lasted (0: none since a draft was last accepted).
    pause: int = 0


class Request:
    """One sequence inside the engine core (``n > 1`` is fanned out before it gets here)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        max_model_len: int,
        priority: int = 0,
        user: str | None = None,
        client_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.user = user
        self.client_id = client_id  # the caller's request id, for traces
        self.lora_request = lora_request
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens that came from the prefix cache at the first admission (usage's cached_tokens).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        # Why it failed, once FINISHED_ERROR: sent to the client, which otherwise sees only "error".
        self.error: str | None = None
        # With sampling_params.prompt_logprobs: those computed so far (of prompt tokens 1, 2 ...),
        # sent with the first output token; a recompute after preemption adds none twice.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_sent = False
        self.drafts = Drafts()
        room = max_model_len - len(prompt_token_ids)
        requested = sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def extra_args(self) -> Mapping[str, ExtraArg]:
        return self.sampling_params.extra_args or _NO_EXTRA_ARGS

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def cache_salt(self) -> str | None:
        """Keys its prefix-cache blocks apart from those of other adapters and of the base model."""
        return None if self.lora_request is None else self.lora_request.cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def first_run(self) -> bool:
        """Whether the request has neither produced a token nor been preempted: scheduled now, this
        is its first step (its queue time ends here)."""
        return not self.output_token_ids and self.num_preemptions == 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def new_request_data(self, block_ids: list[list[int]]) -> NewRequestData:
        """The request whole, for a worker that does not hold it (new, or back from a preemption)."""
        return NewRequestData(request_id=self.request_id, token_ids=list(self.all_token_ids),
                              num_prompt_tokens=self.num_prompt_tokens, sampling_params=self.sampling_params,
                              eos_token_id=self.eos_token_id, block_ids=block_ids,
                              num_computed_tokens=self.num_computed_tokens, lora_request=self.lora_request)

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        """Keep the logprobs of prompt tokens ``start`` on (computed in a step), but those kept
        already (a recompute after a preemption computes them again)."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token without one
        if start <= have:
            self.prompt_logprobs.extend(entries[have - start:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """Every prompt logprob, the first time it is asked once the prompt is done; else None."""
        if self.sampling_params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token causes, if any."""
        params = self.sampling_params
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_output_tokens <= params.min_tokens:
            return None
        last = self.output_token_ids[-1]
        if (not params.ignore_eos and last == self.eos_token_id) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
