"""The model runner: a persistent batch of request states, per-step input preparation, forward, sampling.

The scheduler sends new requests whole and running ones as deltas; the runner keeps each request's
tokens and block table between steps and appends the tokens it samples itself, so a decode step
needs no token ids from the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cadence.backends.base import AttentionBackend, BatchLayout
from cadence.executor.sampler import Sampler, apply_grammar_bitmask
from cadence.executor.sampling_plan import SamplingRow
from cadence.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from cadence.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
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
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
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

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._row = None


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor
    sampled_states: list[CachedRequestState]


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
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()
        self.states: dict[str, CachedRequestState] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(scheduler_output.step_id, [], [])
        inputs = self._prepare_inputs(scheduler_output)
        metadata = self.backend.build_metadata(inputs.layout, self.device)
        with torch.inference_mode():
            forward_start = time.perf_counter()
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata,
                                inputs.logits_indices)
            # Host time: on the CPU the forward has finished here (a GPU's may still be running).
            forward_time = time.perf_counter() - forward_start
            if not inputs.sampled_states:  # only partial prefills this step
                return ModelRunnerOutput(scheduler_output.step_id, [], [], forward_time_s=forward_time)
            if scheduler_output.grammar_bitmask is not None:
                apply_grammar_bitmask(logits, [s.request_id for s in inputs.sampled_states],
                                      scheduler_output.grammar_bitmask)
            sampled = self.sampler(logits, [s.sampling_row() for s in inputs.sampled_states])
        for state, token_id in zip(inputs.sampled_states, sampled.token_ids, strict=True):
            state.append(token_id)
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id,
            request_ids=[s.request_id for s in inputs.sampled_states],
            sampled_token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            forward_time_s=forward_time,
        )

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for request_id in out.preempted_request_ids:
            self.states.pop(request_id, None)
        for new in out.new_requests:
            self.states[new.request_id] = CachedRequestState.from_new(new)
        for cached in out.cached_requests:
            state = self.states[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        num_reqs = len(out.num_scheduled_tokens)
        counts = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = np.empty(num_reqs, dtype=np.int64)
        max_blocks = 1
        input_ids: list[int] = []
        sampled_states: list[CachedRequestState] = []
        logits_indices: list[int] = []
        states = [self.states[request_id] for request_id in out.num_scheduled_tokens]
        for i, state in enumerate(states):
            start = state.num_computed_tokens
            end = start + int(counts[i])
            seq_lens[i] = end
            input_ids.extend(state.token_slice(start, end))
            max_blocks = max(max_blocks, len(state.block_ids))
            if end == state.num_tokens:
                sampled_states.append(state)
                logits_indices.append(int(query_start_loc[i + 1]) - 1)
            state.num_computed_tokens = end
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, :len(state.block_ids)] = state.block_ids
        # Positions run from each request's first new token to its last.
        positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - np.repeat(
            query_start_loc[:-1] - (seq_lens - counts), counts)
        req_index = np.repeat(np.arange(num_reqs), counts)
        slot_mapping = block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs
        layout = BatchLayout(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=torch.from_numpy(slot_mapping),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(positions).to(self.device),
            layout=layout,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            sampled_states=sampled_states,
        )
