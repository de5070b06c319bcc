"""The model runner: a persistent batch of request states, per-step input preparation, forward, sampling.

The scheduler sends new requests whole and running ones as deltas; the runner keeps each request's
tokens and block table between steps and appends the tokens it samples itself, so a decode step
needs no token ids from the scheduler.

A request has a block table per KV cache group (docs/architecture.md, "KV cache groups"); each
step builds one batch layout per group, the backend's metadata of each, and hands the model one
metadata per layer (its group's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cadence.backends.base import AttentionBackend, BatchLayout
from cadence.executor.sampler import Sampler, apply_grammar_bitmask
from cadence.executor.sampling_plan import SamplingRow
from cadence.executor.speculation import Drafter, verify
from cadence.executor.step_layout import step_layout
from cadence.lora.manager import LoRAManager
from cadence.lora_request import LoRARequest
from cadence.messages import ModelRunnerOutput, NewRequestData, PromptLogprobs, SchedulerOutput
from cadence.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    # Rebuilt only when the outputs change; the sampler reads it for penalties and seeds.
    _row: SamplingRow | None = field(default=None, repr=False)

    @classmethod
    def from_new(cls, data: NewRequestData) -> CachedRequestState:
        return cls(
            request_id=data.request_id,
            prompt_token_ids=data.token_ids[:data.num_prompt_tokens],
            output_token_ids=data.token_ids[data.num_prompt_tokens:],
            sampling_params=data.sampling_params,
            eos_token_id=data.eos_token_id,
            block_ids=[list(ids) for ids in data.block_ids],
            num_computed_tokens=data.num_computed_tokens,
            lora_request=data.lora_request,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def sampling_row(self) -> SamplingRow:
        if self._row is None:
            self._row = SamplingRow(self.sampling_params, self.prompt_token_ids,
                                    list(self.output_token_ids), self.eos_token_id)
        return self._row

    def append(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._row = None

    def draft_rows(self, drafts: list[int]) -> list[SamplingRow]:
        """The rows that verify ``drafts``: one per position, each seeing the drafts before it as
        outputs, so penalties and per-position seeds are those the tokens would meet one at a time."""
        rows = [self.sampling_row()]
        outputs = self.output_token_ids
        rows += [SamplingRow(self.sampling_params, self.prompt_token_ids, outputs + drafts[:i], self.eos_token_id)
                 for i in range(1, len(drafts) + 1)]
        return rows


@dataclass
class PromptRows:
    """The step's rows whose logits give prompt logprobs: of which prompt token, for which request."""

    rows: list[int] = field(default_factory=list)  # token index in the step
    targets: list[int] = field(default_factory=list)  # the prompt token that follows
    top_counts: list[int] = field(default_factory=list)
    parts: list[tuple[str, int, int]] = field(default_factory=list)  # request, first prompt token, count

    def add(self, state: CachedRequestState, first_row: int, start: int, end: int) -> None:
        """The positions ``start`` to ``end`` of ``state``, from ``first_row`` on, where the prompt goes on."""
        k = state.sampling_params.prompt_logprobs
        last = min(end, len(state.prompt_token_ids) - 1)
        if k is None or last <= start:
            return
        self.rows.extend(range(first_row, first_row + last - start))
        self.targets.extend(state.prompt_token_ids[start + 1:last + 1])
        self.top_counts.extend([k] * (last - start))
        self.parts.append((state.request_id, start + 1, last - start))


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layouts: list[BatchLayout]  # per KV cache group
    logits_indices: torch.Tensor  # the sampled rows (a speculating request: one per draft, plus one), then prompt rows
    sampled_states: list[CachedRequestState]
    drafts: list[list[int]]  # aligned with sampled_states: the drafts each verifies this step
    prompt: PromptRows


class ModelRunner:
    """Runs one model over a paged KV cache; owns the cache tensors and the persistent batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler | None = None,  # a tensor-parallel worker passes one that broadcasts rank 0's tokens
        layer_groups: list[int] | None = None,  # each layer's KV cache group (default: one group)
        drafter: Drafter | None = None,  # speculative decoding: proposes each request's next drafts
        lora: LoRAManager | None = None,  # --enable-lora: the adapters' slots in the model's layers
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups or [0] * len(kv_caches)
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()
        self.drafter = drafter
        self.lora = lora
        self.states: dict[str, CachedRequestState] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(scheduler_output.step_id, [], [])
        inputs = self._prepare_inputs(scheduler_output)
        per_group = [self.backend.build_metadata(layout, self.device) for layout in inputs.layouts]
        metadata = [per_group[g] for g in self.layer_groups]
        with torch.inference_mode():
            forward_start = time.perf_counter()
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata,
                                inputs.logits_indices)
            # Host time: on the CPU the forward has finished here (a GPU's may still be running).
            forward_time = time.perf_counter() - forward_start
            prompt_logprobs = self._prompt_logprobs(logits, inputs) if inputs.prompt.rows else None
            if not inputs.sampled_states:  # only partial prefills this step
                return ModelRunnerOutput(scheduler_output.step_id, [], [], forward_time_s=forward_time,
                                         prompt_logprobs=prompt_logprobs)
            rows = [row for state, drafts in zip(inputs.sampled_states, inputs.drafts, strict=True)
                    for row in (state.draft_rows(drafts) if drafts else [state.sampling_row()])]
            logits = logits[:len(rows)]
            if scheduler_output.grammar_bitmask is not None:
                row_ids = [state.request_id for state, drafts in zip(inputs.sampled_states, inputs.drafts, strict=True)
                           for _ in range(len(drafts) + 1)]
                apply_grammar_bitmask(logits, row_ids, scheduler_output.grammar_bitmask)
            sampled = self.sampler(logits, rows)
        verified = verify(inputs.sampled_states, inputs.drafts, sampled)
        draft_start = time.perf_counter()
        drafts = None if self.drafter is None else self.drafter.propose(inputs.sampled_states,
                                                                         scheduler_output.draft_counts)
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id,
            request_ids=[s.request_id for s in inputs.sampled_states],
            sampled_token_ids=verified.last_tokens,
            logprobs=verified.logprobs,
            forward_time_s=forward_time,
            prompt_logprobs=prompt_logprobs,
            num_accepted_drafts=verified.num_accepted if scheduler_output.spec_token_ids else None,
            draft_token_ids=drafts,
            draft_time_s=time.perf_counter() - draft_start,
        )

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: StepInputs) -> list[PromptLogprobs]:
        prompt = inputs.prompt
        entries = self.sampler.prompt_logprobs(logits[len(inputs.sampled_states):], prompt.targets,
                                               prompt.top_counts)
        parts, at = [], 0
        for request_id, start, count in prompt.parts:
            parts.append(PromptLogprobs(request_id, start, entries[at:at + count]))
            at += count
        return parts

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for request_id in out.preempted_request_ids:
            self.states.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget([*out.finished_request_ids, *out.preempted_request_ids])
        for new in out.new_requests:
            self.states[new.request_id] = CachedRequestState.from_new(new)
        for cached in out.cached_requests:
            state = self.states[cached.request_id]
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        order = list(out.num_scheduled_tokens)
        if self.lora is not None:  # each adapter's rows together: a large step runs them as slices
            order.sort(key=lambda request_id: _adapter_key(self.states[request_id]))
        counts = [out.num_scheduled_tokens[r] for r in order]
        states = [self.states[request_id] for request_id in order]
        starts = [state.num_computed_tokens for state in states]
        layout = step_layout([state.block_ids for state in states], starts, counts, self.block_size)
        input_ids: list[int] = []
        sampled_states: list[CachedRequestState] = []
        step_drafts: list[list[int]] = []
        logits_indices: list[int] = []
        prompt = PromptRows()
        if self.lora is not None:
            self.lora.prepare([state.lora_request for state in states], counts)
        for i, state in enumerate(states):
            start = state.num_computed_tokens
            end = start + counts[i]
            drafts = out.spec_token_ids.get(state.request_id, [])
            input_ids.extend(state.token_slice(start, end - len(drafts)))
            input_ids.extend(drafts)
            prompt.add(state, int(layout.query_start_loc[i]), start, end)
            if end == state.num_tokens + len(drafts):
                sampled_states.append(state)
                step_drafts.append(drafts)
                last = int(layout.query_start_loc[i + 1])
                logits_indices.extend(range(last - 1 - len(drafts), last))
            state.num_computed_tokens = end  # verify() takes back the rejected drafts
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(layout.positions).to(self.device),
            layouts=layout.layouts,
            logits_indices=torch.tensor(logits_indices + prompt.rows, dtype=torch.long, device=self.device),
            sampled_states=sampled_states,
            drafts=step_drafts,
            prompt=prompt,
        )


def _adapter_key(state: CachedRequestState) -> int:
    """Orders a step's requests by LoRA adapter (the base model first); the sort is stable."""
    return 0 if state.lora_request is None else state.lora_request.lora_int_id
